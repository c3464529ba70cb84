"""Placement on dynamic MIG GPUs: the partition manager behind the scheduler's placer.

A GPU whose MIG layout carma may change (`geometries`) is partitioned per task: the task's need known in MiB
with the margin picks the tightest profile (`partition.plan`); an idle instance of it is a placement, else the
plan's steps become a `Reconfigure` the world carries out, and the task is placed on its new instance at a
later decision, once telemetry has read it. Until then the instance is reserved for it. A task of unknown need
starts on the tightest instance holding `min_mib`; after an out-of-memory crash it restarts on the next larger
profile (`Geometry.next_larger`), never a whole GPU, as often as the scheduler's `max_relaunches` allows.
Multi-GPU tasks, and needs larger than any instance, go to the whole-GPU placer with the MIG instances out of
its sight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from carma.core.blocked import Blocked, Preparing
from carma.core.mig.geometry import Geometry, Profile
from carma.core.mig.partition import (
    CreateInstance,
    Instance,
    MigGpu,
    Plan,
    Refusal,
    RefusalReason,
    plan,
)
from carma.core.placer import Placement, Placer
from carma.core.risk import Risk
from carma.core.types import MemoryNeed, MigSlot, NeedKind, Reconfigure, Target, TargetId, Task, TaskId, TaskState
from carma.core.view import View

DEFAULT_MIN_MIB = 4096  # a task of unknown need starts on the tightest instance with this much (a 1g.5gb on an A100)


@dataclass(frozen=True)
class AwaitingInstance(Blocked):
    """The MIG instance made for it (`instance`, e.g. `1g.5gb@6` on GPU `gpu`) is not ready yet."""

    gpu: TargetId
    instance: str


@dataclass(frozen=True)
class NoInstance(Blocked):
    """No MIG instance of the size it needs can be had now: the partition manager's reason, one line."""

    detail: str


@dataclass(frozen=True)
class _Reserved:
    gpu: TargetId
    slot: MigSlot


