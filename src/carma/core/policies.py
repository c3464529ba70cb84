"""Placement policies: each orders the candidate GPUs; the scheduler takes as many as the task needs.

Candidates arrive in GPU-index order and every sort is stable, so ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carma.core.config import Policy


@dataclass(frozen=True)
class Candidate:
    gpu: int
    free_mib: int  # latest free memory minus the reserve
    smact_risk: float  # used by LUG; 0.0 where the window is empty


class RoundRobin:
    """Cyclic order starting after the GPU last chosen; the pointer moves only when a task is placed."""

    def __init__(self, gpu_indices: Sequence[int]) -> None:
        self._ring = list(gpu_indices)
        self._next = 0

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        by_gpu = {c.gpu: c for c in candidates}
        n = len(self._ring)
        rotated = (self._ring[(self._next + i) % n] for i in range(n))
        return [by_gpu[g] for g in rotated if g in by_gpu]

    def placed(self, gpus: Sequence[int]) -> None:
        self._next = (self._ring.index(gpus[-1]) + 1) % len(self._ring)


def order(policy: Policy, candidates: Sequence[Candidate], rr: RoundRobin) -> list[Candidate]:
    if policy is Policy.RR:
        return rr.order(candidates)
    if policy is Policy.MAGM:
        return sorted(candidates, key=lambda c: -c.free_mib)
    if policy is Policy.LUG:
        return sorted(candidates, key=lambda c: c.smact_risk)
    if policy is Policy.BF:
        return sorted(candidates, key=lambda c: c.free_mib)
    return list(candidates)  # FF and Exclusive: index order
