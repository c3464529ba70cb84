"""Memory-need resolution: what GPU memory the head task is taken to need.

In order: the user's declared value (or an oracle's, in experiments), else the estimator's answer, else
nothing (recovery only: place by the minimum-free precondition and recover from OOMs). An estimator has
four answers: a value; no usable estimate, or a need no GPU could satisfy with the margin (the task needs a
whole GPU); a failure (recovery only, as if there were no estimator); or "not yet" while it computes (the
task waits, not ready yet, and the tasks behind it go on: `carma.core.queue.first_waiting`).
"""

from __future__ import annotations

from carma.core.ports import Estimator
from carma.core.types import MemoryNeed, NeedKind, Task

NO_ESTIMATE = "no usable estimate"
RECOVERY_NEED = MemoryNeed(NeedKind.WHOLE_GPU, source="recovery")  # an OOM-crashed task's relaunch: whole idle GPUs
RECOVERY_ONLY = MemoryNeed(NeedKind.UNKNOWN, source="none")  # nothing known: placed by the minimum-free precondition


def estimated(source: str, mib: int | None, partial: bool = False) -> MemoryNeed:
    """An estimator's value as a need: known (`partial`: see `MemoryNeed`), or a whole GPU when there is no
    usable value."""
    if mib is None:
        return MemoryNeed(NeedKind.WHOLE_GPU, source=f"{source}: {NO_ESTIMATE}")
    return MemoryNeed(NeedKind.KNOWN, mib, source, partial)


def given_need(mem_mib: int | None, estimated: bool) -> MemoryNeed | None:
    """The need known without asking an estimator: the declared value, else recovery only when no estimate
    is asked for; None when it is the estimator's to say."""
    if mem_mib is not None:
        return MemoryNeed(NeedKind.KNOWN, mem_mib, "user")
    return None if estimated else RECOVERY_ONLY


def resolve_need(task: Task, estimator: Estimator | None, usable_mib: int, margin_mib: int) -> MemoryNeed | None:
    """The head task's need, or None while its estimate is not ready; `usable_mib`: the most memory each of
    the task's GPUs can offer (that of the n-th largest GPU for an n-GPU task, less the reserve)."""
    need = given_need(task.spec.mem_mib, estimated=estimator is not None)
    if need is None and estimator is not None:
        need = estimator.need(task)
    if need is None:
        return None
    if need.kind is NeedKind.KNOWN and need.mib is not None and need.mib + margin_mib > usable_mib:
        largest = "any GPU" if task.spec.gpus == 1 else f"the {task.spec.gpus} largest GPUs"
        too_big = f"{need.source}: {need.mib} MiB exceeds {largest} with the margin"
        return MemoryNeed(NeedKind.WHOLE_GPU, need.mib, too_big, need.partial)
    return need
