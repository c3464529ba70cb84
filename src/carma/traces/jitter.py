"""Seeded jitter of a trace's arrivals, so that configurations are compared over several arrival patterns: one
trace's makespan swings by about +-0.3 h when its arrivals move by +-2 minutes (docs/traces.md, "Jitter").

A transform of the trace's data, not of the scheduler: each seed gives one jittered copy, run as any trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from carma.traces.loaders import Trace


def jittered(trace: Trace, jitter_s: float, seed: int) -> Trace:
    """`trace` with each entry's arrival moved by an offset drawn uniformly from [-jitter_s, +jitter_s] by
    `random.Random(seed)`, one draw per entry in the trace's order (the same seed, the same copy), never before
    0 s; the entries sorted by their new times, ties in the trace's order. Nothing else changes: jitter 0 gives
    the trace itself."""
    if not 0 <= jitter_s < math.inf:
        raise ValueError(f"jitter must be a finite number of seconds, at least 0; got {jitter_s:g}")
    draw = random.Random(seed)
    moved = [replace(e, submit_s=max(0.0, e.submit_s + draw.uniform(-jitter_s, jitter_s))) for e in trace.entries]
    return replace(trace, entries=tuple(sorted(moved, key=lambda e: e.submit_s)))
