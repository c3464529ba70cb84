"""Scheme A for dynamic MIG (MIGM, seed 002, section 4.3), bounded: a queue discipline that groups waiting tasks
by the MIG profile their need picks, so that tasks of one size follow each other and reuse their instances
instead of reconfiguring between sizes. Scheme B is `carma.core.queue.StrictFifo`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from carma.core.blocked import Blocked, Estimating, HeadOfLine, PassedOver, RecoveryPriority, Undecided
from carma.core.queue import Attempt, Queues
from carma.core.types import Task, TaskId, TaskState

DEFAULT_MAX_PASSES = 3


class SizeGrouped:
    """MIGM's scheme A, bounded: the recovery queue's head first, as under `StrictFifo`; then the main queue with
    the tasks of the group last placed (`group`: the MIG profile a task's need picks) ahead of the rest, each in
    submission order, so that tasks of one size follow each other and reuse their instances. A task placed
    ahead of earlier ones passes them over; one passed over `max_passes` times goes first from then on, and no
    task passes it (MIGM's scheme A can starve a size; this one cannot). The first task in that order that must
    wait stops the decision, as the head does under FIFO."""

    def __init__(self, group: Callable[[TaskId], Hashable], max_passes: int = DEFAULT_MAX_PASSES) -> None:
        if max_passes < 0:
            raise ValueError(f"max_passes must not be negative, got {max_passes}")
        self.group = group
        self.max_passes = max_passes
        self._passes: dict[TaskId, int] = {}
        self._current: Hashable | None = None
        self._first: TaskId | None = None  # the task at the front of the order when the last decision stopped

    def offer(self, queues: Queues, attempt: Attempt) -> None:
        while queues.recovery:
            if isinstance(attempt(queues.recovery[0]), Blocked):
                return
        waiting = set(queues.main)
        self._passes = {t: n for t, n in self._passes.items() if t in waiting}
        estimating: set[TaskId] = set()  # not ready yet: passed, as under FIFO (`carma.core.queue.first_waiting`)
        while main := [t for t in queues.main if t not in estimating]:
            chosen = self.first(deque(main))
            self._first = chosen
            ahead = main[: main.index(chosen)]  # submitted earlier, still waiting: passed over if it goes now
            outcome = attempt(chosen)
            if isinstance(outcome, Estimating):
                estimating.add(chosen)
                continue
            if isinstance(outcome, Blocked):
                return
            self._passes.pop(chosen, None)
            self._current = self.group(chosen)
            for t in ahead:
                self._passes[t] = self._passes.get(t, 0) + 1
        self._first = None

    def first(self, main: deque[TaskId]) -> TaskId:
        """The waiting task to offer next: the earliest passed over `max_passes` times, else the earliest of the
        group last placed, else the head."""
        pinned = next((t for t in main if self._passes.get(t, 0) >= self.max_passes), None)
        if pinned is not None:
            return pinned
        if self._current is not None:
            same = next((t for t in main if self.group(t) == self._current), None)
            if same is not None:
                return same
        return main[0]

    def waiting(self, task: Task, queues: Queues) -> Blocked | None:
        if task.state is TaskState.RECOVERING:
            return Undecided() if queues.recovery[0] == task.id else HeadOfLine()
        if task.state is TaskState.QUEUED:
            if queues.recovery:
                return RecoveryPriority()
            if task.id == self._first or (self._first is None and queues.main[0] == task.id):
                return Undecided()
            passes = self._passes.get(task.id, 0)
            return PassedOver(passes, self.max_passes) if passes else HeadOfLine()
        return None
