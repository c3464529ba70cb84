"""Early restarts on predicted memory growth (MIGM, seed 002, section 3.2.3): a running task alone on a target of
its own (a MIG instance) whose memory is predicted to outgrow that target before its run ends is stopped and
relaunched on a larger one now, rather than crashing out of memory later with its work lost the same way.

The target's readings are the task's memory (one task per instance). Its series, from its first kernel on, is
fitted by `carma.core.growth` over the time the world expects the run to have left (`Remaining`: declared steps,
a history of earlier runs, a twin's catalog); a task whose remaining time is not known is never restarted. A
prediction beyond the largest instance its GPU can make is left to run: a restart could not help it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from carma.core.growth import Prediction, Sample, predict
from carma.core.types import Task, TaskId

# Seconds a running task has left at `now` (None: not known), and the seconds from its first kernel in which its
# memory jumps as it loads (left out of the fit: a jump no later step repeats).
Remaining = Callable[[Task, float], float | None]
Warmup = Callable[[Task], float]

EARLY_RESTART = "restarted early"  # how an attempt stopped on a prediction begins its message
MAX_SAMPLES = 3600  # a longer series is thinned to every other sample: the fit's cost stays bounded


@dataclass(frozen=True)
class Outgrowing:
    """A running task predicted to need more than its target holds, and less than its GPU can give."""

    task_id: TaskId
    attempt: int
    prediction: Prediction
    capacity_mib: int

    @property
    def message(self) -> str:
        return (
            f"{EARLY_RESTART}: its memory is predicted to reach {self.prediction.peak_mib:.0f} MiB before it ends, "
            f"more than the {self.capacity_mib} MiB of its instance"
        )


class EarlyRestarts:
    """Keeps each running task's memory series and says which tasks to restart early."""

    def __init__(self, remaining: Remaining, warmup_s: Warmup = lambda task: 0.0) -> None:
        self.remaining = remaining
        self.warmup_s = warmup_s
        self._series: dict[TaskId, tuple[int, list[Sample]]] = {}  # by task: its attempt and that attempt's samples

    def observe(self, task_id: TaskId, attempt: int, t: float, used_mib: int) -> None:
        """A reading of the target a task runs alone on, from its first kernel on."""
        kept = self._series.get(task_id)
        if kept is None or kept[0] != attempt:
            kept = self._series[task_id] = (attempt, [])
        samples = kept[1]
        if samples and t <= samples[-1][0]:
            return  # a reading already taken (a world may hand a window over again)
        samples.append((t, float(used_mib)))
        if len(samples) > MAX_SAMPLES:
            samples[:] = samples[::2]

    def forget(self, task_id: TaskId) -> None:
        self._series.pop(task_id, None)

    def check(self, task: Task, attempt: int, capacity_mib: int, room_mib: int, now: float) -> Outgrowing | None:
        """Whether `task` (attempt `attempt`, alone on a target of `capacity_mib`, whose GPU can make one of up to
        `room_mib`) should be restarted early now."""
        kept = self._series.get(task.id)
        left = self.remaining(task, now)
        if kept is None or kept[0] != attempt or left is None or room_mib <= capacity_mib:
            return None
        samples = kept[1]
        horizon = max(0.0, left - (now - samples[-1][0])) if samples else 0.0
        prediction = predict(samples, horizon, warmup_s=self.warmup_s(task))
        if not isinstance(prediction, Prediction) or not capacity_mib < prediction.peak_mib <= room_mib:
            return None
        return Outgrowing(task.id, attempt, prediction, capacity_mib)
