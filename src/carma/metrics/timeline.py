"""Per-GPU timelines as step functions: each segment holds from its start until the next one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

METRICS = ("smact", "smocc", "drama", "used_mib", "power_w")


@dataclass(frozen=True)
class Segment:
    t: float
    smact: float
    smocc: float
    drama: float
    used_mib: int
    power_w: float
    tasks: int


def integrate(segments: Sequence[Segment], metric: str, start: float, end: float) -> float:
    """Integral of a step function over [start, end] (the metric's unit times seconds)."""
    total = 0.0
    for i, seg in enumerate(segments):
        seg_end = segments[i + 1].t if i + 1 < len(segments) else end
        lo, hi = max(seg.t, start), min(seg_end, end)
        if hi > lo:
            total += getattr(seg, metric) * (hi - lo)
    return total


def time_mean(timelines: Sequence[Sequence[Segment]], metric: str, start: float, end: float) -> float:
    """Time-weighted mean over [start, end], averaged over GPUs."""
    if end <= start or not timelines:
        return 0.0
    return sum(integrate(s, metric, start, end) for s in timelines) / ((end - start) * len(timelines))
