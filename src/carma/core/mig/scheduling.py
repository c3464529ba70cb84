"""The scheduler of a server whose MIG GPUs carma partitions: the one both worlds build (the twin's
`carma simulate --mig dynamic`, the daemon's `carma server --mig dynamic`).

It wraps the configured whole-GPU placer in `MigPlacer` (tasks of one GPU get the tightest instance their need
holds), orders the queue by the scheme (MIGM's A, size-grouped and bounded here, or B, FIFO) and, given
`early`, restarts a task before it outgrows its instance.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from carma.core.backfill import DurationOf
from carma.core.config import SchedulerConfig
from carma.core.early import EarlyRestarts
from carma.core.grouped import DEFAULT_MAX_PASSES, SizeGrouped
from carma.core.mig.geometry import Geometry
from carma.core.mig.placer import DEFAULT_MIN_MIB, MigPlacer
from carma.core.placer import Placer
from carma.core.ports import Estimator
from carma.core.queue import QueueDiscipline, StrictFifo
from carma.core.risk import ActivityOf
from carma.core.scheduler import Scheduler
from carma.core.types import Target, TargetId, TaskId

SCHEMES = ("a", "b")  # MIGM's: a groups the queue by size (bounded), b is FIFO
MIG_MODES = ("static", "dynamic")


@dataclass(frozen=True)
class MigConfig:
    """How carma treats GPUs whose MIG mode an admin enabled (`[mig]`): `static` places one task per instance
    it finds; `dynamic` creates and destroys instances per task (never changing MIG mode itself). `min_mib`:
    the instance a task of unknown need starts on; `max_passes`: how often scheme A may pass a task over;
    `predict`: restart a task early on a larger instance when its memory is predicted to outgrow its own."""

    mode: str = "static"
    scheme: str = "a"
    max_passes: int = DEFAULT_MAX_PASSES
    min_mib: int = DEFAULT_MIN_MIB
    predict: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MIG_MODES:
            raise ValueError(f"mode must be {' or '.join(MIG_MODES)}, not {self.mode!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown MIG scheme {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if self.max_passes < 0:
            raise ValueError(f"max_passes must not be negative, got {self.max_passes}")
        if self.min_mib <= 0:
            raise ValueError(f"min_mib must be positive, got {self.min_mib}")

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"


def mig_scheduler(
    targets: Sequence[Target],
    config: SchedulerConfig,
    estimator: Estimator | None,
    geometries: Mapping[TargetId, Geometry],
    mig: MigConfig,
    early: EarlyRestarts | None = None,
    durations: DurationOf | None = None,
    activity: ActivityOf | None = None,
) -> Scheduler:
    """A scheduler that partitions the GPUs of `geometries` (by their ids) per task; `durations` serve backfilling
    and `activity` the risk of warm-ups (`warmup_risk`) on the whole GPUs beside them (`SchedulerConfig.backfill`,
    scheme B's place: scheme A orders the queue)."""
    placers: list[MigPlacer] = []

    def size(task_id: TaskId) -> Hashable:
        """The profile the task's need picks: scheme A's group."""
        task = scheduler.task(task_id)
        mib = task.spec.mem_mib
        if mib is None and estimator is not None:
            need = estimator.need(task)
            mib = None if need is None else need.mib
        return placers[0].profile_for(mib)

    def wrap(whole: Placer) -> MigPlacer:
        placers.append(MigPlacer(whole, geometries, mig.min_mib))
        return placers[-1]

    discipline: QueueDiscipline | None = SizeGrouped(size, mig.max_passes) if mig.scheme == "a" else None
    if discipline is None and not (config.backfill and durations is not None):
        discipline = StrictFifo()
    scheduler = Scheduler(
        targets, config, estimator, discipline, placer=wrap, durations=durations, early=early, activity=activity
    )
    return scheduler
