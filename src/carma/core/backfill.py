"""EASY backfilling: while the head of the queue waits, later tasks may start where they cannot delay it.

The head gets a reservation: the GPUs it can take that come free first, by the tasks' expected ends (their
dispatch plus their duration), and the moment the last of them does (its shadow time). A later task of known
duration may then start on any other GPU, or on a reserved GPU that is idle now if it ends before the shadow
time; the placer's rules (memory, risk, TTFK) apply to it as to any task. Durations come from a port
(`DurationOf`): the twin's trace catalog, the daemon's history; a task whose duration is not known is never
backfilled, and a GPU holding one never comes free in a reservation, so without durations this is strict
FIFO. Expected ends assume a task's solo duration: a collocated task that runs slower than it can make the
head start later than its shadow time, never earlier than it would have.

On shared GPUs the head need not wait for a GPU to empty: a GPU comes free for it once the tasks left on it
are ones it fits beside (`LeavesRoom`: their needs and the head's in its memory, their expected activity
together passing the risk rule), and a later task the head would still fit beside may start on a reserved GPU
whenever it ends. On trace 1, the head waited for GPUs left idle or to long light tasks (docs/policy.md). A
head refused although expected to fit now was misjudged: in that decision no task joins its reserved GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from carma.core.placer import for_tasks_of
from carma.core.queue import Attempt, Queues, StrictFifo, first_waiting
from carma.core.types import TargetId, Task, TaskId
from carma.core.view import View


class Occupancy(View, Protocol):
    """A view that also says which tasks each GPU holds."""

    def tasks_on(self, gpu: TargetId) -> Sequence[Task]:
        """The tasks placed on `gpu` and not ended."""
        ...


# A task's expected run time (seconds, launch to exit, alone on its GPUs), or None when not known.
DurationOf = Callable[[Task], float | None]
# Whether the head could be placed on a GPU beside the given tasks (their needs and expected activity leave it room
# and pass the risk rule); never where that cannot be told (whole GPUs, needs or activity not known).
LeavesRoom = Callable[[Task, TargetId, Sequence[Task]], bool]


def _never(head: Task, gpu: TargetId, tasks: Sequence[Task]) -> bool:
    return False


@dataclass(frozen=True)
class Reservation:
    """The GPUs the blocked head is expected to start on, and when (its shadow time)."""

    task: TaskId
    gpus: frozenset[TargetId]
    shadow_s: float


class EasyBackfill(StrictFifo):
    """Strict FIFO for the head (the recovery queue's first), then, while it waits, backfilling past it."""

    def __init__(
        self,
        view: Occupancy,
        task_of: Callable[[TaskId], Task],
        duration_of: DurationOf,
        leaves_room: LeavesRoom = _never,
    ) -> None:
        self._view = view
        self._task_of = task_of
        self._duration_of = duration_of
        self._leaves_room = leaves_room
        self.reservation: Reservation | None = None  # the last decision's, for tests and reports

    def offer(self, queues: Queues, attempt: Attempt) -> None:
        self.reservation = None
        head = first_waiting(queues, attempt)
        if head is None:
            return
        head_task, view = self._task_of(head), self._view
        reservation = self._reserve(head_task)
        if reservation is None:
            return
        self.reservation = reservation
        # expected to start now, yet refused: what it fits beside was misjudged (by a rule `LeavesRoom` does not
        # see: the observed risk window, free memory, a predicted growth), so nothing joins its reserved GPUs
        # beside it this decision; else a stream of tasks beside it could hold it back for good
        room = _never if reservation.shadow_s <= view.now else self._leaves_room
        for task_id in [t for t in (*queues.recovery, *queues.main) if t != head]:
            duration = self._duration_of(self._task_of(task_id))
            if duration is None:
                continue
            reserved = reservation.gpus
            if view.now + duration <= reservation.shadow_s:  # it ends in time: the reserved idle GPUs too
                idle = set(view.idle_gpus())
                reserved = frozenset(g for g in reserved if g not in idle)
            if reserved:  # a task the head still fits beside may start on its reserved GPUs too
                task = self._task_of(task_id)
                shadow = reservation.shadow_s
                reserved = frozenset(g for g in reserved if not self._room(room, head_task, g, task, shadow))
            attempt(task_id, reserved)

    def _room(self, room: LeavesRoom, head: Task, gpu: TargetId, task: Task, shadow_s: float) -> bool:
        """Whether `task` on `gpu` leaves the head room there, beside the tasks expected to run past its shadow."""
        staying = [t for t in self._view.tasks_on(gpu) if self._end(t) > shadow_s]
        return room(head, gpu, [*staying, task])

    def _end(self, task: Task) -> float:
        """When a placed task is expected to end; never when its duration is not known."""
        duration = self._duration_of(task)
        attempt = task.current
        if duration is None or attempt is None:
            return math.inf
        return attempt.dispatched_s + duration

    def _reserve(self, head: Task) -> Reservation | None:
        """The head's reservation: the n GPUs it may take that are expected to be free first; None when fewer than
        n are ever expected free (a task of unknown duration, another process)."""
        view = self._view
        n = head.spec.gpus
        idle = set(view.idle_gpus())
        free_at = {g: self._free_at(g, g in idle, head) for g in for_tasks_of(n, list(view.gpus), view.gpus)}
        first = sorted(free_at, key=lambda g: free_at[g])[:n]
        if len(first) < n or math.isinf(shadow := max(free_at[g] for g in first)):
            return None
        return Reservation(head.id, frozenset(first), shadow)

    def _free_at(self, gpu: TargetId, idle: bool, head: Task) -> float:
        """When `gpu` is expected to hold only tasks the head fits beside (now for an idle one; never with a
        process of someone else's): the end of the last to end that it does not fit beside."""
        view = self._view
        if idle:
            return view.now
        tasks = view.tasks_on(gpu)
        if not tasks:
            return math.inf  # only another process: carma cannot tell when it ends
        staying: list[Task] = []
        for task in sorted(tasks, key=self._end, reverse=True):
            if not self._leaves_room(head, gpu, [*staying, task]):
                return max(view.now, self._end(task))
            staying.append(task)
        return view.now
