"""Early restarts on predicted memory growth (MIGM, seed 002, section 3.2.3): a running task whose memory is
predicted to outgrow what it can have before its run ends is stopped and relaunched where it fits now, rather
than crashing out of memory later with its work lost the same way (and, on a shared GPU, its neighbours' too).

Two places (issue 47, item 4), each switched on its own: a task alone on a MIG instance that it will outgrow
(`instances`, `[mig] predict`: relaunched on a larger instance), and a task on a shared GPU whose growth will not
fit beside its co-runners (`[scheduler] predict_growth`: the scheduler closes that GPU to new tasks by the growth
predicted, and relaunches the task through recovery before the crash).

A task's series, from its first kernel on (its instance's readings, or its processes' memory on a shared GPU),
is fitted by `carma.core.growth` over the time the world expects the run to have left (`Remaining`: declared
steps, a history of earlier runs, a twin's catalog); a task whose remaining time is not known is never
predicted. A prediction beyond the most its GPU can give is left to run: a restart could not help it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from carma.core.growth import Growth, LineFit, Prediction, Sample
from carma.core.types import Task, TaskId

# Seconds a running task has left at `now` (None: not known), and the seconds from its first kernel in which its
# memory jumps as it loads (left out of the fit: a jump no later step repeats).
Remaining = Callable[[Task, float], float | None]
Warmup = Callable[[Task], float]

# The fit reads the later half of the time since the warm-up: a jump early in a run (loading, the first
# iterations' allocations, a data loader starting) is forgotten once the run has gone on as long again, while a
# growth that lasts stays in view.
RECENT = 0.5
# Growth that lasts set new highs in each part of that window; a single step (an evaluation pass, a larger batch
# once) sets them in one part only, and a line through a step still slopes upward.
PARTS = 3
RISING_S = 60.0  # a new high this recent (or in the window's last part) may begin a growth: its band is held
MAX_KEPT = 4096  # samples kept per series at most: beyond, every other one is let go (the fit thins, never stops)
EARLY_RESTART = "restarted early"  # how an attempt stopped on a prediction begins its message


@dataclass(frozen=True)
class Outgrowing:
    """A running task predicted to need more than it can have where it runs (`capacity_mib`, `where`), and no
    more than its GPU can give."""

    task_id: TaskId
    attempt: int
    prediction: Prediction
    capacity_mib: int
    where: str = "of its instance"

    @property
    def message(self) -> str:
        return (
            f"{EARLY_RESTART}: its memory is predicted to reach {self.prediction.peak_mib:.0f} MiB before it ends, "
            f"more than the {self.capacity_mib} MiB {self.where}"
        )


@dataclass
class _Series:
    attempt: int
    settled_s: float  # its warm-up's end: earlier samples are left out of the fit
    line: LineFit = field(default_factory=LineFit)  # the recent samples from `settled_s` on, once it moved
    flat: deque[float] = field(default_factory=deque)  # until then, only the times of the recent samples
    last: Sample | None = None
    level: float = 0.0  # its memory while flat since the warm-up (the line holds samples once it moved)
    high: float = -math.inf  # the most it has held since the warm-up
    rises: list[float] = field(default_factory=list)  # when it set a new high, from `first` on
    first: int = 0

    def cut(self, t: float) -> float:
        """The start of the window the fit reads at `t`."""
        return self.settled_s + (t - self.settled_s) * (1 - RECENT)

    def rise(self, t: float, mib: float) -> None:
        if mib > self.high:
            if self.high > -math.inf:
                self.rises.append(t)
                if len(self.rises) - self.first > MAX_KEPT:  # rising at every reading: every other rise is enough
                    self.rises = self.rises[self.first :: 2]
                    self.first = 0
            self.high = mib

    def risen(self) -> list[bool]:
        """Whether its memory set a new high in each of the window's `PARTS` parts, oldest first."""
        assert self.last is not None
        end = self.last[0]
        start = self.cut(end)
        self.first = bisect_left(self.rises, start, self.first)
        if self.first > MAX_KEPT:  # rises out of every later window
            del self.rises[: self.first]
            self.first = 0
        width = (end - start) / PARTS
        rises, at, risen = self.rises, self.first, []
        for k in range(PARTS):
            at = bisect_left(rises, start + k * width, at)
            risen.append(at < len(rises) and (k == PARTS - 1 or rises[at] < start + (k + 1) * width))
        return risen


