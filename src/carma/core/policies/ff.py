"""First fit: the lowest index that passes the preconditions."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.view import View


class FirstFit(BasePolicy):
    name = "ff"

    def order(self, gpus: Sequence[int], view: View) -> list[int]:
        return list(gpus)
