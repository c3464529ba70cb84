"""Memory-need resolution: what GPU memory the head task is taken to need.

In order: the user's declared value (or an oracle's, in experiments), else the configured estimator's
value, else nothing (recovery only: place by the minimum-free precondition and recover from OOMs). An
estimator that gives no usable value, or a need no GPU could ever satisfy with the margin, means the task
needs a whole GPU.
"""

from __future__ import annotations

from typing import Protocol

from carma.core.types import MemoryNeed, NeedKind, TaskSpec


class Estimator(Protocol):
    """A memory estimator port: predicted peak GPU memory in MiB, or None when it has no usable estimate."""

    name: str

    def estimate(self, spec: TaskSpec) -> int | None: ...


def resolve_need(spec: TaskSpec, estimator: Estimator | None, largest_gpu_mib: int, margin_mib: int) -> MemoryNeed:
    if spec.mem_mib is not None:
        mib, source = spec.mem_mib, "user"
    elif estimator is not None:
        value = estimator.estimate(spec)
        if value is None:
            return MemoryNeed(NeedKind.WHOLE_GPU, source=f"{estimator.name}: no usable estimate")
        mib, source = value, estimator.name
    else:
        return MemoryNeed(NeedKind.UNKNOWN, source="none")
    if mib + margin_mib > largest_gpu_mib:
        return MemoryNeed(NeedKind.WHOLE_GPU, mib, f"{source}: {mib} MiB exceeds any GPU with the margin")
    return MemoryNeed(NeedKind.KNOWN, mib, source)
