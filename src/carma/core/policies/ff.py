"""First fit: the earliest target that passes the preconditions."""

from __future__ import annotations

from collections.abc import Sequence

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId
from carma.core.view import View


class FirstFit(BasePolicy):
    name = "ff"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        return list(gpus)
