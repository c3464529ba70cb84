"""Interference-aware pairing: the GPU where the task is predicted to slow itself and its co-runners least
first, MAGM's most free memory among equals (and where no interference model is given). A GPU whose cost the
model cannot tell comes after those it can: an idle GPU before one beside a task of unknown activity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId, Task
from carma.core.view import View

# The world's interference model, as a port: how much `task` joining `others` on a GPU would raise their summed
# slowdowns (1.0 for a task alone), None when it cannot tell (a task whose activity it does not know). The twin
# gives its fitted model over the catalog's profiles; the daemon, the same model over each command's history.
PairingModel = Callable[[Task, Sequence[Task]], float | None]


@runtime_checkable
class Pairing(Protocol):
    """A view that predicts what placing its task on a GPU costs (the scheduler's, given a `PairingModel`)."""

    def pairing_cost(self, gpu: TargetId) -> float | None:
        """The rise in the summed slowdowns of the task being placed and `gpu`'s tasks; None without a model, or
        where it cannot tell."""
        ...


class InterferenceAware(BasePolicy):
    name = "pair"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        def cost(gpu: TargetId) -> tuple[bool, float, int]:
            slowdown = view.pairing_cost(gpu) if isinstance(view, Pairing) else None
            return (slowdown is None, 0.0 if slowdown is None else slowdown, -view.free_mib(gpu))

        return sorted(gpus, key=cost)
