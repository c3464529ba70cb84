"""MAGM: most available GPU memory first."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.view import View


class MostAvailableMemory(BasePolicy):
    name = "magm"

    def order(self, gpus: Sequence[int], view: View) -> list[int]:
        return sorted(gpus, key=lambda g: -view.free_mib(g))
