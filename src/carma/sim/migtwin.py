"""The twin with MIG GPUs: every GPU is partitioned, and its MIG instances are the targets.

With dynamic MIG (`mig_server`) carma partitions the GPUs per task: a GPU starts as one idle instance of its
largest profile (MIG mode on, nothing carved yet). With static MIG (`static_server`, MISO's baseline) each GPU
starts with a given layout that nothing changes. A task on an
instance runs at `migspeed.speed_on` of its solo speed (its profile's share of compute and memory system,
PCIe shared by the GPU's busy instances) and fails out of memory when it allocates more than its instance
holds. A reconfiguration removes the instances it destroys at once and lists those it creates, which
telemetry reads only after `reconfiguration_s(steps)`: no task is placed on one before. Timelines, power
and energy stay per physical GPU (NVML reads power per GPU, not per instance).

A workload named in `growing` grows as in the whole-GPU twin; past its instance it fails out of memory, unless
the scheduler's growth prediction (`carma.core.early`) restarted it on a larger instance first.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from carma.core.config import SchedulerConfig
from carma.core.early import EarlyRestarts
from carma.core.grouped import DEFAULT_MAX_PASSES
from carma.core.mig.geometry import Geometry, Profile
from carma.core.mig.placer import DEFAULT_MIN_MIB
from carma.core.mig.scheduling import MigConfig, mig_scheduler
from carma.core.ports import Estimator, GpuProcesses, TelemetryReading
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
    """`TwinServer` whose GPUs are all MIG GPUs, each starting with its layout in `layouts` (default: one idle
    instance of its largest profile, for dynamic MIG to split)."""

    def __init__(
        self,
        gpus: Sequence[GpuType],
        scheduler_factory: Callable[[list[Target]], Scheduler],
        power: PowerModel,
        oracle_memory: bool,
        step_s: float = RECONFIGURATION_S,
        growing: Mapping[str, int] | None = None,
        layouts: Sequence[Sequence[MigSlot]] | None = None,
    ) -> None:
        self.geometries = geometries(gpus)  # before the base class asks for the scheduler
        self._step_s = step_s
        self._instances: dict[TargetId, _Instance] = {}
        self._on: dict[TaskId, TargetId] = {}  # the instance each live task runs on
        self._history: dict[TaskId, list[tuple[float, int]]] = {}  # the attempt's memory over time, as read
        self.reconfigurations = 0
        for i, geometry in enumerate(self.geometries.values()):
            slots = layouts[i] if layouts is not None else (MigSlot(geometry.sizing[-1].name, 0),)
            for slot, profile in checked_layout(geometry, slots):
                self._instances[instance_id(target_id(i), slot)] = _Instance(i, slot, profile, ready_s=0.0)
        super().__init__(gpus, scheduler_factory, _NO_INTERFERENCE, "mps", power, 0.0, oracle_memory, growing)

    # ----------------------------------------------------------------- Telemetry

    def gpus(self) -> list[Target]:
        return [i.target(target_id(i.gpu), self._model(i.gpu)) for i in sorted(self._instances.values(), key=_order)]

    def _model(self, gpu: int) -> str:
        return self.geometries[target_id(gpu)].model

    def expected_s(self, task_id: TaskId) -> float | None:
        """How long a live task's run takes alone on its instance, by the speed model (None: not running)."""
        iid = self._on.get(task_id)
        if iid is None:
            return None
        inst, w = self._instances[iid], self._tasks[task_id].workload
        return w.solo_s / speed_on(w, inst.profile, self.geometries[target_id(inst.gpu)])

    def read(self, now: float) -> TelemetryReading:
        whole = super().read(now)  # advances the 1 Hz grid; its per-GPU samples name no target here
        times = sorted({s.t for s in whole.samples})
        samples, processes = [], {}
        for iid, inst in self._instances.items():
            if inst.ready_s > now:
                continue  # still being made: not read, so no task is placed on it
            ready = [t for t in times if t >= inst.ready_s]
            total = inst.profile.memory_mib or 0
            samples += [GpuSample(iid, t, self._used(inst.task, t), total, None, None, None) for t in ready]
            shown = inst.task is not None and inst.task in self._gpus[inst.gpu].allocated
            processes[iid] = GpuProcesses(frozenset({inst.task}) if shown and inst.task is not None else frozenset())
        return TelemetryReading(samples, processes)

    def _used(self, task_id: TaskId | None, t: float) -> int:
        """What the task on an instance held at `t`."""
        history = self._history.get(task_id, []) if task_id is not None else []
        at = bisect_right(history, (t, float("inf")))
        return history[at - 1][1] if at else 0

    # ----------------------------------------------------------------- Executor

    def launch(self, task: Task, launch: Launch) -> None:
        (iid,) = launch.gpus
        self._instances[iid].task = task.id
        self._on[task.id] = iid
        self._history[task.id] = []
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
        self._history[task_id].append((self._now, total_mib))
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


