"""Why a task waits, as structure: one class per rule that kept it from its GPUs, with its figures.

The placer answers with the placement rules' (`WholeIdle` ... `RiskFiltered`), the queue discipline and the
scheduler with the others. The words users read are made from these outside the core (`carma.reasons`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from carma.core.risk import Exclusion, Risk, RiskConfig
from carma.core.types import Action, TargetId


@dataclass(frozen=True)
class Blocked:
    """Why a task was not placed at the last decision."""


@dataclass(frozen=True)
class Estimating(Blocked):
    """Its memory estimate is still being made: not ready yet, it lets the tasks behind it go on."""


@dataclass(frozen=True)
class Undecided(Blocked):
    """At the head of its queue, not yet looked at (before the GPUs' first readings, or the next decision)."""


@dataclass(frozen=True)
class HeadOfLine(Blocked):
    """Behind the head of its queue, which waits."""


@dataclass(frozen=True)
class RecoveryPriority(Blocked):
    """In the main queue while the recovery queue holds tasks: those go first."""


@dataclass(frozen=True)
class PassedOver(Blocked):
    """Tasks of another size went first (scheme A groups the queue by size); after `bound` passes none may."""

    times: int
    bound: int


@dataclass(frozen=True)
class Preparing(Blocked):
    """Its target must be made first (a MIG instance created for it): the scheduler hands `actions` to the world,
    and the task is placed at a later decision, once the target is there."""

    actions: tuple[Action, ...]


@dataclass(frozen=True)
class WholeIdle(Blocked):
    """Fewer than `gpus` whole idle GPUs of the size it needs."""

    gpus: int
    required_mib: int | None  # what each must hold less the reserve (its need with the margin); None: any
    larger_than_mib: int = 0  # a relaunch after an OOM alone: only GPUs larger than those it outgrew
    relaunch: bool = False  # a relaunch's required memory is its need when first placed


@dataclass(frozen=True)
class TtfkWait(Blocked):
    """Fewer than `gpus` shareable GPUs past their tasks' TTFK windows."""

    gpus: int
    valid: int  # shareable GPUs not awaiting a first kernel
    shareable: int  # GPUs another task may join at all (not MIG instances, nor relaunches kept to themselves)


@dataclass(frozen=True)
class MemoryShort(Blocked):
    """Fewer than `gpus` GPUs with the free memory the task needs: its need in MiB with the margin, or
    `min_free_mib` for a need not known; each plus the reserve is what a GPU's reading must show free."""

    gpus: int
    need_mib: int | None  # None: not known, `min_free_mib` applies
    margin_mib: int
    min_free_mib: int
    reserve_mib: int
    fitting: int  # valid GPUs with that much free
    held: int  # more valid GPUs that show it free, but whose tasks' known needs (or predicted growth) hold it
    awaiting: int  # more shareable GPUs with it free, kept by a TTFK window

    @property
    def required_mib(self) -> int:
        """The free memory each GPU needs, less the reserve."""
        return self.min_free_mib if self.need_mib is None else self.need_mib + self.margin_mib


@dataclass(frozen=True)
class RiskFiltered(Blocked):
    """Fewer than `gpus` GPUs with enough memory pass the risk filter. Why each is excluded is worked out when
    asked (`carma queue`, the log): a decision offers every waiting task, most of them blocked so."""

    gpus: int
    passing: int
    risky: tuple[tuple[TargetId, Risk], ...]  # the GPUs with enough memory it excludes, with their scores
    config: RiskConfig

    @functools.cached_property
    def excluded(self) -> tuple[tuple[TargetId, Exclusion], ...]:
        """The GPUs with enough memory it excludes, and why."""
        return tuple((g, risk.exclusion(self.config)) for g, risk in self.risky)
