"""The placer: where a task goes now, or why it cannot, as a pure function of the task, its need and a view.

It changes nothing: the scheduler carries a placement out (and tells the policy), or keeps the answer as
the task's waiting reason. The rules are CARMA's (docs/architecture.md, "Decisions, exactly"): a relaunch
after an OOM crash takes whole idle GPUs; a task of a known or unknown need takes idle GPUs when enough are
idle, else shareable ones past their TTFK windows that hold it with the margin and pass the risk filter; the
policy says which it accepts and in what order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from carma.core.blocked import Blocked, MemoryShort, RiskFiltered, TtfkWait, WholeIdle
from carma.core.config import SchedulerConfig
from carma.core.policies import Policy
from carma.core.types import ExitKind, MemoryNeed, NeedKind, Target, TargetId, TargetKind, Task, TaskId, TaskState
from carma.core.view import View


@dataclass(frozen=True)
class Placement:
    """The GPUs a task takes, in the order the rule chose them (the attempt lists them sorted)."""

    gpus: tuple[TargetId, ...]


class Placer:
    def __init__(self, config: SchedulerConfig, policy: Policy) -> None:
        self.config = config
        self.policy = policy

    def place(self, task: Task, need: MemoryNeed, view: View) -> Placement | Blocked:
        """GPUs for `task` with `need` (a relaunch's: whole GPUs), or why it must wait."""
        if task.state is TaskState.RECOVERING:
            return self._relaunch(task, need, view)
        cfg, policy = self.config, self.policy
        n = task.spec.gpus
        idle = self._whole(for_tasks_of(n, view.idle_gpus(), view.gpus), need, n, view)
        if not policy.shares or need.kind is NeedKind.WHOLE_GPU:
            if len(idle) >= n:  # in the policy's order too (Exclusive's is the server's)
                return Placement(tuple(policy.order(idle, view)[:n]))
            return WholeIdle(n, self._whole_mib(need, n, view))
        if cfg.prefer_idle and len(idle) >= n:
            return Placement(tuple(policy.order(idle, view)[:n]))
        shareable = [g for g in view.reported_gpus() if self._shareable(g, view)]
        gpus = [g for g in shareable if view.valid(g)]
        if len(gpus) < n:
            return TtfkWait(n, len(gpus), len(shareable))
        if policy.checks_fit:
            known_mib = need.mib if need.kind is NeedKind.KNOWN else None
            required = cfg.min_free_mib if known_mib is None else known_mib + cfg.margin_mib
            fitting = [g for g in gpus if view.free_mib(g) >= required]
            if len(fitting) < n:
                return MemoryShort(
                    n,
                    known_mib,
                    cfg.margin_mib,
                    cfg.min_free_mib,
                    cfg.reserve_mib,
                    fitting=len(fitting),
                    held=sum(view.free_mib(g, hold=False) >= required for g in gpus) - len(fitting),
                    awaiting=sum(view.free_mib(g) >= required for g in shareable if g not in gpus),
                )
            gpus = fitting
            if cfg.risk.enabled:
                risks = {g: view.risk(g) for g in gpus}
                risky = [g for g in gpus if risks[g].excluded(cfg.risk)]
                gpus = [g for g in gpus if g not in risky]
                if len(gpus) < n:
                    return RiskFiltered(n, len(gpus), tuple((g, risks[g]) for g in risky), cfg.risk)
        return Placement(tuple(policy.order(gpus, view)[:n]))

    def room_mib(self, target: Target) -> int:
        """The most memory a task on `target` can ever be given: its own (a dynamic MIG GPU's instance can be
        remade larger: `carma.core.mig.placer`)."""
        return target.total_mib

    def relaunch_need(self, task: Task, need: MemoryNeed) -> MemoryNeed:
        """Whole idle GPUs, as asked."""
        return need

    def ended(self, task_id: TaskId) -> None:
        """Nothing kept per task."""

    def _relaunch(self, task: Task, need: MemoryNeed, view: View) -> Placement | Blocked:
        """A relaunch after an OOM crash: whole idle GPUs; after running out alone, the largest idle ones larger
        than those it outgrew; with a need known in MiB when first placed, ones that hold it with the margin, and
        after a stop on a predicted growth (`need` known), ones that hold that too."""
        n = task.spec.gpus
        outgrown = outgrown_mib(task, view.gpus)
        holds = task.attempts[0].need  # what it was first placed with: a GPU must hold a known one
        if need.mib is not None and (holds is None or holds.mib is None or need.mib > holds.mib):
            holds = need
        idle = sorted(
            (g for g in for_tasks_of(n, view.idle_gpus(), view.gpus) if _total(g, view) > outgrown),
            key=lambda g: -_total(g, view) if outgrown else 0,
        )
        if holds is not None:
            idle = self._whole(idle, holds, n, view)
        if len(idle) < n:
            required = None if holds is None else self._whole_mib(holds, n, view)
            return WholeIdle(n, required, larger_than_mib=outgrown, relaunch=True)
        return Placement(tuple(idle[:n]))

    def _whole_mib(self, need: MemoryNeed, n: int, view: View) -> int | None:
        """The memory (MiB, less the reserve) each GPU of an `n`-GPU task must have to hold it whole: its need
        known in MiB with the margin, or the n largest GPUs' for a need larger; None for a need not known."""
        return None if need.mib is None else min(need.mib + self.config.margin_mib, view.usable_mib(n))

    def _whole(self, gpus: list[TargetId], need: MemoryNeed, n: int, view: View) -> list[TargetId]:
        """The GPUs among `gpus` an `n`-GPU task may have whole (`_whole_mib`): on a smaller one it would only
        run out of memory alone."""
        required = self._whole_mib(need, n, view)
        if required is None:
            return gpus
        return [g for g in gpus if _total(g, view) - self.config.reserve_mib >= required]

    def _shareable(self, gpu: TargetId, view: View) -> bool:
        """Whether another task may join `gpu`: not a MIG instance, nor (with `exclusive_relaunch`) holding a
        relaunch after an OOM crash, which then keeps its GPUs to itself so that the crash cannot recur."""
        if not view.gpus[gpu].shareable:
            return False
        return not (self.config.exclusive_relaunch and view.holds_relaunch(gpu))


def for_tasks_of(n: int, gpus: list[TargetId], info: Mapping[TargetId, Target]) -> list[TargetId]:
    """The GPUs among `gpus` an `n`-GPU task may take: a process sees one MIG instance at most (CUDA
    enumerates a single one), so a multi-GPU task takes whole GPUs only."""
    return gpus if n == 1 else [g for g in gpus if info[g].kind is TargetKind.GPU]


def outgrown_mib(task: Task, info: Mapping[TargetId, Target]) -> int:
    """The memory (MiB) of the largest GPUs the task ran out of memory on while alone (0: none): a relaunch
    can only help on larger ones. Of a multi-GPU attempt's GPUs, the smallest counts."""
    return max(
        (
            min(info[g].total_mib if g in info else 0 for g in attempt.gpus)
            for attempt in task.attempts
            if attempt.outcome is ExitKind.OOM and not attempt.shared
        ),
        default=0,
    )


def _total(gpu: TargetId, view: View) -> int:
    return view.gpus[gpu].total_mib
