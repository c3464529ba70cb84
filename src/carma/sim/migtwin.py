"""The twin with dynamic MIG GPUs: every GPU is partitioned by carma, and its MIG instances are the targets.

A GPU starts as one idle instance of its largest profile (MIG mode on, nothing carved yet). A task on an
instance runs at `migspeed.speed_on` of its solo speed (its profile's share of compute and memory system,
PCIe shared by the GPU's busy instances) and fails out of memory when it allocates more than its instance
holds. A reconfiguration removes the instances it destroys at once and lists those it creates, which
telemetry reads only after `reconfiguration_s(steps)`: no task is placed on one before. Timelines, power
and energy stay per physical GPU (NVML reads power per GPU, not per instance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from carma.core.config import SchedulerConfig
from carma.core.grouped import DEFAULT_MAX_PASSES, SizeGrouped
from carma.core.mig.geometry import Geometry, Profile
from carma.core.mig.placer import DEFAULT_MIN_MIB, MigPlacer
from carma.core.placer import Placer
from carma.core.ports import Estimator, GpuProcesses, TelemetryReading
from carma.core.queue import StrictFifo
from carma.core.scheduler import Scheduler
from carma.core.types import (
    GpuSample,
    Launch,
    MigSlot,
    ProcessExit,
    Reconfigure,
    Target,
    TargetId,
    TargetKind,
    Task,
    TaskId,
)
from carma.sim.gpus import GpuType
from carma.sim.migspeed import RECONFIGURATION_S, reconfiguration_s, speed_on
from carma.sim.models import InterferenceModel, PowerModel
from carma.sim.twin import TwinServer, _oom_exit, _SimGpu, target_id

_NO_INTERFERENCE = InterferenceModel(0.0, 0.0, 0.0, 1.0)  # not read: `_slowdowns` is MIG's


@dataclass
class _Instance:
    gpu: int  # its physical GPU's index
    slot: MigSlot
    profile: Profile
    ready_s: float  # when telemetry first reads it (its creation done)
    task: TaskId | None = None

    def target(self, parent: TargetId, model: str) -> Target:
        return Target(
            instance_id(parent, self.slot),
            f"{model} {self.slot.profile}",
            self.profile.memory_mib or 0,
            TargetKind.MIG,
            parent=parent,
            compute=self.profile.compute_slices,
            shareable=False,
            slot=self.slot,
        )


class MigTwinServer(TwinServer):
    """`TwinServer` whose GPUs are all dynamic MIG GPUs."""

    def __init__(
        self,
        gpus: Sequence[GpuType],
        scheduler_factory: Callable[[list[Target]], Scheduler],
        power: PowerModel,
        oracle_memory: bool,
        step_s: float = RECONFIGURATION_S,
    ) -> None:
        self.geometries = geometries(gpus)  # before the base class asks for the scheduler
        self._step_s = step_s
        self._instances: dict[TargetId, _Instance] = {}
        self._on: dict[TaskId, TargetId] = {}  # the instance each live task runs on
        self.reconfigurations = 0
        for i, geometry in enumerate(self.geometries.values()):
            whole = geometry.sizing[-1]
            self._instances[instance_id(target_id(i), MigSlot(whole.name, 0))] = _Instance(
                i, MigSlot(whole.name, 0), whole, ready_s=0.0
            )
        super().__init__(gpus, scheduler_factory, _NO_INTERFERENCE, "mps", power, 0.0, oracle_memory)

    # ----------------------------------------------------------------- Telemetry

    def gpus(self) -> list[Target]:
        return [i.target(target_id(i.gpu), self._model(i.gpu)) for i in sorted(self._instances.values(), key=_order)]

    def _model(self, gpu: int) -> str:
        return self.geometries[target_id(gpu)].model

    def read(self, now: float) -> TelemetryReading:
        whole = super().read(now)  # advances the 1 Hz grid; its per-GPU samples name no target here
        times = sorted({s.t for s in whole.samples})
        samples, processes = [], {}
        for iid, inst in self._instances.items():
            if inst.ready_s > now:
                continue  # still being made: not read, so no task is placed on it
            ready = [t for t in times if t >= inst.ready_s]
            used = self._gpus[inst.gpu].allocated.get(inst.task, 0) if inst.task is not None else 0
            total = inst.profile.memory_mib or 0
            samples += [GpuSample(iid, t, used, total, None, None, None) for t in ready]
            shown = inst.task is not None and inst.task in self._gpus[inst.gpu].allocated
            processes[iid] = GpuProcesses(frozenset({inst.task}) if shown and inst.task is not None else frozenset())
        return TelemetryReading(samples, processes)

    # ----------------------------------------------------------------- Executor

    def launch(self, task: Task, launch: Launch) -> None:
        (iid,) = launch.gpus
        self._instances[iid].task = task.id
        self._on[task.id] = iid
        self._index[iid] = self._instances[iid].gpu
        super().launch(task, launch)

    def reconfigure(self, action: Reconfigure) -> None:
        parent = action.gpu
        gone = [instance_id(parent, s) for s in action.destroy]
        for iid in gone:
            inst = self._instances.get(iid)
            if inst is None or inst.task is not None:
                raise ValueError(f"cannot destroy MIG instance {iid}: {'busy' if inst else 'no such instance'}")
        gpu = next(i for i, g in enumerate(self._gpus) if g.id == parent)
        for iid in gone:
            del self._instances[iid]
        ready = self._now + reconfiguration_s(action.steps, self._step_s)
        geometry = self.geometries[parent]
        for slot in action.create:
            self._instances[instance_id(parent, slot)] = _Instance(gpu, slot, geometry.profile(slot.profile), ready)
        self.reconfigurations += 1
        self._tick_at(self._next_grid(ready))

    # ----------------------------------------------------------------- the GPU model

    def _allocate(self, task_id: TaskId, total_mib: int) -> bool:
        inst = self._instances[self._on[task_id]]
        capacity = inst.profile.memory_mib or 0
        if total_mib > capacity:
            gpu = self._gpus[inst.gpu]
            own = gpu.allocated.get(task_id, 0)
            self._end(task_id, _oom_exit(inst.gpu, total_mib - own, capacity, capacity - own))
            return False
        self._gpus[inst.gpu].allocated[task_id] = total_mib
        return True

    def _end(self, task_id: TaskId, exit: ProcessExit) -> None:
        iid = self._on.pop(task_id, None)
        if iid is not None and iid in self._instances:
            self._instances[iid].task = None
        super()._end(task_id, exit)

    def _slowdowns(self, gpu: _SimGpu) -> dict[TaskId, float]:
        busy = len(gpu.running)
        geometry = self.geometries[gpu.id]
        out = {}
        for task_id in gpu.running:
            profile = self._instances[self._on[task_id]].profile
            out[task_id] = 1.0 / speed_on(self._tasks[task_id].load, profile, geometry, busy_instances=busy)
        return out


def geometries(gpus: Sequence[GpuType]) -> dict[TargetId, Geometry]:
    """Each twin GPU's MIG geometry, by its target id."""
    return {target_id(i): Geometry.of(kind.name) for i, kind in enumerate(gpus)}


