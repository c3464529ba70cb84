"""Interference-aware pairing: the GPU where the task is predicted to slow itself and its co-runners least
first, MAGM's most free memory among equals (and where no interference model is given)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from carma.core.policies.base import BasePolicy
from carma.core.types import TargetId, Task
from carma.core.view import View

# The world's interference model, as a port: how much `task` joining `others` on a GPU would raise their summed
# slowdowns (1.0 for a task alone). The twin gives its fitted model; the daemon, none yet.
PairingModel = Callable[[Task, Sequence[Task]], float]


@runtime_checkable
class Pairing(Protocol):
    """A view that predicts what placing its task on a GPU costs (the scheduler's, given a `PairingModel`)."""

    def pairing_cost(self, gpu: TargetId) -> float | None:
        """The rise in the summed slowdowns of the task being placed and `gpu`'s tasks; None without a model."""
        ...


class InterferenceAware(BasePolicy):
    name = "pair"

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        def cost(gpu: TargetId) -> tuple[float, int]:
            slowdown = view.pairing_cost(gpu) if isinstance(view, Pairing) else None
            return (0.0 if slowdown is None else slowdown, -view.free_mib(gpu))

        return sorted(gpus, key=cost)
