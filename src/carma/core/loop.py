"""One scheduling step, identical in both worlds: exits, telemetry, decisions, launches."""

from __future__ import annotations

from carma.core.ports import Clock, Executor, Telemetry
from carma.core.scheduler import Scheduler
from carma.core.types import Launch, Task, TaskId, TaskSpec


class SchedulingLoop:
    def __init__(self, scheduler: Scheduler, clock: Clock, telemetry: Telemetry, executor: Executor) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.telemetry = telemetry
        self.executor = executor

    def submit(self, spec: TaskSpec) -> Task:
        return self.scheduler.submit(spec, self.clock.now())

    def cancel(self, task_id: TaskId) -> None:
        if self.scheduler.cancel(task_id, self.clock.now()):
            self.executor.kill(task_id)

    def step(self) -> list[Launch]:
        now = self.clock.now()
        sched = self.scheduler
        for ended in self.executor.poll_exits():
            sched.record_exit(ended.task_id, ended.exit, ended.ended_s)
        reading = self.telemetry.read(now)
        for sample in reading.samples:
            sched.record_sample(sample)
        for gpu, procs in reading.processes.items():
            sched.record_gpu_processes(gpu, procs.tasks, procs.foreign, now)
        launches = sched.decide(now)
        for launch in launches:
            self.executor.launch(sched.task(launch.task_id), launch)
        return launches