class MigPlacer:
    """Wraps the whole-GPU placer: one-GPU tasks on dynamic MIG GPUs by the partition manager, the rest by it."""

    def __init__(self, whole: Placer, geometries: Mapping[TargetId, Geometry], min_mib: int = DEFAULT_MIN_MIB) -> None:
        if min_mib <= 0:
            raise ValueError(f"the minimum instance memory must be positive, got {min_mib} MiB")
        self.whole = whole
        self.geometries = dict(geometries)
        self.min_mib = min_mib
        self.margin_mib = whole.config.margin_mib
        self._largest_mib = max(p.memory_mib or 0 for g in self.geometries.values() for p in g.sizing)
        self._reserved: dict[TaskId, _Reserved] = {}  # the instance a plan makes for a task, until it is placed
        # GPUs with a plan carried out or about to be, by the instance it creates and the decision that made it:
        # no other plan touches them until the world lists that instance (two plans made on one stale layout
        # could overlap). A world lists what it created once it carried the plan out, so an instance still not
        # listed at a later decision was never made (the world refused a step): the GPU is planned again.
        self._changing: dict[TargetId, tuple[MigSlot, float]] = {}
        self._offered: dict[TaskId, float] = {}  # when each waiting task was last offered
        self._ran_on: dict[TaskId, Profile] = {}  # the profile of each task's latest MIG instance (OOM restarts)

    # ----------------------------------------------------------------- the scheduler's PlacerPort

    def room_mib(self, target: Target) -> int:
        """An instance of a dynamic MIG GPU can be remade as its GPU's largest profile."""
        geometry = self.geometries.get(target.parent) if target.slot is not None else None
        return target.total_mib if geometry is None else max(p.memory_mib or 0 for p in geometry.sizing)

    def relaunch_need(self, task: Task, need: MemoryNeed) -> MemoryNeed:
        """After an OOM crash on an instance, the next larger profile's memory (less the margin it is placed
        with), which `want_mib` asks for; as asked elsewhere, and after a crash on the largest instance."""
        outgrown = self._ran_on.get(task.id)
        larger = None if outgrown is None else self._larger_than(outgrown)
        if larger is None or larger.memory_mib is None:
            return need
        return MemoryNeed(NeedKind.KNOWN, larger.memory_mib - self.margin_mib, "recovery: a larger MIG instance")

    def ended(self, task_id: TaskId) -> None:
        """An ended task (completed, failed, cancelled while it waited) holds no reservation and needs no profile
        to grow from: a daemon running for months keeps nothing for it."""
        for kept in (self._reserved, self._offered, self._ran_on):
            kept.pop(task_id, None)
        self.whole.ended(task_id)

    def place(self, task: Task, need: MemoryNeed, view: View) -> Placement | Blocked:
        mig = [g for g, t in view.gpus.items() if self._dynamic(t)]
        want = self.want_mib(task, need) if task.spec.gpus == 1 and mig else None
        if want is None:  # many GPUs, no MIG GPU, or it outgrew the largest instance: whole GPUs only
            return self._whole(task, need, view, mig)
        self._offered[task.id] = view.now
        idle = set(view.idle_gpus())
        reserved = self._reserved.get(task.id)
        if reserved is not None:
            target = _find(view.gpus, reserved.gpu, reserved.slot)
            if target is not None and target in idle:
                return self._placed(task, reserved.gpu, target, view)
            if target is not None and target not in view.reported_gpus():
                return AwaitingInstance(reserved.gpu, str(reserved.slot))
            del self._reserved[task.id]  # a task offered before it took or undid its instance: plan again
        states = self.layouts(view.gpus, idle, now=view.now)
        outcome = plan(list(states.values()), want)
        if isinstance(outcome, Refusal):
            if outcome.reason is RefusalReason.TOO_LARGE:
                return self._whole(task, need, view, mig)
            return NoInstance(outcome.detail)
        gpu, slot = outcome.instance.gpu, MigSlot(outcome.instance.profile, outcome.instance.start)
        if not outcome.reconfigures:
            target = _find(view.gpus, gpu, slot)
            assert target is not None, "a plan reuses a listed instance"
            return self._placed(task, gpu, target, view)
        self._reserved[task.id] = _Reserved(gpu, slot)
        self._changing[gpu] = (slot, view.now)
        return Preparing((reconfigure(outcome),))

    def _whole(self, task: Task, need: MemoryNeed, view: View, mig: list[TargetId]) -> Placement | Blocked:
        self._reserved.pop(task.id, None)
        self._ran_on.pop(task.id, None)
        return self.whole.place(task, need, _WholeGpus(view, frozenset(mig)))

    def _placed(self, task: Task, gpu: TargetId, target: TargetId, view: View) -> Placement:
        self._reserved.pop(task.id, None)
        self._offered.pop(task.id, None)
        slot = view.gpus[target].slot
        assert slot is not None
        self._ran_on[task.id] = self.geometries[gpu].profile(slot.profile)
        return Placement((target,))

    # ----------------------------------------------------------------- what it reads

    def want_mib(self, task: Task, need: MemoryNeed) -> int | None:
        """The memory the task's instance must hold: its need in MiB with the margin; for a need not known,
        `min_mib`; for a relaunch after an OOM crash on an instance, the next larger profile's (None when it
        ran out on the largest; a relaunch also keeps what its need asked, and one restarted early holds its
        predicted peak)."""
        asked = self.min_mib if need.mib is None or need.kind is NeedKind.UNKNOWN else self._with_margin(need.mib)
        if task.state is not TaskState.RECOVERING:
            return asked
        first = task.attempts[0].need
        if first is not None and first.mib is not None and first.kind is not NeedKind.UNKNOWN:
            asked = self._with_margin(first.mib)
        if need.kind is NeedKind.KNOWN and need.mib is not None:  # restarted early: its predicted peak
            asked = max(asked, self._with_margin(need.mib))
        outgrown = self._ran_on.get(task.id)
        if outgrown is None:
            return asked  # it crashed on a whole GPU: its need decides
        larger = self._larger_than(outgrown)
        return None if larger is None else max(asked, larger.memory_mib or 0)

    def layouts(self, gpus: Mapping[TargetId, Target], idle: set[TargetId], now: float) -> dict[str, MigGpu]:
        """Each dynamic MIG GPU's layout: an instance is busy unless telemetry shows it idle (an instance still
        being made is not read yet: never destroyed mid-way) and no task offered earlier in this decision holds it
        for itself. A task offered later, or not at all (behind the recovery queue, or in another size group),
        holds nothing against the one offered now: its plan is made again when it is offered, so no reservation
        can block the tasks the queue discipline puts first."""
        reserved = {(r.gpu, r.slot) for t, r in self._reserved.items() if self._offered.get(t) == now}
        listed = {(t.parent, t.slot) for t in gpus.values()}
        for gpu, (slot, planned) in list(self._changing.items()):
            if (gpu, slot) in listed or now > planned:
                del self._changing[gpu]
        instances: dict[str, list[Instance]] = {g: [] for g in self.geometries if g not in self._changing}
        for target_id, t in gpus.items():
            if self._dynamic(t) and t.slot is not None and t.parent in instances:
                profile = self.geometries[t.parent].profile(t.slot.profile)
                busy = target_id not in idle or (t.parent, t.slot) in reserved
                instances[t.parent].append(Instance(profile, t.slot.start, busy))
        return {g: MigGpu(g, self.geometries[g], tuple(i)) for g, i in instances.items()}

    def profile_for(self, mib: int | None) -> str:
        """The profile a need of `mib` (None: not known) picks on the first dynamic GPU: scheme A's group."""
        geometry = next(iter(self.geometries.values()))
        want = self.min_mib if mib is None else self._with_margin(mib)
        fits = geometry.holding(want)
        return fits[0].name if fits else "whole GPU"

    def _larger_than(self, outgrown: Profile) -> Profile | None:
        """The next larger profile than one a task ran out of memory on (None: it was the largest)."""
        return next(g for g in self.geometries.values() if outgrown in g.profiles).next_larger(outgrown)

    def _with_margin(self, mib: int) -> int:
        """A need with the margin, the margin cut to the largest instance: a need the largest holds runs there (as
        a whole GPU's need is cut to its usable memory), where the margin alone sent it to whole GPUs a MIG server
        has none of, and it blocked the queue for good."""
        return min(mib + self.margin_mib, max(mib, self._largest_mib))

    def _dynamic(self, target: Target) -> bool:
        return target.slot is not None and target.parent in self.geometries


