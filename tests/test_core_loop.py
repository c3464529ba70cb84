"""The scheduling loop: the same step in both worlds, persisting every change before acting on it."""

from carma.core import GpuSample, ProcessExit, Scheduler, SchedulingLoop, Target, TaskSpec, TaskState
from carma.core.ports import GpuProcesses, TaskExit, TelemetryReading


class World:
    """Clock, telemetry, executor and journal in one, recording the order things happen in."""

    def __init__(self) -> None:
        self.t = 0.0
        self.log: list[tuple] = []
        self.exits: list[TaskExit] = []
        self.seen: frozenset[int] = frozenset()

    def now(self) -> float:
        return self.t

    def gpus(self):  # type: ignore[no-untyped-def]
        return [Target("GPU-0", "A100-40GB", 40960)]

    def read(self, now):  # type: ignore[no-untyped-def]
        return TelemetryReading([GpuSample("GPU-0", now, 0, 40960, 0.0, 0.0, 0.0)], {"GPU-0": GpuProcesses(self.seen)})

    def launch(self, task, launch) -> None:  # type: ignore[no-untyped-def]
        self.log.append(("launch", task.id))

    def kill(self, task_id: int) -> None:
        self.log.append(("kill", task_id))

    def poll_exits(self):  # type: ignore[no-untyped-def]
        exits, self.exits = self.exits, []
        return exits

    def save(self, tasks) -> None:  # type: ignore[no-untyped-def]
        self.log.append(("save", tuple((t.id, t.state.value) for t in tasks)))


def test_every_change_is_saved_before_the_launch_it_decides():
    world = World()
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world, journal=world)
    task = loop.submit(TaskSpec("job"))
    loop.step()
    assert world.log == [("save", ((1, "queued"),)), ("save", ((1, "dispatched"),)), ("launch", 1)]
    world.seen = frozenset({task.id})
    world.t = 1
    loop.step()
    assert world.log[-1] == ("save", ((1, "running"),))
    world.exits.append(TaskExit(task.id, ProcessExit(0), 5.0))
    world.t = 6
    loop.step()
    assert task.state is TaskState.COMPLETED and task.ended_s == 5.0  # the exit's own time
    assert world.log[-1] == ("save", ((1, "completed"),))


def test_draining_takes_exits_and_telemetry_in_but_places_nothing():
    world = World()
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world)
    loop.submit(TaskSpec("job"))
    assert loop.step(place=False) == [] and ("launch", 1) not in world.log
    assert [launch.task_id for launch in loop.step()] == [1]


def test_cancelling_a_live_task_saves_the_request_then_kills():
    world = World()
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world, journal=world)
    task = loop.submit(TaskSpec("job"))
    loop.step()
    loop.cancel(task.id)
    assert world.log[-2:] == [("save", ((1, "dispatched"),)), ("kill", 1)]
    assert task.cancel_requested


def test_a_cancel_the_journal_cannot_take_is_refused_changing_nothing():
    """A full disk took a queued task's cancel in memory, said `cancelled`, and a restart queued it again."""
    import pytest

    from carma.core.loop import JournalError

    class Full(World):
        def save(self, tasks) -> None:  # type: ignore[no-untyped-def]
            raise JournalError("no space left") from OSError(28, "No space left on device")

    world = Full()
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world, journal=world)
    task = loop.scheduler.submit(TaskSpec("job"), 0.0)
    with pytest.raises(JournalError):
        loop.cancel(task.id)
    assert task.state is TaskState.QUEUED and loop.scheduler.queue == [task.id]