def checked_layout(geometry: Geometry, slots: Sequence[MigSlot]) -> list[tuple[MigSlot, Profile]]:
    """The instances of a layout a GPU can hold, with their profiles; ValueError, in one line, for one it cannot
    (an unknown or `+me` profile, one of unknown memory, a start the profile does not allow, overlapping
    instances, too many compute slices)."""
    out = []
    for slot in slots:
        profile = geometry.profile(slot.profile)
        if profile.media or profile.memory_mib is None:
            why = "a +me profile" if profile.media else "its memory is not known"
            raise ValueError(
                f"MIG layout: {slot.profile} is not offered to tasks ({why}); profiles: {_sized(geometry)}"
            )
        if slot.start not in profile.starts:
            starts = ", ".join(map(str, profile.starts))
            raise ValueError(f"MIG layout: {slot.profile} cannot start at memory slice {slot.start} (only {starts})")
        out.append((slot, profile))
    if (
        not out
        or len(set(slots)) < len(out)
        or not geometry.reachable(geometry.bits(geometry.slot(p, s.start) for s, p in out))
    ):
        text = layout_text(slots) or "nothing"
        raise ValueError(f"MIG layout {text}: no layout of {geometry.model} holds these instances (they overlap)")
    return out


def _sized(geometry: Geometry) -> str:
    return ", ".join(p.name for p in geometry.sizing)


def full_layouts(geometry: Geometry) -> tuple[tuple[MigSlot, ...], ...]:
    """Every full layout of the geometry (`Geometry.layouts`) as the instances to make: each slot taken by the
    profile of its shape that tasks are given (never `+me`); a layout with a profile of unknown memory is left
    out."""
    shapes = {(p.memory_slices, p.compute_slices): p for p in geometry.sizing}
    out = []
    for layout in geometry.layouts:
        slots = [(shapes.get((s.memory_slices, s.compute_slices)), s.start) for s in sorted(layout)]
        if all(p is not None and start in p.starts for p, start in slots):
            out.append(tuple(MigSlot(p.name, start) for p, start in slots if p is not None))
    return tuple(out)


def parse_layout(text: str) -> tuple[MigSlot, ...]:
    """`3g.20gb@0,2g.10gb@4,1g.5gb@6` as instances (checked against a geometry by `checked_layout`)."""
    slots = []
    for item in text.split(","):
        profile, at, start = item.strip().partition("@")
        if not (profile and at and start.strip().isdigit()):
            raise ValueError(
                f"MIG layout {text!r}: give instances as PROFILE@START joined by commas, e.g. 4g.20gb@0,3g.20gb@4"
            )
        slots.append(MigSlot(profile.strip(), int(start)))
    return tuple(slots)


def layout_text(slots: Sequence[MigSlot]) -> str:
    """A layout as `parse_layout` reads it."""
    return ",".join(map(str, slots))


def instance_id(gpu: TargetId, slot: MigSlot) -> TargetId:
    """The twin's id of a MIG instance: its GPU's and its place (`SIM-GPU-0/3g.20gb@4`)."""
    return f"{gpu}/{slot}"


def _order(instance: _Instance) -> tuple[int, int]:
    return instance.gpu, instance.slot.start


def mig_server(
    gpus: Sequence[GpuType],
    config: SchedulerConfig,
    estimator: Estimator | None,
    scheme: str,
    power: PowerModel,
    oracle_memory: bool,
    predict: bool = True,
    growing: Mapping[str, int] | None = None,
    max_passes: int = DEFAULT_MAX_PASSES,
    min_mib: int = DEFAULT_MIN_MIB,
    step_s: float = RECONFIGURATION_S,
) -> MigTwinServer:
    """A dynamic MIG twin whose scheduler (`mig_scheduler`) partitions every GPU by the task's need, orders the
    queue by `scheme` and, with `predict`, restarts a task early when its memory is predicted to outgrow its
    instance. The prediction's horizon is the time left of the run the twin's speed model gives on its
    instance (what a history of earlier runs on that profile would say); its warm-up, the catalog's. Each step
    of a reconfiguration takes `step_s`."""
    mig = MigConfig("dynamic", scheme, max_passes, min_mib, predict)

    def make_scheduler(targets: list[Target]) -> Scheduler:
        early = EarlyRestarts(remaining, lambda task: server.workload(task.id).warmup_s) if predict else None
        return mig_scheduler(targets, config, estimator, geometries(gpus), mig, early)

    def remaining(task: Task, now: float) -> float | None:
        expected, attempt = server.expected_s(task.id), task.current
        if expected is None or attempt is None:
            return None
        return max(0.0, expected - (now - attempt.dispatched_s))

    server = MigTwinServer(gpus, make_scheduler, power, oracle_memory, step_s, growing=growing)
    return server


def static_server(
    gpus: Sequence[GpuType],
    config: SchedulerConfig,
    estimator: Estimator | None,
    power: PowerModel,
    oracle_memory: bool,
    layouts: Sequence[Sequence[MigSlot]],
    growing: Mapping[str, int] | None = None,
) -> MigTwinServer:
    """A MIG twin whose GPUs keep `layouts` (one for every GPU, or one per GPU) for the whole run: MISO's static
    baseline. As in the daemon's static MIG mode, each instance is an exclusive target of the whole-GPU placer (no
    `MigPlacer`, so nothing is ever reconfigured) and an OOM relaunch goes to an idle instance with more memory.
    Best fit takes the tightest idle instance that holds a need with the margin, and no reserve is kept on an
    instance: the dynamic rule's own sizing, on a layout that does not move. A multi-GPU task never runs (a
    process sees one MIG instance at most): the scheduler refuses it at submission."""
    if len(layouts) == 1:
        layouts = list(layouts) * len(gpus)
    if len(layouts) != len(gpus):
        raise ValueError(f"{len(layouts)} MIG layouts for {len(gpus)} GPUs: give one for every GPU, or one per GPU")
    config = replace(config, policy="bf", reserve_mib=0)
    return MigTwinServer(
        gpus,
        lambda targets: Scheduler(targets, config, estimator),
        power,
        oracle_memory,
        growing=growing,
        layouts=layouts,
    )
