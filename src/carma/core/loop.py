"""One scheduling step, identical in both worlds: exits, telemetry, decisions, persistence, launches."""

from __future__ import annotations

import time
from collections.abc import Callable

from carma.core.ports import Clock, Executor, Journal, Telemetry
from carma.core.scheduler import Scheduler
from carma.core.types import Launch, Task, TaskId, TaskSpec


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

    def submit(self, spec: TaskSpec, task_id: TaskId | None = None, at: float | None = None) -> Task:
        """Queue a task submitted `at` (now by default; a world that recorded it first gives the time it kept)."""
        task = self.scheduler.submit(spec, self.clock.now() if at is None else at, task_id)
        self._persist()
        return task

    def cancel(self, task_id: TaskId) -> None:
        kill = self.scheduler.cancel(task_id, self.clock.now())
        self._persist()
        if kill:
            self.executor.kill(task_id)

    def step(self, place: bool = True) -> list[Launch]:
        """Take exits and telemetry in; unless `place` is off (draining), decide; persist; launch."""
        now = self.clock.now()
        sched = self.scheduler
        for ended in self.executor.poll_exits():
            sched.record_exit(ended.task_id, ended.exit, ended.ended_s)
        reading = self.telemetry.read(now)
        for sample in reading.samples:
            sched.record_sample(sample)
        for gpu, procs in reading.processes.items():
            sched.record_gpu_processes(gpu, procs.tasks, procs.foreign, now)
        launches = self._decide(now) if place else []
        self._persist()  # every change, placements included, is written before it is acted on
        for launch in launches:
            self.executor.launch(sched.task(launch.task_id), launch)
        return launches

    def _decide(self, now: float) -> list[Launch]:
        if self.on_decision is None:
            return self.scheduler.decide(now)
        began = time.perf_counter()
        launches = self.scheduler.decide(now)
        self.on_decision(time.perf_counter() - began)
        return launches

    def _persist(self) -> None:
        changes = self.scheduler.take_changes()
        if self.journal is not None and changes:
            self.journal.save(changes)