def reconfigure(p: Plan) -> Reconfigure:
    """A plan's steps as the core's action."""
    destroy = tuple(MigSlot(s.key.profile, s.key.start) for s in p.steps if not isinstance(s, CreateInstance))
    create = tuple(MigSlot(s.key.profile, s.key.start) for s in p.steps if isinstance(s, CreateInstance))
    return Reconfigure(p.instance.gpu, destroy, create)


def _find(gpus: Mapping[TargetId, Target], gpu: TargetId, slot: MigSlot) -> TargetId | None:
    return next((g for g, t in gpus.items() if t.parent == gpu and t.slot == slot), None)


class _WholeGpus:
    """A view with the dynamic MIG instances hidden: what the whole-GPU placer places on."""

    def __init__(self, view: View, hidden: frozenset[TargetId]) -> None:
        self._view = view
        self._hidden = hidden
        self.gpus = {g: t for g, t in view.gpus.items() if g not in hidden}

    @property
    def now(self) -> float:
        return self._view.now

    def idle_gpus(self) -> list[TargetId]:
        return [g for g in self._view.idle_gpus() if g not in self._hidden]

    def reported_gpus(self) -> list[TargetId]:
        return [g for g in self._view.reported_gpus() if g not in self._hidden]

    def holds_relaunch(self, gpu: TargetId) -> bool:
        return self._view.holds_relaunch(gpu)

    def valid(self, gpu: TargetId) -> bool:
        return self._view.valid(gpu)

    def free_mib(self, gpu: TargetId, hold: bool = True) -> int:
        return self._view.free_mib(gpu, hold)

    def risk(self, gpu: TargetId) -> Risk:
        return self._view.risk(gpu)

    def usable_mib(self, n: int) -> int:
        return self._view.usable_mib(n)
