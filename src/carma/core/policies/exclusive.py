"""Exclusive: one task per GPU, the earliest idle target first (CARMA's baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class Exclusive(BasePolicy):
    name = "exclusive"
    shares = False

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        return list(gpus)
