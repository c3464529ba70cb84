"""What no scheduling policy can save on a trace's energy, under the twin's own models.

The twin's energy is the integral of board power from the first submission to the last task's end, summed
over GPUs (docs/metrics.md). A GPU draws  P = idle + (max - idle) * f(S),  f(S) = min(1, S) ** e, where
its SMACT  S = sum over its computing tasks k of smact_k * r_k  (r_k: the task's speed, at most 1/s_k with
s_k its slowdown on that GPU; a task in its time to first kernel or warm-up adds nothing). So

    E  =  sum over GPUs of  idle * makespan  +  (max - idle) * integral of f(S) dt.

- **Idle floor**: every GPU draws at least idle for the whole makespan, which is at least the combined
  makespan bound (`carma.sim.bounds`): at least  sum of idle * that bound.
- **SMACT-work is fixed by the trace**: a task's speeds integrate to its computing phase (solo time less
  time to first kernel and warm-up) on each of its GPUs, so  sum over GPUs of the integral of S  is at least
  Z = sum over tasks of smact * computing phase * GPUs  (attempts cut short by a crash only add to it).
- **Power per unit of SMACT-work**: with e <= 1, f(S) / S falls as S grows, so on a GPU whose SMACT never
  exceeds U,  f(S) >= (f(U) / U) * S  (the chord from 0 to U of a concave f). With e > 1 the chord gives
  nothing (c = 0): only the idle floor is left.

Hence  E >= sum of idle * makespan bound + min over GPUs of (max - idle) * f(U) / U * Z.

U, the most SMACT a GPU can carry, can exceed 1: a task's slowdown is the time-slicing one
t = 1 + a * g**p * y**q (g: its GRACT, y: its co-runners'), under MPS  min(t, max(1 + share * (t - 1), B)),
B = max(1, sum of SMACT, sum of DRAMA), which grows with t and B; a GPU-bound task beside a middling one keeps
most of its speed while the other adds its own SMACT (1.14 on trace 1). The clip at 1 in f is what packing
saves. U is bounded for each GPU memory size over every set of the trace's tasks its memory holds, without
listing the sets (`peak_smact`). Tasks without SMACT are left out (they only slow the others), and tasks of
equal GRACT and SMACT pooled in a profile with the least memory among them (beyond `PROFILES` profiles, the
tasks of each cell of a grid, the profile spanning their least to most GRACT and SMACT: each figure below
takes whichever end loosens it). Every set has a lead, a task of most GRACT; the others all have GRACT at
most the lead's, and GRACT total G and SMACT total Z. A node is a lead's profile and a box G in [G0, G1],
Z in [Z0, Z1]; any of its sets has SMACT at most
  - smact_lead + Z1 (slowdowns are at least 1), and
  - smact_lead at co-runners' GRACT G0, plus the sum over the others k of smact_k at co-runners' GRACT
    max(g_lead, g_lead + G0 - g_k) (the lead is among them), each at B = max(1, smact_lead + Z0) under MPS;
    the largest such sum over the others' sets with GRACT <= G1, SMACT <= Z1 and memory <= the GPU's less
    the lead's is at most the fractional problem's (counts between 0 and the trace's), itself at most the
    fractional knapsack of any positive mix of the three constraints (which every such set meets; solved
    exactly by value per weight), the least over 28 mixes;
and none when no set of the others reaches G0 or Z0 (the same knapsack, of GRACT or SMACT). The search
starts from each lead with the whole box, and splits the nodes of largest bound in halves until that bound is
within `TOLERANCE` of the largest exact SMACT of a single task or pair (what U is at least), or `NODES` were
weighed (a few seconds): U is the largest bound left (trace 1: 1.166; its best pair 1.143). Every step
only loosens, so the bound holds for every policy on whole GPUs that completes every task some GPU holds, as
the makespan bound assumes (a run whose tasks fail can end below it); MIG instances slow tasks by another
model (`carma.sim.migspeed`) and are not covered.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from carma.sim.bounds import computing_s, fits
from carma.sim.gpus import GpuType
from carma.sim.models import InterferenceModel, Load, PowerModel
from carma.traces.catalog import Workload
from carma.traces.loaders import Trace, TraceEntry

TOLERANCE = 0.02  # stop refining once U's bound is this close to a pair's exact SMACT (what U is at least)
NODES = 20000  # nodes weighed at most per GPU memory size (each: 3 x 28 knapsacks of the profiles)
BATCH = 64  # nodes split at once (numpy weighs their halves together)
PROFILES = 48  # distinct (GRACT, SMACT) profiles searched at most; beyond, tasks are pooled in a grid's cells
GRID = 16  # steps of GRACT and of SMACT per unit in that grid
PAIRED = 24  # profiles of most SMACT whose pairs with every task give the least U can be
_SLACK = 1e-9  # rounding allowance: a node is found empty only by more than this
# weights of the GRACT, SMACT and memory constraints in the knapsack: every mix of sixths
_MIXES = np.array([(a / 6, b / 6, (6 - a - b) / 6) for a in range(7) for b in range(7 - a)])


@dataclass(frozen=True)
class EnergyBound:
    """A lower bound on a trace's energy in joules: the idle floor over the makespan bound, plus the least
    power above idle the trace's SMACT-work costs at the most SMACT any GPU can carry."""

    energy_j: float
    idle_j: float
    dynamic_j: float
    smact_work_s: float  # Z: SMACT-seconds the trace's computing phases hold, summed over GPUs
    peak_smact: float  # U: the most SMACT a GPU of the server can carry (the largest over its memory sizes)