def instance_id(gpu: TargetId, slot: MigSlot) -> TargetId:
    """The twin's id of a MIG instance: its GPU's and its place (`SIM-GPU-0/3g.20gb@4`)."""
    return f"{gpu}/{slot}"


def _order(instance: _Instance) -> tuple[int, int]:
    return instance.gpu, instance.slot.start


SCHEMES = ("a", "b")  # MIGM's: a groups the queue by size (bounded), b is FIFO


def mig_server(
    gpus: Sequence[GpuType],
    config: SchedulerConfig,
    estimator: Estimator | None,
    scheme: str,
    power: PowerModel,
    oracle_memory: bool,
    max_passes: int = DEFAULT_MAX_PASSES,
    min_mib: int = DEFAULT_MIN_MIB,
) -> MigTwinServer:
    """A dynamic MIG twin whose scheduler partitions every GPU by the task's need (`MigPlacer`) and orders the
    queue by `scheme`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown MIG scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    placers: list[MigPlacer] = []

    def size(task_id: TaskId) -> str:
        """The profile the task's need picks: scheme A's group."""
        task = server.loop.scheduler.task(task_id)
        mib = task.spec.mem_mib
        if mib is None and estimator is not None:
            need = estimator.need(task)
            mib = None if need is None else need.mib
        return placers[0].profile_for(mib)

    def make_scheduler(targets: list[Target]) -> Scheduler:
        def wrap(whole: Placer) -> MigPlacer:
            placers.append(MigPlacer(whole, geometries(gpus), min_mib))
            return placers[-1]

        discipline = SizeGrouped(size, max_passes) if scheme == "a" else StrictFifo()
        return Scheduler(targets, config, estimator, discipline, placer=wrap)

    server = MigTwinServer(gpus, make_scheduler, power, oracle_memory)
    return server
