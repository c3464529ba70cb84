"""Round-robin: cyclic order over the server's targets, continuing after the one last placed on; no memory
or risk precondition."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class RoundRobin(BasePolicy):
    name = "rr"
    checks_fit = False

    def __init__(self) -> None:
        self._last: TargetId | None = None

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        ring = list(view.gpus)
        # the pointer is the target after the last placed on; one that has left restarts the ring
        last = self._last
        start = ring.index(last) + 1 if last is not None and last in view.gpus else 0
        candidates = set(gpus)
        n = len(ring)
        return [g for g in (ring[(start + i) % n] for i in range(n)) if g in candidates]

    def placed(self, gpus: Sequence[TargetId]) -> None:
        """The pointer moves only when a task is placed: past the last of its GPUs."""
        self._last = gpus[-1]