def energy_bound(
    trace: Trace,
    gpus: Sequence[GpuType],
    interference: InterferenceModel,
    power: PowerModel,
    sharing: str,
    makespan_s: float,
) -> EnergyBound:
    """The bound for a trace whose makespan no policy beats `makespan_s` (`makespan_bounds(...).combined_s`)."""
    placeable = [e for e in trace.entries if fits(e, gpus)]
    work = sum(e.workload.smact * computing_s(e) for e in placeable)
    idle = sum(g.idle_w for g in gpus) * makespan_s
    peaks = {mib: peak_smact(placeable, mib, interference, sharing) for mib in {g.total_mib for g in gpus}}
    per_smact = [(g.max_w - g.idle_w) * _chord(peaks[g.total_mib], power.exponent) for g in gpus if peaks[g.total_mib]]
    dynamic = min(per_smact, default=0.0) * work
    return EnergyBound(idle + dynamic, idle, dynamic, work, max(peaks.values()))


def _chord(peak: float, exponent: float) -> float:
    """The least f(S) / S for S in (0, peak]: f(peak) / peak when f is concave (exponent <= 1), else 0."""
    return min(1.0, peak) ** exponent / peak if exponent <= 1 else 0.0


@dataclass(frozen=True)
class _Types:
    """The trace's task profiles as arrays, one entry per profile: tasks of equal GRACT and SMACT pooled, or
    beyond `PROFILES` of them, tasks in the same cell of a grid (`GRID` steps), each profile then spanning
    its tasks' least to most GRACT and SMACT; with its tasks' least memory (smaller tasks only fit more) and
    their count."""

    g_lo: np.ndarray
    g_hi: np.ndarray
    z_lo: np.ndarray
    z_hi: np.ndarray
    needs: np.ndarray  # rows: least GRACT, least SMACT, memory (MiB): what a set's totals are at least
    count: np.ndarray  # tasks of the trace with the profile: no more of them can share a GPU

    @classmethod
    def of(cls, workloads: Sequence[Workload]) -> _Types:
        exact = len({(w.gract, w.smact) for w in workloads}) <= PROFILES
        cells: dict[tuple[float, float], list[Workload]] = {}
        for w in workloads:
            key = (w.gract, w.smact) if exact else (w.gract * GRID // 1, w.smact * GRID // 1)
            cells.setdefault(key, []).append(w)
        g_lo, g_hi, z_lo, z_hi, mem = (
            np.array([pick(getattr(w, name) for w in cell) for cell in cells.values()], float)
            for pick, name in ((min, "gract"), (max, "gract"), (min, "smact"), (max, "smact"), (min, "mem_mib"))
        )
        count = np.array([len(cell) for cell in cells.values()], float)
        return cls(g_lo, g_hi, z_lo, z_hi, np.vstack([g_lo, z_lo, mem]), count)


def peak_smact(entries: Sequence[TraceEntry], total_mib: int, interference: InterferenceModel, sharing: str) -> float:
    """An upper bound on the SMACT (sum of smact / slowdown) of any set of `entries` that a GPU of `total_mib`
    holds at once; 0 when none with SMACT fits."""
    workloads = [e.workload for e in entries if e.workload.smact > 0 and e.workload.mem_mib <= total_mib]
    if not workloads:
        return 0.0
    search = _Search(_Types.of(workloads), total_mib, interference, sharing)
    least = _exact_best(workloads, total_mib, interference, sharing)
    while search.bound() > least * (1 + TOLERANCE) and search.weighed < NODES:
        search.split()
    return search.bound()


@dataclass(frozen=True)
class _Node:
    """Sets whose task of most GRACT is of profile `lead`, the others (each of GRACT at most the lead's) of GRACT
    total in [g0, g1] and SMACT total in [z0, z1]."""

    lead: int
    g0: float
    g1: float
    z0: float
    z1: float

    def halves(self, g_root: float, z_root: float) -> tuple[_Node, _Node]:
        """Split at the middle of the total with the larger width relative to the whole (GRACT at a tie)."""
        if (self.g1 - self.g0) * z_root >= (self.z1 - self.z0) * g_root:
            mid = (self.g0 + self.g1) / 2
            return replace(self, g1=mid), replace(self, g0=mid)
        mid = (self.z0 + self.z1) / 2
        return replace(self, z1=mid), replace(self, z0=mid)


class _Search:
    """Best-first search of the nodes, each weighed by an upper bound on its sets' SMACT; the `BATCH` best are
    split at once (weighed together, and every node is weighed before it is split, so the largest weight left
    always bounds every set)."""

    def __init__(self, types: _Types, total_mib: int, interference: InterferenceModel, sharing: str) -> None:
        self.types, self.total_mib, self.interference, self.sharing = types, total_mib, interference, sharing
        self.weighed = 0
        self._order = itertools.count()  # ties broken by age: nodes do not compare
        self._queue: list[tuple[float, int, _Node]] = []
        self._g_root, self._z_root = float(types.g_hi @ types.count), float(types.z_hi @ types.count)
        self._push([_Node(lead, 0.0, self._g_root, 0.0, self._z_root) for lead in range(len(types.count))])

    def bound(self) -> float:
        return -self._queue[0][0]

    def split(self) -> None:
        best = [heapq.heappop(self._queue)[2] for _ in range(min(BATCH, len(self._queue)))]
        self._push([half for node in best for half in node.halves(self._g_root, self._z_root)])

    def _push(self, nodes: list[_Node]) -> None:
        self.weighed += len(nodes)
        for node, weight in zip(nodes, self._weigh(nodes), strict=True):
            heapq.heappush(self._queue, (-weight, next(self._order), node))

    def _weigh(self, nodes: list[_Node]) -> np.ndarray:
        """Each node's weight: 0 when no set of it reaches its least totals; else at most its SMACT total, and at
        most the lead's SMACT at its least slowdown plus the knapsack of the others' (module docstring)."""
        t, im = self.types, self.interference
        lead = np.array([n.lead for n in nodes])
        g0, g1, z0, z1 = (np.array([getattr(n, name) for n in nodes]) for name in ("g0", "g1", "z0", "z1"))
        g_lead, z_lead = t.g_lo[lead][:, None], t.z_hi[lead]
        others = np.where(t.g_lo <= t.g_hi[lead][:, None], t.count, 0.0)  # [node, profile]
        others[np.arange(len(nodes)), lead] -= 1
        room = np.stack([g1, z1, self.total_mib - t.needs[2, lead]], axis=1)
        least_b = np.maximum(1.0, t.z_lo[lead] + z0) if self.sharing == "mps" else np.full(len(nodes), np.inf)
        beside = np.maximum(g_lead, g_lead + g0[:, None] - t.g_hi)  # each other's co-runners' GRACT
        values = t.z_hi / self._slowdown(1.0 + im.a * t.g_lo**im.p * beside**im.q, least_b[:, None])
        rows = np.stack([np.broadcast_to(t.g_hi, values.shape), np.broadcast_to(t.z_hi, values.shape), values], 1)
        most = _most(rows, t.needs, others, np.maximum(room, 0.0))
        lead_smact = z_lead / self._slowdown(1.0 + im.a * g_lead[:, 0] ** im.p * g0**im.q, least_b)
        empty = (room < 0).any(axis=1) | (most[:, 0] < g0 - _SLACK) | (most[:, 1] < z0 - _SLACK)
        return np.where(empty, 0.0, np.minimum(z_lead + z1, lead_smact + most[:, 2]))

    def _slowdown(self, timeslice: np.ndarray, least_b: np.ndarray) -> np.ndarray:
        """The least slowdown of tasks whose time-slicing slowdown is at least `timeslice` and, under MPS, whose
        GPU's B is at least `least_b`: the interference model's rule, which grows with both."""
        if self.sharing != "mps":
            return timeslice
        return np.minimum(timeslice, np.maximum(1.0 + self.interference.mps_share * (timeslice - 1.0), least_b))


def _exact_best(workloads: list[Workload], total_mib: int, interference: InterferenceModel, sharing: str) -> float:
    """The largest exact SMACT of a single task, or a pair that fits of one of the `PAIRED` profiles of most SMACT
    and any task: what U is at least."""
    tasks = Counter((w.gract, w.smact, w.drama, w.mem_mib) for w in workloads)
    best = max(w.smact for w in workloads)
    for a in sorted(tasks, key=lambda profile: -profile[1])[:PAIRED]:
        for b, n in tasks.items():
            if a[3] + b[3] <= total_mib and (a != b or n > 1):
                pair = [Load(a[0], a[1], 0.0, a[2]), Load(b[0], b[1], 0.0, b[2])]
                slow = interference.slowdowns(pair, sharing)
                best = max(best, a[1] / slow[0] + b[1] / slow[1])
    return best


def _most(values: np.ndarray, needs: np.ndarray, counts: np.ndarray, room: np.ndarray) -> np.ndarray:
    """[node, row]: an upper bound on the sum of the row of `values` [node, row, profile] over sets within the
    node's `room` (GRACT, SMACT, memory), each profile up to its `counts` [node, profile]: the least over mixes
    of the constraints of the fractional knapsack of the mix, which every such set fits and which taking
    profiles by value per weight solves."""
    room = room[:, :, None]  # [node, constraint, 1]
    # a need of a room of 0 cannot fit: a weight far above the knapsack's 1 (finite, so sums stay numbers)
    unfit = np.broadcast_to(np.where(needs > 0, 1e9, 0.0), np.broadcast_shapes(needs.shape, room.shape)).copy()
    weights = np.einsum("mc,ncp->nmp", _MIXES, np.divide(needs, room, out=unfit, where=room > 0))[:, None]
    worth = values[:, :, None, :]  # [node, row, mix, profile] once broadcast
    shape = np.broadcast_shapes(worth.shape, weights.shape)
    with np.errstate(over="ignore"):  # a weight too small to divide by: infinitely worth it, and taken whole
        ratio = np.divide(worth, weights, out=np.full(shape, np.inf), where=weights > 0)
        order = np.argsort(-ratio, axis=3, kind="stable")
        per_count = counts[:, None, None, :]
        whole = np.take_along_axis(np.broadcast_to(weights * per_count, shape), order, axis=3)  # best first
        left = 1.0 - (np.cumsum(whole, axis=3) - whole)  # what is left when each profile's turn comes
        taken = np.clip(np.divide(left, whole, out=np.ones(shape), where=whole > 0), 0.0, 1.0)
    gained = np.take_along_axis(np.broadcast_to(worth * per_count, shape), order, axis=3) * taken
    return gained.sum(axis=3).min(axis=2)
