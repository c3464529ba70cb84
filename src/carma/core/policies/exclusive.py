"""Exclusive: one task per GPU, the lowest idle index first (CARMA's baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.view import View


class Exclusive(BasePolicy):
    name = "exclusive"
    shares = False

    def order(self, gpus: Sequence[int], view: View) -> list[int]:
        return list(gpus)