class EarlyRestarts:
    """Keeps each running task's memory series and predicts its peak; `instances`: restart a task alone on a MIG
    instance it will outgrow."""

    def __init__(self, remaining: Remaining, warmup_s: Warmup = lambda task: 0.0, instances: bool = True) -> None:
        self.remaining = remaining
        self.warmup_s = warmup_s
        self.instances = instances
        self._series: dict[TaskId, _Series] = {}
        self.moving: set[TaskId] = set()  # the tasks whose memory moved since their warm-up: those worth a fit

    def observe(self, task: Task, attempt: int, t: float, used_mib: int) -> None:
        """A reading of a task's memory (its instance's, or its processes' on a shared GPU), from its first kernel
        on."""
        kept = self._series.get(task.id)
        if kept is None or kept.attempt != attempt:
            kept = self._series[task.id] = _Series(attempt, t + self.warmup_s(task))
            self.moving.discard(task.id)
        if kept.last is not None and t <= kept.last[0]:
            return  # a reading already taken (a world may hand a window over again)
        kept.last = (t, float(used_mib))
        if t < kept.settled_s:
            return
        cut = kept.cut(t)
        kept.rise(t, used_mib)
        if not kept.line.n and (not kept.flat or used_mib == kept.level):  # flat so far: most tasks, no sums kept
            kept.level = used_mib
            flat = kept.flat
            flat.append(t)
            while flat[0] < cut:
                flat.popleft()
            if len(flat) > MAX_KEPT:
                kept.flat = deque(list(flat)[::2])
            return
        for earlier in kept.flat:  # its first move: the flat samples kept join the line
            kept.line.add(earlier, kept.level)
        kept.flat.clear()
        self.moving.add(task.id)
        kept.line.add(t, used_mib)
        kept.line.drop_before(cut)
        if kept.line.n > MAX_KEPT:
            kept.line.thin()

    def forget(self, task_id: TaskId) -> None:
        self._series.pop(task_id, None)
        self.moving.discard(task_id)

    def latest_mib(self, task_id: TaskId) -> float | None:
        """The task's latest reading (None before the first)."""
        kept = self._series.get(task_id)
        return None if kept is None or kept.last is None else kept.last[1]

    def predicted(self, task: Task, attempt: int, now: float) -> Prediction | None:
        """The peak of `task` (attempt `attempt`) over the rest of its run, when its memory grows (None: flat since
        its warm-up, too few readings, or its remaining time not known). A hold asks `rising` too, a restart
        `lasting`."""
        kept = self._series.get(task.id)
        if kept is None or kept.attempt != attempt or not kept.line.n:
            return None
        left = self.remaining(task, now)
        growth = kept.line.growth()
        if left is None or not isinstance(growth, Growth):
            return None
        prediction = growth.at(max(0.0, left + (now - growth.t_last)))
        return prediction if prediction.growing else None

    def lasting(self, task_id: TaskId) -> bool:
        """Whether the task's memory keeps growing: new highs in each part of the fit's window, not one step (a
        wrong restart costs a healthy task its work)."""
        kept = self._series.get(task_id)
        return kept is not None and kept.last is not None and all(kept.risen())

    def rising(self, task_id: TaskId) -> bool:
        """Whether the task's memory set a new high lately (in the last `RISING_S` or the last part of the fit's
        window): a growth that may have begun, worth holding memory for; a step long past is not."""
        kept = self._series.get(task_id)
        if kept is None or kept.last is None or not kept.rises:
            return False
        return kept.last[0] - kept.rises[-1] <= RISING_S or kept.risen()[-1]

    def check(self, task: Task, attempt: int, capacity_mib: int, room_mib: int, now: float) -> Outgrowing | None:
        """Whether `task` (attempt `attempt`, alone on a target of `capacity_mib`, whose GPU can make one of up to
        `room_mib`) should be restarted early now."""
        if room_mib <= capacity_mib:
            return None
        prediction = self.predicted(task, attempt, now)
        if prediction is None or not capacity_mib < prediction.peak_mib <= room_mib or not self.lasting(task.id):
            return None
        return Outgrowing(task.id, attempt, prediction, capacity_mib)
