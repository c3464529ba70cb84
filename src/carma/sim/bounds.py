"""What no scheduling policy can beat on a trace and a simulated server, under the twin's own models.

Two lower bounds on the makespan (from the first submission, as docs/metrics.md measures it):

- **critical path**: a task never runs faster than alone (the interference model's slowdowns are at least
  1), so none ends before its submission plus its solo time;
- **work**: a task's computing phase (solo time less its time to first kernel and warm-up, the phase that
  co-runners slow) is work in solo-seconds per GPU, and a GPU cannot process work faster than its best
  packing allows. For a set H of the trace's tasks, the rate at which one GPU can process H's work is at
  most  max over k of  k / s(k),  with s(k) the slowdown of k copies of a pseudo-task that has the smallest
  GRACT, SMACT, DRAMA and memory found in H, k no more than H's tasks nor than the GPU's memory holds of the
  smallest one: slowdowns only grow with a task's own and its co-runners' activity, and co-runners from
  outside H only slow H. H's work therefore takes at least  W_H / (sum over GPUs of that rate)  and, as no
  task starts before it is submitted, the work submitted at or after t ends no sooner than t plus that.

The sets H tried are the trace's tasks with GRACT and memory at or above each pair of values found in the
trace (up to `THRESHOLDS` values of each): heavy tasks are what interfere, and large ones what memory keeps
apart. Every set gives a valid bound; the figure is the largest. The combined bound is the largest of the
critical path and, over every set and every submission time, the arrival-aware work bound.

Generous on purpose, so that it holds for any policy: a GPU's whole memory is usable (no reserve, margin or
fragmentation), tasks start and pack the instant it pays, and nothing waits on a monitor window. It rests on
the interference model's slowdowns growing with activity (a, p, q >= 0: `carma twin calibrate` refuses
others). It bounds the twin; a real GPU interferes as it does, not as the fitted model says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from carma.sim.gpus import GpuType
from carma.sim.models import InterferenceModel, Load
from carma.traces.loaders import Trace, TraceEntry

THRESHOLDS = 24  # values of GRACT, and of memory, that the sets of heavy tasks start from at most


@dataclass(frozen=True)
class Bounds:
    """Lower bounds on a trace's makespan in seconds; `unplaceable` counts tasks no GPU of the server can
    hold (left out: they fail under every policy)."""

    critical_path_s: float
    critical_task: str  # the task whose submission plus solo time ends last
    work_s: float  # all the work from the first submission, arrivals ignored
    combined_s: float  # the critical path and the work submitted after each instant
    unplaceable: int = 0

    def gain_share(self, exclusive_s: float, makespan_s: float) -> float | None:
        """The share of the gain Exclusive leaves open that a run took: (exclusive - run) / (exclusive - bound);
        None when Exclusive already meets the bound (nothing to gain)."""
        room = exclusive_s - self.combined_s
        return None if room <= 0 else (exclusive_s - makespan_s) / room

    def as_dict(self) -> dict[str, object]:
        return {
            "critical_path_s": round(self.critical_path_s, 1),
            "critical_task": self.critical_task,
            "work_s": round(self.work_s, 1),
            "combined_s": round(self.combined_s, 1),
            "unplaceable": self.unplaceable,
        }


def makespan_bounds(trace: Trace, gpus: Sequence[GpuType], interference: InterferenceModel, sharing: str) -> Bounds:
    if not trace.entries:
        raise ValueError("no tasks to bound")
    start = min(e.submit_s for e in trace.entries)
    placeable = [e for e in trace.entries if fits(e, gpus)]
    if not placeable:
        return Bounds(0.0, "", 0.0, 0.0, len(trace.entries))
    last = max(placeable, key=lambda e: e.submit_s + e.workload.solo_s)
    critical = last.submit_s + last.workload.solo_s - start
    rate = cache(lambda group: _rate(group, gpus, interference, sharing))
    work = combined = 0.0
    for group in _heavy_sets(placeable):
        capacity = rate(_Pseudo.of(group))  # above 0: its smallest task fits a GPU, as every placeable one does
        after = 0.0  # work submitted at or after each submission time, latest first
        for entry in sorted(group, key=lambda e: e.submit_s, reverse=True):
            after += computing_s(entry)
            combined = max(combined, entry.submit_s - start + after / capacity)
        work = max(work, after / capacity)
    return Bounds(critical, last.workload.name, work, max(critical, combined), len(trace.entries) - len(placeable))


def fits(entry: TraceEntry, gpus: Sequence[GpuType]) -> bool:
    """Whether the server has `gpus` GPUs each holding the task's memory (else it fails everywhere)."""
    w = entry.workload
    return sum(g.total_mib >= w.mem_mib for g in gpus) >= w.gpus


def computing_s(entry: TraceEntry) -> float:
    """Solo-seconds of computing per GPU, summed over its GPUs: the phase co-runners slow."""
    w = entry.workload
    return (w.solo_s - w.ttfk_s - w.warmup_s) * w.gpus


def _heavy_sets(entries: list[TraceEntry]) -> list[list[TraceEntry]]:
    """The tasks with GRACT and memory at or above each pair of thresholds (distinct sets only)."""
    sets: dict[tuple[int, ...], list[TraceEntry]] = {}
    for gract in _thresholds([e.workload.gract for e in entries]):
        for mem in _thresholds([e.workload.mem_mib for e in entries]):
            chosen = [i for i, e in enumerate(entries) if e.workload.gract >= gract and e.workload.mem_mib >= mem]
            if chosen:
                sets.setdefault(tuple(chosen), [entries[i] for i in chosen])
    return list(sets.values())


def _thresholds(values: list[float], most: int = THRESHOLDS) -> list[float]:
    """The distinct values, or `most` of them evenly spread from the smallest (a long trace's thousands of
    values would take minutes; any subset of the sets still gives a valid bound)."""
    distinct = sorted(set(values))
    if len(distinct) <= most:
        return distinct
    return [distinct[i * (len(distinct) - 1) // (most - 1)] for i in range(most)]


@dataclass(frozen=True)
class _Pseudo:
    """The least demanding task of a set, and the set's size: no more of its tasks can share a GPU."""

    load: Load
    mem_mib: int
    count: int

    @classmethod
    def of(cls, group: list[TraceEntry]) -> _Pseudo:
        ws = [e.workload for e in group]
        load = Load(
            min(w.gract for w in ws), min(w.smact for w in ws), min(w.smocc for w in ws), min(w.drama for w in ws)
        )
        return cls(load, min(w.mem_mib for w in ws), len(ws))


def _rate(pseudo: _Pseudo, gpus: Sequence[GpuType], interference: InterferenceModel, sharing: str) -> float:
    """Solo-seconds of the set's work the server can process per second at most: per GPU, the best k copies of
    the pseudo-task that fit its memory, summed over GPUs."""
    best: dict[int, float] = {}
    total = 0.0
    for gpu in gpus:
        most = min(pseudo.count, gpu.total_mib // pseudo.mem_mib)
        if most not in best:
            best[most] = max(
                (k / max(interference.slowdowns([pseudo.load] * k, sharing)) for k in range(1, most + 1)), default=0.0
            )
        total += best[most]
    return total
