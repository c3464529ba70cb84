"""LUG: least utilized GPU first, by SMACT risk; a GPU whose SMACT is unknown ranks last."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class LeastUtilized(BasePolicy):
    name = "lug"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        return sorted(gpus, key=lambda g: _smact(view, g))


def _smact(view: View, gpu: TargetId) -> float:
    smact = view.risk(gpu).smact
    return float("inf") if smact is None else smact
