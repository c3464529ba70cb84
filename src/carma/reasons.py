"""The words of a waiting task's reason, made from the core's structure (`carma.core.blocked`): what the
queue listing, a task's page, the API and the twin's stall message say.
"""

from __future__ import annotations

from collections.abc import Callable

from carma.core.blocked import (
    Blocked,
    Estimating,
    HeadOfLine,
    MemoryShort,
    PassedOver,
    Preparing,
    RecoveryPriority,
    RiskFiltered,
    TtfkWait,
    Undecided,
    WholeIdle,
)
from carma.core.mig.placer import AwaitingInstance, NoInstance
from carma.core.risk import Exclusion
from carma.core.scheduler import Scheduler
from carma.core.types import TargetId, TaskId
from carma.units import inflect, pluralize

ESTIMATING = "waiting for its memory estimate"
UNDECIDED = "at the head of the queue, for the next placement decision"  # e.g. before the GPUs' first sample
HEAD_OF_LINE = "behind the head of the queue (FIFO)"
RECOVERY_FIRST = "recovery queue has priority"


def waiting_reason(scheduler: Scheduler, task_id: TaskId) -> str | None:
    """Why a waiting task was not placed at the last decision; None for a task that does not wait."""
    blocked = scheduler.blocked(task_id)
    return None if blocked is None else render(blocked, target_label(scheduler))


def target_label(scheduler: Scheduler) -> Callable[[TargetId], str]:
    """How users know a target (`Scheduler.shown`), as words."""
    return lambda target: str(scheduler.shown(target))


def render(blocked: Blocked, label: Callable[[TargetId], str]) -> str:
    """The words for `blocked`; `label` names a target as users know it (`target_label`)."""
    match blocked:
        case Estimating():
            return ESTIMATING
        case Undecided():
            return UNDECIDED
        case HeadOfLine():
            return HEAD_OF_LINE
        case RecoveryPriority():
            return RECOVERY_FIRST
        case WholeIdle():
            return _whole_idle(blocked)
        case TtfkWait(gpus=n, shareable=0):
            return (
                f"needs {pluralize(n, 'GPU')}; no idle one that holds it, and none another task may join (a MIG "
                "instance runs one task; a relaunch after an OOM crash keeps its GPUs)"
            )
        case TtfkWait(gpus=n, valid=valid):
            return f"needs {pluralize(n, 'GPU')}; {valid} shareable and not awaiting a first kernel (TTFK)"
        case MemoryShort():
            return _memory(blocked)
        case PassedOver(times=times, bound=bound):
            return f"tasks of another size went first {pluralize(times, 'time')} (at most {bound}: scheme A)"
        case Preparing():
            return "a MIG instance is being made for it"
        case AwaitingInstance(gpu=gpu, instance=instance):
            return f"waiting for its MIG instance {instance} on GPU {label(gpu)} to be ready"
        case NoInstance(detail=detail):
            return f"no MIG instance of its size can be had now: {detail}"
        case RiskFiltered(gpus=n, passing=passing, excluded=excluded):
            passes = inflect(passing, "passes", "pass")
            reason = f"needs {pluralize(n, 'GPU')}; only {passing} with enough memory {passes} the risk filter"
            return f"{reason} ({_risky(excluded, label)})"
    raise TypeError(f"no words for {blocked!r}")


def _whole_idle(b: WholeIdle) -> str:
    """Whole idle GPUs, with the memory each must hold when the need is known (a relaunch's is its first
    placement's, which its crash may have shown too small)."""
    larger = f" larger than {b.larger_than_mib} MiB" if b.larger_than_mib else ""
    whose = " (its need when first placed, with the margin)" if b.relaunch else ""
    can_hold = f" that can hold {b.required_mib} MiB{whose}" if b.required_mib is not None else ""
    waiting = f"waiting for {pluralize(b.gpus, 'whole idle GPU')}{larger}{can_hold}"
    return f"recovery: {waiting}" if b.relaunch else waiting


def _memory(b: MemoryShort) -> str:
    """The free memory needed as `carma gpus` shows it (the reserve is taken off what telemetry reads), and
    the GPUs with it that something else keeps from the task."""
    parts = f"min_free_mib {b.min_free_mib}" if b.need_mib is None else f"need {b.need_mib} + margin {b.margin_mib}"
    free = f"{b.required_mib + b.reserve_mib} MiB free ({parts} + reserve {b.reserve_mib})"
    reason = f"needs {pluralize(b.gpus, 'GPU')} with {free}; {b.fitting} {inflect(b.fitting, 'has', 'have')} it"
    asides = []
    if b.held > 0:
        holding = "their tasks' known needs or predicted growth hold it"
        asides.append(f"{b.held} more {inflect(b.held, 'shows', 'show')} it free, but {holding}")
    if b.awaiting:
        has = inflect(b.awaiting, "has it free, but awaits its task's", "have it free, but await their tasks'")
        asides.append(f"{b.awaiting} more {has} first kernel (TTFK)")
    return reason + (f" ({'; '.join(asides)})" if asides else "")


def _risky(excluded: tuple[tuple[TargetId, Exclusion], ...], label: Callable[[TargetId], str]) -> str:
    """Why GPUs fail the risk filter, each by its scores (as `carma gpus` shows them), or for more than two
    (a line of `carma queue`) their indices."""
    if len(excluded) > 2:
        return f"GPUs {', '.join(label(g) for g, _ in excluded)}: `carma gpus` shows their risk"
    return "; ".join(f"GPU {label(g)}: {_exclusion(e)}" for g, e in excluded)


def _exclusion(e: Exclusion) -> str:
    if e.missing:
        return f"no {'/'.join(m.upper() for m in e.missing)} reading"
    return ", ".join(f"{metric.upper()} {score:.2f} >= {threshold:.2f}" for metric, score, threshold in e.over)
