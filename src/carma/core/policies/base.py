"""The placement-policy protocol: which candidate GPUs a policy accepts, how it orders them, and what it
remembers after a placement. The placer takes as many GPUs as the task needs from the front of its order.

Candidates arrive in the server's order of its targets, and every ordering here is a stable sort, so ties go
to the earliest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

from carma.core.types import TargetId
from carma.core.view import View


class Policy(Protocol):
    name: ClassVar[str]  # what `[scheduler] policy` and `--policy` call it
    # Whether it places a task beside others at all (Exclusive: whole idle GPUs only).
    shares: ClassVar[bool]
    # Whether a GPU it shares must pass the memory precondition and the risk filter (RR: TTFK validity only).
    checks_fit: ClassVar[bool]

    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]:
        """`gpus` (the candidates, in the server's order) in the order the policy would take them."""
        ...

    def placed(self, gpus: Sequence[TargetId]) -> None:
        """A task was placed on `gpus` (in this policy's order) from the main queue: remember what it needs to."""
        ...


class BasePolicy(ABC):
    """What most policies are: they remember nothing, share GPUs and check the preconditions (a registered
    policy derives from it and overrides what differs)."""

    name: ClassVar[str]
    shares: ClassVar[bool] = True
    checks_fit: ClassVar[bool] = True

    @abstractmethod
    def order(self, gpus: Sequence[TargetId], view: View) -> list[TargetId]: ...

    def placed(self, gpus: Sequence[TargetId]) -> None:  # noqa: B027 (a default: most remember nothing)
        """Nothing to remember."""
