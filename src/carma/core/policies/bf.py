"""Best fit: the least free memory first (every candidate already holds the task)."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class BestFit(BasePolicy):
    name = "bf"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        return sorted(gpus, key=view.free_mib)
