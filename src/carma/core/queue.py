"""Queue disciplines: which waiting task the scheduler offers the placer next, and when a decision stops.

CARMA's is strict FIFO (`StrictFifo`). Another discipline (a size-grouped order with a bound on how often a
task is passed over; backfilling, `carma.core.backfill`) is another class following `QueueDiscipline`.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from carma.core.blocked import Blocked, Estimating, HeadOfLine, RecoveryPriority, Undecided
from carma.core.placer import Placement
from carma.core.types import TargetId, Task, TaskId, TaskState


class Attempt(Protocol):
    def __call__(self, task_id: TaskId, avoid: frozenset[TargetId] = frozenset()) -> Placement | Blocked:
        """Place a waiting task and launch it (the placement), or keep why it must wait (the Blocked); `avoid`:
        targets it may not take now (held for a task ahead of it: `carma.core.backfill`)."""
        ...


class Queues:
    """The waiting tasks: the main queue in submission order, and the recovery queue of OOM relaunches."""

    def __init__(self) -> None:
        self.main: deque[TaskId] = deque()
        self.recovery: deque[TaskId] = deque()

    def take(self, task_id: TaskId, recovery: bool) -> None:
        """Remove a placed task from its queue (its head, under FIFO)."""
        queue = self.recovery if recovery else self.main
        if queue[0] == task_id:
            queue.popleft()
        else:
            queue.remove(task_id)

    def drop(self, task_id: TaskId) -> None:
        """Remove a task that no longer waits (cancelled) from whichever queue holds it."""
        for queue in (self.main, self.recovery):
            if task_id in queue:
                queue.remove(task_id)


class QueueDiscipline(Protocol):
    def offer(self, queues: Queues, attempt: Attempt) -> None:
        """Offer waiting tasks to `attempt`, in this discipline's order, until it stops."""
        ...

    def waiting(self, task: Task, queues: Queues) -> Blocked | None:
        """Why a waiting task that the last decision did not offer waits (None: it does not wait)."""
        ...


def first_waiting(queues: Queues, attempt: Attempt) -> TaskId | None:
    """Offer the waiting tasks in FIFO order, the recovery queue first, until one must wait, and return it (None
    when none must). A task whose memory estimate is still being made is not ready yet: the tasks behind it go
    on (a capture takes minutes, and a user's captures one after another held every user's tasks)."""
    for queue in (queues.recovery, queues.main):
        passed = 0  # the tasks at the front still estimating: a placed one leaves the queue, its next moves up
        while passed < len(queue):
            task_id = queue[passed]
            outcome = attempt(task_id)
            if isinstance(outcome, Estimating):
                passed += 1
            elif isinstance(outcome, Blocked):
                return task_id
    return None


class StrictFifo:
    """The recovery queue's head first: while it waits, everything waits (CARMA section 2.5); then the main
    queue's head. A head that must wait stops the decision: no task passes it (no backfilling), but one still
    waiting for its memory estimate (`first_waiting`)."""

    def offer(self, queues: Queues, attempt: Attempt) -> None:
        first_waiting(queues, attempt)

    def waiting(self, task: Task, queues: Queues) -> Blocked | None:
        if task.state is TaskState.RECOVERING:  # a recovering task is in the recovery queue
            return Undecided() if queues.recovery[0] == task.id else HeadOfLine()
        if task.state is TaskState.QUEUED:  # as a queued one is in the main queue
            if queues.recovery:
                return RecoveryPriority()
            return Undecided() if queues.main[0] == task.id else HeadOfLine()
        return None
