"""Scheduling on dynamic MIG GPUs: the Reconfigure action through the loop, the targets following the layout, the
MIG placer's sizes and OOM restarts, scheme A's bounded grouping, and random request/release sequences."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.mig_world import MigWorld

from carma.core import ExitKind, NeedKind, ProcessExit, Scheduler, SchedulerConfig, Target, TaskSpec, TaskState
from carma.core.blocked import PassedOver, Preparing, TtfkWait
from carma.core.early import EARLY_RESTART, EarlyRestarts
from carma.core.grouped import SizeGrouped
from carma.core.queue import Queues
from carma.core.types import MigSlot, Reconfigure
from carma.server.executor import ProcessExecutor

OOM = ProcessExit(1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
NO_MARGIN = SchedulerConfig(margin_mib=0)


def settle(loop, world: MigWorld, steps: int = 3) -> None:  # type: ignore[no-untyped-def]
    for _ in range(steps):
        world.t += 1
        loop.step()


def test_a_plan_is_saved_then_carried_out_and_the_task_launches_once_its_instance_is_read():
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN)
    task = loop.submit(TaskSpec("small", mem_mib=4000))
    loop.step()
    # MIGM's rule: the idle 7g gives way to a 1g.5gb on the last slice, which keeps the most layouts reachable
    action = Reconfigure("GPU-0", destroy=(MigSlot("7g.40gb", 0),), create=(MigSlot("1g.5gb", 6),))
    assert world.log[-2:] == [("save", ((1, "queued"),)), ("reconfigure", action)]
    assert [t.slot for t in loop.scheduler.gpus.values()] == [MigSlot("1g.5gb", 6)]  # the targets follow
    assert task.state is TaskState.QUEUED
    assert loop.scheduler.blocked(task.id) == Preparing((action,))
    settle(loop, world, 1)
    assert world.log[-1] == ("launch", 1, "GPU-0/1g.5gb@6") and task.state is TaskState.DISPATCHED


def test_an_idle_instance_that_holds_the_need_is_taken_without_reconfiguring():
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN)
    loop.submit(TaskSpec("big", mem_mib=30000))
    loop.step()
    assert world.log[-1] == ("launch", 1, "GPU-0/7g.40gb@0")
    assert not any(entry[0] == "reconfigure" for entry in world.log)


def test_the_margin_picks_the_next_profile():
    world = MigWorld()
    loop = world.loop(config=SchedulerConfig(margin_mib=2048))
    loop.submit(TaskSpec("small", mem_mib=4000))  # 6048 MiB with the margin: two memory slices, not a 1g.5gb
    settle(loop, world)
    assert world.placed[1].split("/")[1] == "1g.10gb@6"


def test_sync_removes_idle_targets_the_world_no_longer_lists_and_keeps_busy_ones():
    a, b = Target("A", "x", 100), Target("B", "x", 100)
    sched = Scheduler([a, b])
    sched.submit(TaskSpec("job"), 0)
    sched._on_gpu["A"].add(1)  # a task runs on A
    sched.sync_targets([Target("C", "x", 100)], 1.0)
    assert list(sched.gpus) == ["A", "C"]


def test_a_task_of_unknown_need_starts_small_and_restarts_on_the_next_larger_profile_after_an_oom():
    world = MigWorld()
    loop = world.loop(config=SchedulerConfig(margin_mib=0, max_relaunches=2))
    task = loop.submit(TaskSpec("unknown"))
    sizes = []
    for _ in range(3):
        settle(loop, world)
        sizes.append(world.placed[task.id].split("/")[1].split("@")[0])
        world.end(task.id, OOM)
    assert sizes == ["1g.5gb", "2g.10gb", "4g.20gb"]  # never a whole GPU at once
    # what it waits for and runs with, as `carma queue` and `show` say it (they said "whole GPU")
    needs = [a.need for a in task.attempts[1:]]
    assert [(n.kind, n.source) for n in needs] == [(NeedKind.KNOWN, "recovery: a larger MIG instance")] * 2  # type: ignore[union-attr]
    assert [n.mib for n in needs] == [world.geometry.profile(p).memory_mib for p in ("1g.10gb", "3g.20gb")]  # type: ignore[union-attr]
    settle(loop, world)
    assert task.state is TaskState.FAILED and "limit reached" in task.reason  # max_relaunches bounds it


def test_a_task_out_of_memory_alone_on_the_largest_instance_fails():
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN)
    task = loop.submit(TaskSpec("huge", mem_mib=30000))
    settle(loop, world)
    world.end(task.id, OOM)
    settle(loop, world)
    assert task.state is TaskState.FAILED and "more memory than any instance here holds" in task.reason


def test_a_need_the_largest_instance_holds_only_without_its_whole_margin_runs_there():
    """38 GiB (accepted: the largest instance holds it) with the 2 GiB margin is over a 7g.40gb's 40,192 MiB: it
    waited for a whole GPU a MIG server does not have, and every task behind it waited too."""
    world = MigWorld()
    loop = world.loop(config=SchedulerConfig(margin_mib=2048))
    big = loop.submit(TaskSpec("big", mem_mib=38 * 1024))
    settle(loop, world)
    assert world.placed[big.id].split("/")[1] == "7g.40gb@0"
    too_big = loop.submit(TaskSpec("too big", mem_mib=40193))
    settle(loop, world)
    assert too_big.state is TaskState.QUEUED and too_big.id not in world.placed


def test_a_need_larger_than_the_current_instances_is_kept_not_turned_into_a_whole_gpu():
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN)
    first = loop.submit(TaskSpec("small", mem_mib=4000))
    settle(loop, world)
    world.end(first.id, ProcessExit(0))
    second = loop.submit(TaskSpec("mid", mem_mib=15000))  # more than the 1g.5gb left, less than a 4g.20gb
    settle(loop, world)
    assert "4g.20gb" in world.placed[second.id]
    assert second.current is not None and second.current.need is not None and second.current.need.mib == 15000


def test_a_daemon_without_dynamic_mig_refuses_a_reconfiguration_in_one_line(tmp_path):
    executor = ProcessExecutor(tmp_path, {}.__getitem__)
    with pytest.raises(
        ValueError, match="cannot reconfigure MIG GPU GPU-0: carma server runs without --mig dynamic"
    ) as e:
        executor.reconfigure(Reconfigure("GPU-0", (), (MigSlot("1g.5gb", 0),)))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------- scheme A


def grouped_offer(sizes: dict[int, str], max_passes: int, place: set[int]) -> tuple[list[int], SizeGrouped]:
    """One decision of scheme A over tasks of these sizes, in submission order; `place`: those that fit now."""
    discipline = SizeGrouped(sizes.__getitem__, max_passes)
    queues = Queues()
    queues.main.extend(sizes)
    offered: list[int] = []

    def attempt(task_id, avoid=frozenset()):  # type: ignore[no-untyped-def]
        offered.append(task_id)
        if task_id in place:
            queues.take(task_id, False)
            return object()
        return PassedOver(0, 0)

    discipline.offer(queues, attempt)
    return offered, discipline


def test_scheme_a_runs_a_size_group_together_then_returns_to_the_queue_order():
    offered, _ = grouped_offer({1: "1g", 2: "3g", 3: "1g", 4: "1g", 5: "3g"}, 5, {1, 2, 3, 4, 5})
    assert offered == [1, 3, 4, 2, 5]


def test_scheme_a_passes_a_task_over_at_most_max_passes_times():
    offered, _ = grouped_offer({1: "1g", 2: "3g", 3: "1g", 4: "1g", 5: "1g"}, 2, {1, 2, 3, 4, 5})
    assert offered == [1, 3, 4, 2, 5]  # task 2 is passed over twice, then goes first


def test_scheme_b_fifo_never_reorders():
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN, scheme="b")
    for mem in (4000, 15000, 4000):
        loop.submit(TaskSpec("t", mem_mib=mem))
    settle(loop, world, 8)
    assert [entry[1] for entry in world.log if entry[0] == "launch"] == [1, 2, 3]


# ----------------------------------------------------------------- random request/release sequences

SETTINGS = settings(
    max_examples=int(os.environ.get("CARMA_HYPOTHESIS_EXAMPLES", 60)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(
    needs=st.lists(st.one_of(st.none(), st.integers(500, 39000)), min_size=1, max_size=25),
    events=st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=60),
    gpus=st.integers(1, 2),
    scheme=st.sampled_from(["a", "b"]),
)
def test_random_requests_and_releases_keep_every_layout_valid_and_every_task_in_its_size(needs, events, gpus, scheme):
    world = MigWorld(gpus)  # its reconfigure checks each layout and refuses to destroy a busy instance
    loop = world.loop(config=NO_MARGIN, scheme=scheme)
    tasks = [loop.submit(TaskSpec(f"t{i}", mem_mib=mem)) for i, mem in enumerate(needs)]
    for pick, crash in [*events, *[(i, False) for i in range(len(needs)) for _ in range(8)]]:
        settle(loop, world, 1)
        running = sorted(t for t, target in world.placed.items() if world.on.get(target) == t)
        if running:
            task_id = running[pick % len(running)]
            world.end(task_id, OOM if crash else ProcessExit(0))
    settle(loop, world, 4)
    for task in tasks:
        assert task.terminal, f"task {task.id} lost: {task.state}, {loop.scheduler.blocked(task.id)}"
        for attempt in task.attempts:
            if task.spec.mem_mib is not None:
                (target,) = attempt.gpus
                profile = target.split("/")[1].split("@")[0]
                assert world.geometry.profile(profile).memory_mib >= task.spec.mem_mib


def test_each_mig_waiting_reason_has_words():
    from carma.core.mig.placer import AwaitingInstance, NoInstance
    from carma.reasons import render

    reasons = [
        render(b, str)
        for b in (PassedOver(2, 3), Preparing(()), AwaitingInstance("GPU-0", "1g.5gb@6"), NoInstance("no 1g.5gb fits"))
    ]
    assert reasons[0] == "tasks of another size went first 2 times (at most 3: scheme A)"
    assert reasons[2] == "waiting for its MIG instance 1g.5gb@6 on GPU GPU-0 to be ready"
    assert all(r and "\n" not in r for r in reasons)
    # every instance busy on static MIG: it read "0 shareable and not awaiting a first kernel (TTFK)"
    assert render(TtfkWait(1, 0, 0), str).startswith("needs 1 GPU; no idle one that holds it, and none another task")
    assert render(TtfkWait(1, 0, 2), str) == "needs 1 GPU; 0 shareable and not awaiting a first kernel (TTFK)"


# ----------------------------------------------------------------- early restarts on predicted growth


def test_a_task_predicted_to_outgrow_its_instance_restarts_early_on_a_larger_one():
    world = MigWorld()
    early = EarlyRestarts(remaining=lambda task, now: 100.0)
    loop = world.loop(config=NO_MARGIN, early=early)
    task = loop.submit(TaskSpec("growing", mem_mib=4000))
    settle(loop, world, 2)
    assert "1g.5gb" in world.placed[task.id]
    for second in range(30):  # 3000 MiB, then 40 MiB more a second: 4864 MiB in 47 s, within the 100 s left
        world.mem[task.id] = 3000 + 40 * second
        settle(loop, world, 1)
        if task.current is not None and task.current.number == 2:
            break
    first, second_attempt = task.attempts
    assert first.message.startswith(EARLY_RESTART) and first.outcome is ExitKind.OOM
    assert "2g.10gb" in second_attempt.gpus[0]  # the next larger profile, before any crash


def test_a_flat_task_or_one_of_unknown_remaining_time_is_not_restarted():
    for remaining, growth in ((100.0, 0), (None, 40)):
        world = MigWorld()
        loop = world.loop(config=NO_MARGIN, early=EarlyRestarts(remaining=lambda task, now, r=remaining: r))
        task = loop.submit(TaskSpec("steady", mem_mib=4000))
        settle(loop, world, 2)
        for second in range(15):
            world.mem[task.id] = 3000 + growth * second
            settle(loop, world, 1)
        assert len(task.attempts) == 1 and task.state is TaskState.RUNNING


def test_the_mig_placer_keeps_nothing_for_tasks_that_ended():
    """A task cancelled while its instance is made, and one that completed, leave no entry behind: a daemon of
    months would gather one per task."""
    world = MigWorld()
    loop = world.loop(config=NO_MARGIN)
    waiting = loop.submit(TaskSpec("small", mem_mib=4000))
    loop.step()  # its instance is being made for it
    placer = loop.scheduler.placer
    assert waiting.id in placer._reserved
    loop.cancel(waiting.id)
    done = loop.submit(TaskSpec("other", mem_mib=4000))
    settle(loop, world)
    world.end(done.id, ProcessExit(0))
    settle(loop, world, 1)
    assert loop.scheduler.task(done.id).state is TaskState.COMPLETED
    kept = (placer._reserved, placer._offered, placer._ran_on)
    assert all(waiting.id not in k and done.id not in k for k in kept)
