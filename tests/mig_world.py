"""A small world with dynamic MIG GPUs for the core's tests: its instances are targets, reconfigurations are checked
as the GPU checks them (a busy instance is never destroyed, every layout is valid) and take effect at once."""

from __future__ import annotations

from dataclasses import replace

from carma.core import GpuSample, ProcessExit, Scheduler, SchedulerConfig, SchedulingLoop, Target
from carma.core.grouped import SizeGrouped
from carma.core.mig.geometry import Geometry
from carma.core.mig.partition import Instance, MigGpu
from carma.core.mig.placer import MigPlacer
from carma.core.ports import GpuProcesses, TaskExit, TelemetryReading
from carma.core.types import Launch, MigSlot, Reconfigure, TargetKind


def instance_id(gpu: str, slot: MigSlot) -> str:
    return f"{gpu}/{slot}"


class MigWorld:
    """Clock, telemetry, executor and journal of a server whose GPUs are all dynamic MIG GPUs, starting as one
    idle instance of the largest profile each."""

    def __init__(self, n: int = 1, model: str = "A100-40GB") -> None:
        self.t = 0.0
        self.geometry = Geometry.of(model)
        whole = self.geometry.sizing[-1]
        self.layout = {f"GPU-{i}": MigGpu(f"GPU-{i}", self.geometry, (Instance(whole, 0),)) for i in range(n)}
        self.on: dict[str, int] = {}  # instance id -> the task running there
        self.placed: dict[int, str] = {}  # task -> instance id
        self.log: list[object] = []
        self.exits: list[TaskExit] = []
        self.mem: dict[int, int] = {}  # task -> the memory its instance reads (0 unless a test sets it)

    def scheduler(
        self, config: SchedulerConfig | None = None, scheme: str = "b", min_mib: int = 4096, early=None
    ) -> Scheduler:
        placers: list[MigPlacer] = []

        def wrap(whole):  # type: ignore[no-untyped-def]
            placers.append(MigPlacer(whole, {g: self.geometry for g in self.layout}, min_mib))
            return placers[0]

        def size(task_id: int) -> str:
            return placers[0].profile_for(sched.task(task_id).spec.mem_mib)

        discipline = SizeGrouped(size, max_passes=2) if scheme == "a" else None
        sched = Scheduler(self.gpus(), config, discipline=discipline, placer=wrap, early=early)
        return sched

    def loop(self, **kwargs) -> SchedulingLoop:  # type: ignore[no-untyped-def]
        return SchedulingLoop(self.scheduler(**kwargs), self, self, self, journal=self)

    # Clock, Telemetry
    def now(self) -> float:
        return self.t

    def gpus(self) -> list[Target]:
        out = []
        for gpu, state in self.layout.items():
            for i in state.instances:
                slot = MigSlot(i.profile.name, i.start)
                out.append(
                    Target(
                        instance_id(gpu, slot),
                        f"{self.geometry.model} {i.profile.name}",
                        i.profile.memory_mib or 0,
                        TargetKind.MIG,
                        parent=gpu,
                        shareable=False,
                        slot=slot,
                    )
                )
        return out

    def read(self, now: float) -> TelemetryReading:
        targets = self.gpus()
        samples = [
            GpuSample(t.id, now, self.mem.get(self.on.get(t.id, -1), 0), t.total_mib, None, None, None) for t in targets
        ]
        processes = {
            t.id: GpuProcesses(frozenset({self.on[t.id]}) if t.id in self.on else frozenset()) for t in targets
        }
        return TelemetryReading(samples, processes)

    # Executor, Journal
    def launch(self, task, launch: Launch) -> None:  # type: ignore[no-untyped-def]
        (target,) = launch.gpus
        assert target not in self.on, f"{target} already runs task {self.on[target]}"
        self.on[target] = task.id
        self.placed[task.id] = target
        self.log.append(("launch", task.id, target))

    def kill(self, task_id: int) -> None:
        self.end(task_id, ProcessExit(None, "Killed", signal=9))

    def reconfigure(self, action: Reconfigure) -> None:
        state = self.layout[action.gpu]
        for slot in action.destroy:
            assert instance_id(action.gpu, slot) not in self.on, f"busy instance {slot} destroyed"
            state = replace(
                state,
                instances=tuple(i for i in state.instances if (i.profile.name, i.start) != (slot.profile, slot.start)),
            )
        for slot in action.create:  # MigGpu checks the layout: an invalid one raises InvalidLayout
            state = replace(
                state, instances=(*state.instances, Instance(self.geometry.profile(slot.profile), slot.start))
            )
        self.layout[action.gpu] = state
        self.log.append(("reconfigure", action))

    def end(self, task_id: int, exit: ProcessExit) -> None:
        del self.on[self.placed[task_id]]
        self.exits.append(TaskExit(task_id, exit, self.t))

    def poll_exits(self):  # type: ignore[no-untyped-def]
        exits, self.exits = self.exits, []
        return exits

    def save(self, tasks) -> None:  # type: ignore[no-untyped-def]
        self.log.append(("save", tuple((t.id, t.state.value) for t in tasks)))
