"""MAGM: most available GPU memory first."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class MostAvailableMemory(BasePolicy):
    name = "magm"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        return sorted(gpus, key=lambda g: -view.free_mib(g))
