"""One scheduling step, identical in both worlds: exits, telemetry, decisions, persistence, actions.

Every change is written to the journal before it is acted on. A journal that cannot write for a while (a
full disk) raises `JournalError`: the in-memory core stays authoritative, the changes wait and are written
at the next call, and the actions decided meanwhile wait with them (a launch not written could run twice
after a restart); no new placement is decided until the journal has caught up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import assert_never

from carma.core.ports import Clock, Executor, Journal, Telemetry
from carma.core.scheduler import Scheduler
from carma.core.types import Action, Kill, Launch, Reconfigure, Task, TaskId, TaskSpec


class JournalError(Exception):
    """The journal could not write now; the loop keeps the changes and writes them at its next call."""


class SchedulingLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: Clock,
        telemetry: Telemetry,
        executor: Executor,
        journal: Journal | None = None,
        on_decision: Callable[[float], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.telemetry = telemetry
        self.executor = executor
        self.journal = journal
        self.on_decision = on_decision  # told how many seconds each decision took (instrumentation only)
        self._unsaved: dict[TaskId, Task] = {}  # changed tasks the journal failed to write so far
        self._held: list[Action] = []  # decided actions waiting for the changes they follow to be written

    def submit(self, spec: TaskSpec, task_id: TaskId | None = None, at: float | None = None) -> Task:
        """Queue a task submitted `at` (now by default; a world that recorded it first gives the time it kept)."""
        task = self.scheduler.submit(spec, self.clock.now() if at is None else at, task_id)
        self._persist()
        return task

    @property
    def behind(self) -> bool:
        """Whether changes are waiting for the journal."""
        return bool(self._unsaved)

    def cancel(self, *task_ids: TaskId) -> None:
        """Cancel tasks, together: no placement comes between them, and their changes are written at once (a
        cancel of 3,000 queued tasks, one at a time, was 6,000 writes). Raises JournalError, changing nothing,
        while the journal cannot be written (earlier changes wait, or the tasks' own records cannot be written
        again now: a cancel taken but never written was a queued task back after a restart)."""
        if not task_ids:
            return
        if self._unsaved:
            self._write()  # raises JournalError
        if self.journal is not None:  # raises JournalError, before anything changes
            self.journal.save([self.scheduler.task(task_id) for task_id in task_ids])
        now = self.clock.now()
        actions = [action for task_id in task_ids for action in self.scheduler.cancel(task_id, now)]
        self._persist()  # a failure now leaves the cancels to be written later: the kills asked for go ahead
        self._carry_out(actions)

    def step(self, place: bool = True) -> list[Action]:
        """Take exits and telemetry in; unless `place` is off (draining) or the journal is behind, decide;
        persist; act. Returns the actions carried out."""
        now = self.clock.now()
        sched = self.scheduler
        for ended in self.executor.poll_exits():
            sched.record_exit(ended.task_id, ended.exit, ended.ended_s)
        reading = self.telemetry.read(now)
        for sample in reading.samples:
            sched.record_sample(sample)
        for gpu, procs in reading.processes.items():
            sched.record_gpu_processes(gpu, procs.tasks, procs.foreign, now, procs.used_mib)
        caught_up = self._persist() if self._unsaved else []
        if place and caught_up is not None:
            self._held += self._decide(now)
        return (caught_up or []) + (self._persist() or [])

    def _decide(self, now: float) -> list[Action]:
        if self.on_decision is None:
            return self.scheduler.decide(now)
        began = time.perf_counter()
        actions = self.scheduler.decide(now)
        self.on_decision(time.perf_counter() - began)
        return actions

    def _persist(self) -> list[Action] | None:
        """Write the changes, then carry out the actions that waited on them (returned); None when the
        journal failed."""
        try:
            return self._write()
        except JournalError:
            return None

    def _write(self) -> list[Action]:
        for task in self.scheduler.take_changes():
            self._unsaved[task.id] = task
        if self.journal is not None and self._unsaved:
            self.journal.save(list(self._unsaved.values()))  # every change is written before it is acted on
        self._unsaved.clear()
        actions, self._held = self._held, []
        self._carry_out(actions)
        return actions

    def _carry_out(self, actions: Sequence[Action]) -> None:
        """Hand each action to the executor's method for its kind."""
        for action in actions:
            match action:
                case Launch():
                    self.executor.launch(self.scheduler.task(action.task_id), action)
                case Kill():
                    self.executor.kill(action.task_id)
                case Reconfigure():
                    self.executor.reconfigure(action)
                    # the instances destroyed leave the scheduler and those created join it: the task a plan
                    # was made for is placed on its instance once telemetry has read it (a later decision)
                    self.scheduler.sync_targets(self.telemetry.gpus(), self.clock.now())
                case _:
                    assert_never(action)
