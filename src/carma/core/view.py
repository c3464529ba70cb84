"""What a placer and its policy read of a server: its GPUs and, at one moment, what each holds.

A view is read-only. The scheduler hands the placer a view over its own bookkeeping; a cluster layer can
hand each server's placer that server's view and compare the answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the configuration validates policy names, and the policies read views: no import cycle
    from carma.core.risk import Risk
    from carma.core.types import Target, TargetId


class View(Protocol):
    @property
    def now(self) -> float:
        """The world's time of the decision (a GPU's TTFK window is judged at it)."""
        ...

    @property
    def gpus(self) -> Mapping[TargetId, Target]:
        """The server's targets (GPUs and MIG instances) by id, in the server's order."""
        ...

    def idle_gpus(self) -> list[TargetId]:
        """The GPUs with no task and no other process that telemetry has read, in the server's order."""
        ...

    def reported_gpus(self) -> list[TargetId]:
        """The GPUs telemetry has read at least once, in the server's order: no decision is made on one never seen."""
        ...

    def holds_relaunch(self, gpu: TargetId) -> bool:
        """Whether a task on `gpu` is a relaunch after an OOM crash."""
        ...

    def valid(self, gpu: TargetId) -> bool:
        """Whether `gpu` is past the TTFK windows of the tasks dispatched to it."""
        ...

    def free_mib(self, gpu: TargetId, hold: bool = True) -> int:
        """What a new task may take on `gpu`, less the reserve; with `hold`, no more than the needs known in
        MiB of its tasks leave (`hold_known_needs`)."""
        ...

    def risk(self, gpu: TargetId) -> Risk:
        """The risk scores of `gpu`'s monitor window (it has been read)."""
        ...

    def usable_mib(self, n: int) -> int:
        """The most memory (MiB, less the reserve) each GPU of an `n`-GPU task can have: the largest target's
        for one GPU, the n-th largest whole GPU's for more."""
        ...
