"""Round-robin: cyclic order, continuing after the GPU last placed on; no memory or risk precondition."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.view import View


class RoundRobin(BasePolicy):
    name = "rr"
    checks_fit = False

    def __init__(self, gpus: Sequence[int]) -> None:
        self._ring = list(gpus)
        self._next = 0

    def order(self, gpus: Sequence[int], view: View) -> list[int]:
        candidates = set(gpus)
        n = len(self._ring)
        rotated = (self._ring[(self._next + i) % n] for i in range(n))
        return [g for g in rotated if g in candidates]

    def placed(self, gpus: Sequence[int]) -> None:
        """The pointer moves only when a task is placed: past the last of its GPUs."""
        self._next = (self._ring.index(gpus[-1]) + 1) % len(self._ring)
