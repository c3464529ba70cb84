"""carma's own decisions in the core: open warm-ups for known needs, EASY backfilling, interference-aware pairing."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carma.core import ProcessExit, RiskConfig, Scheduler, SchedulerConfig, TaskSpec
from carma.core.backfill import EasyBackfill
from carma.core.blocked import MemoryShort, RiskFiltered, TtfkWait, WholeIdle
from carma.core.risk import Activity
from support import Bench


def bench(gpus: int = 3, durations=None, pairing=None, activity=None, **config: object) -> Bench:
    """A Bench whose scheduler is given the duration, interference and activity ports."""
    b = Bench(gpus, **config)
    targets = list(b.sched.gpus.values())
    b.sched = Scheduler(targets, SchedulerConfig(**config), durations=durations, pairing=pairing, activity=activity)
    b.sample()
    return b


# ----------------------------------------------------------------- open warm-ups (ttfk_unknown_only)


def test_a_known_need_leaves_its_gpu_open_during_its_warm_up():
    b = bench(1, ttfk_unknown_only=True)
    first = b.submit("a", mem_mib=8000)
    assert b.placed() == {first.id: (0,)}
    second = b.submit("b", mem_mib=8000)
    assert b.placed() == {second.id: (0,)}  # no first kernel yet: CARMA's rule would close the GPU


def test_without_the_flag_a_known_need_closes_its_gpu_for_its_window():
    b = bench(1)
    b.submit("a", mem_mib=8000)
    b.decide()
    second = b.submit("b", mem_mib=8000)
    assert b.placed() == {}
    assert isinstance(b.sched.blocked(second.id), TtfkWait)


def test_a_task_of_unknown_need_keeps_ttfks_rule():
    b = bench(1, ttfk_unknown_only=True)
    b.submit("unknown")
    b.decide()
    known = b.submit("b", mem_mib=1000)
    assert b.placed() == {}
    assert isinstance(b.sched.blocked(known.id), TtfkWait)


def test_open_warm_ups_never_over_commit_the_needs_held():
    b = bench(1, ttfk_unknown_only=True)  # 40 GiB, less the 512 MiB reserve and a 2 GiB margin per task
    b.submit("a", mem_mib=20000)
    b.decide()
    b.submit("b", mem_mib=15000)
    assert len(b.placed()) == 1  # 20000 + 15000 + 2048 fits beside the reserve
    late = b.submit("c", mem_mib=4000)  # 5448 MiB left, less than 4000 + 2048: only the needs held say so
    assert b.placed() == {}
    assert isinstance(b.sched.blocked(late.id), MemoryShort)


def test_within_one_decision_each_placement_shows_in_the_next_tasks_answers():
    """A decision keeps each GPU's free memory and risk while it offers tasks (backfilling offers them all),
    until a task is placed: the third of three 15 GiB tasks offered together finds the memory the first two
    took."""
    b = bench(1, ttfk_unknown_only=True)  # 40 GiB
    tasks = [b.sched.submit(TaskSpec(name, 1, 15_000), b.t) for name in "abc"]
    assert b.placed() == {tasks[0].id: (0,), tasks[1].id: (0,)}
    assert isinstance(b.sched.blocked(tasks[2].id), MemoryShort)


def test_open_warm_ups_need_the_needs_held():
    """Without them nothing holds a warming task's memory: the switch did nothing, silently."""
    with pytest.raises(ValueError, match="ttfk_unknown_only needs hold_known_needs"):
        bench(1, ttfk_unknown_only=True, hold_known_needs=False)


def test_open_warm_ups_beside_memory_no_need_holds_count_the_needs_not_shown_yet():
    """Beside a task of unknown need, whose memory only telemetry shows, the needs of tasks placed since the last
    reading are not in the free memory shown: they are taken from it, or a third 8 GiB task would be placed into
    memory that is not there."""
    b = bench(1, ttfk_unknown_only=True)  # 40 GiB
    unknown = b.submit("unknown")
    b.decide()
    b.first_kernel(unknown.id)
    b.set(0, used_mib=20000)
    b.advance(31)  # its window has passed: the GPU is open, 20960 MiB shown free
    first, second, third = (b.submit(name, mem_mib=8000) for name in "abc")
    assert b.placed() == {first.id: (0,), second.id: (0,)}  # 20960 - 2 x 8000 - 512 < 8000 + 2048 for the third
    assert isinstance(b.sched.blocked(third.id), MemoryShort)


def test_with_warmup_risk_tasks_still_warming_up_count_in_the_risk_filter():
    """Open warm-ups let tasks join a GPU before any shows its activity; told what each will add once it
    computes, the filter closes the GPU that a GPU-bound task in its warm-up will saturate, until half a window
    after its first kernel, when the window's own scores take over; a light task leaves it open."""
    profiles = {"bound": Activity(1.0, 0.5, 0.7), "light": Activity(0.2, 0.1, 0.1)}

    def activity(task):
        return profiles.get(task.spec.name)

    b = bench(1, activity=activity, ttfk_unknown_only=True, warmup_risk=True, window_samples=10)
    bound = b.submit("bound", mem_mib=8000)
    assert b.placed() == {bound.id: (0,)}
    later = b.submit("later", mem_mib=8000)
    assert b.placed() == {}
    assert isinstance(b.sched.blocked(later.id), RiskFiltered)
    b.first_kernel(bound.id)
    b.advance(4)
    assert b.placed() == {}  # 4 s of a 10 s window after its first kernel: still added
    b.advance(1)
    assert b.placed() == {later.id: (0,)}  # the window shows an idle GPU here (the bench's loads stay 0)

    light = bench(1, activity=activity, ttfk_unknown_only=True, warmup_risk=True)
    first = light.submit("light", mem_mib=8000)
    light.decide()
    second = light.submit("light", mem_mib=8000)
    assert light.placed() == {second.id: (0,)} and first.id != second.id


def test_without_the_switch_or_a_profile_warming_tasks_add_nothing():
    def activity(task):
        return Activity(1.0, 0.5, 0.7) if task.spec.name == "bound" else None

    for switched, name in ((False, "bound"), (True, "unprofiled")):
        b = bench(1, activity=activity, ttfk_unknown_only=True, warmup_risk=switched)
        b.submit(name, mem_mib=8000)
        b.decide()
        later = b.submit("later", mem_mib=8000)
        assert b.placed() == {later.id: (0,)}


# ----------------------------------------------------------------- backfilling


DURATIONS = {"short": 50.0, "long": 1000.0, "mid": 100.0, "huge": 5000.0}


def by_name(task):
    return DURATIONS.get(task.spec.name)


def busy_with_a_waiting_pair(**config: object) -> Bench:
    """Two GPUs each running a task alone (ends at 100 and 1000 s), and a two-GPU task at the head."""
    b = bench(2, durations=by_name, policy="exclusive", **config)
    b.submit("mid")
    b.submit("long")
    assert len(b.placed()) == 2
    b.submit("pair", gpus=2)
    return b


def test_backfill_starts_a_later_task_that_ends_before_the_heads_reservation():
    b = busy_with_a_waiting_pair(backfill=True)
    short, huge = b.submit("short"), b.submit("huge")
    b.advance(100)
    b.exit(1)
    assert b.placed() == {short.id: (0,)}  # 100 + 50 s <= 1000 s, when the pair can start
    assert isinstance(b.sched.blocked(huge.id), WholeIdle)  # 5000 s would delay the pair
    discipline = b.sched.discipline
    assert isinstance(discipline, EasyBackfill)
    assert discipline.reservation is not None and discipline.reservation.shadow_s == 1000.0


def test_without_backfill_the_queue_stays_fifo():
    b = busy_with_a_waiting_pair()
    b.submit("short")
    b.advance(100)
    b.exit(1)
    assert b.placed() == {}


def test_a_task_of_unknown_duration_is_never_backfilled():
    b = busy_with_a_waiting_pair(backfill=True)
    b.submit("unknown")
    b.advance(100)
    b.exit(1)
    assert b.placed() == {}


def test_backfill_without_durations_is_strict_fifo():
    b = Bench(2, backfill=True, policy="exclusive")  # no duration port: the daemon without history
    assert not isinstance(b.sched.discipline, EasyBackfill)


BESIDE = {"bound": 1000.0, "quick": 100.0, "light": 5000.0, "heavy": 5000.0, "pair": 500.0}
BESIDE_ACTIVITY = {"bound": Activity(1.0, 0.5, 0.7), "quick": Activity(1.0, 0.5, 0.7), "heavy": Activity(1.0, 0.5, 0.7)}


def _waiting_pair_beside(known: bool) -> tuple[Bench, int]:
    """GPU 0 busy with a GPU-bound task until 1000 s, GPU 1 idle since 100 s: a two-GPU head waits for GPU 0 and
    holds GPU 1; a light task of 5000 s and a GPU-bound one wait behind it. `known`: the tasks' activity."""
    b = bench(
        2,
        durations=lambda task: BESIDE.get(task.spec.name),
        activity=(lambda task: BESIDE_ACTIVITY.get(task.spec.name, Activity(0.1, 0.05, 0.05))) if known else None,
        backfill=True,
        ttfk_unknown_only=True,
    )
    b.submit("bound", mem_mib=8000)
    b.submit("quick", mem_mib=8000)
    assert len(b.placed()) == 2
    for gpu in (0, 1):
        b.set(gpu, smact=1.0, smocc=0.5, drama=0.7, used_mib=8000)
    b.advance(40)
    b.submit("pair", gpus=2, mem_mib=20000)
    light = b.submit("light", mem_mib=1000)
    b.submit("heavy", mem_mib=1000)
    b.advance(60)
    b.exit(2)
    b.set(1, smact=0.0, smocc=0.0, drama=0.0, used_mib=0)
    b.advance(1)
    return b, light.id


def test_a_task_the_head_still_fits_beside_is_backfilled_onto_its_reserved_gpu():
    """A long light task leaves the waiting head room on the GPU held for it: it starts there, and the head
    joins it when its other GPU frees; a GPU-bound one does not (the head could not join it), nor does any
    where the tasks' activity is not known (the reserved GPU then waits empty)."""
    b, light = _waiting_pair_beside(known=True)
    assert b.placed() == {light: (1,)}
    b.set(1, smact=0.1, smocc=0.05, drama=0.05, used_mib=1000)
    b.advance(900)
    b.exit(1)
    b.set(0, smact=0.0, smocc=0.0, drama=0.0, used_mib=0)
    b.advance(31)  # GPU 0's window clears
    assert b.placed()[3] == (0, 1)  # the pair, beside the light task on GPU 1

    unknown, _ = _waiting_pair_beside(known=False)
    assert unknown.placed() == {}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2000), st.integers(1, 3), st.integers(1, 3000), st.booleans()),
        min_size=1,
        max_size=25,
    )
)
def test_backfill_never_delays_the_heads_reserved_start(jobs):
    """On whole GPUs with exact durations, every task starts no later than its first reservation's shadow time."""
    gpus = 3
    b = bench(gpus, durations=lambda task: float(task.spec.name.split(":")[1]), policy="exclusive", backfill=True)
    submissions = sorted((at, i) for i, (at, *_rest) in enumerate(jobs))
    events: list[tuple[float, int, int]] = [(float(at), 1, i) for at, i in submissions]  # (time, kind, ref)
    heapq.heapify(events)
    started: dict[int, float] = {}
    promised: dict[int, float] = {}
    while events:
        now = events[0][0]
        b.t = now
        while events and events[0][0] == now:
            _, kind, ref = heapq.heappop(events)
            if kind == 0:  # an exit: its GPUs free at once
                b.sched.record_exit(ref, ProcessExit(0), now)
            else:
                _, n, duration, _unused = jobs[ref]
                b.sched.submit(TaskSpec(f"j{ref}:{duration}", min(n, gpus)), now)
        for launch in b.sched.decide(now):
            started[launch.task_id] = now
            duration = float(b.sched.task(launch.task_id).spec.name.split(":")[1])
            heapq.heappush(events, (now + duration, 0, launch.task_id))
        reservation = b.sched.discipline.reservation
        if reservation is not None:
            promised.setdefault(reservation.task, reservation.shadow_s)
    assert len(started) == len(jobs)
    for task, shadow in promised.items():
        assert started[task] <= shadow


# ----------------------------------------------------------------- interference-aware pairing


def test_pair_prefers_the_gpu_its_model_predicts_the_least_slowdown_on():
    cost = {"light": 1.1, "heavy": 1.9}

    def pairing(task, others):
        return max((cost[o.spec.name] for o in others), default=1.0)

    b = _pair_beside("heavy", "light", pairing=pairing)
    task = b.submit("new", mem_mib=1000)
    # GPU 0 (heavy) has the most free memory, MAGM's choice; the model prefers the light co-runner's
    assert b.placed() == {task.id: (1,)}


def test_pair_ranks_a_gpu_it_cannot_tell_the_cost_of_after_those_it_can():
    """A co-runner whose load the model does not know (a command never run alone): its GPU comes after one whose
    cost is known, though it has the more free memory."""

    def pairing(task, others):
        return None if any(o.spec.name == "unknown" for o in others) else 1.5

    b = _pair_beside("unknown", "known", pairing=pairing)
    task = b.submit("new", mem_mib=1000)
    assert b.placed() == {task.id: (1,)}


def test_pair_without_a_model_orders_as_magm():
    b = _pair_beside("a", "b")
    task = b.submit("new", mem_mib=1000)
    assert b.placed() == {task.id: (0,)}


def _pair_beside(first: str, second: str, **options: object) -> Bench:
    """Two GPUs under the pair policy, `first` (1 GiB) on GPU 0 and `second` (20 GiB) on GPU 1, both past their
    TTFK windows: GPU 0 has the more free memory."""
    b = bench(2, policy="pair", prefer_idle=False, risk=_no_risk(), **options)
    b.submit(first, mem_mib=1000)
    b.submit(second, mem_mib=20000)
    b.placed()
    b.advance(60)
    b.first_kernel(1)
    b.first_kernel(2)
    b.advance(31)
    return b


def _no_risk() -> RiskConfig:
    return RiskConfig(enabled=False)


def _head_behind(policy: str, known_light: bool, seen: float = 0.1, **config: object) -> tuple[Bench, int, int]:
    """GPU 0 runs A (1,000 s, seen at SMACT `seen`), GPU 1 is idle; a two-GPU head H waits for GPU 0, and B
    (light, 20,000 s) waits behind it. `known_light`: the tasks' activity is known, and light."""
    durations = {"A": 1000.0, "B": 20000.0, "H": 100.0}
    light = Activity(0.1, 0.05, 0.05)
    b = bench(
        2,
        durations=lambda task: durations.get(task.spec.name),
        activity=(lambda task: light) if known_light else None,
        policy=policy,
        backfill=True,
        **config,
    )
    a = b.submit("A", mem_mib=8000)
    assert b.placed() == {a.id: (0,)}
    b.set(0, used_mib=8000, smact=seen, smocc=seen / 2, drama=seen / 2)
    b.first_kernel(a.id)
    b.advance(5)
    head, behind = b.submit("H", gpus=2, mem_mib=8000), b.submit("B", mem_mib=8000)
    return b, head.id, behind.id


@pytest.mark.parametrize(
    ("policy", "config"),
    [("exclusive", {"ttfk_unknown_only": True}), ("magm", {})],
    ids=["a policy that does not share", "CARMA's TTFK rule"],
)
def test_the_head_is_not_held_back_by_tasks_it_cannot_join(policy: str, config: dict) -> None:
    """Where the head cannot join a GPU's tasks (Exclusive, or each task placed closing its GPU for a window),
    a long task is not backfilled onto the GPU reserved for it: the head took GPU 1 only at B's end."""
    b, head, behind = _head_behind(policy, known_light=True, **config)
    assert b.placed() == {}  # B would run past the head's shadow time on the reserved GPU 1
    b.advance(1000)
    b.exit(1)
    b.set(0, used_mib=0, smact=0.0, smocc=0.0, drama=0.0)
    b.advance(40)
    assert b.placed()[head] == (0, 1) and b.sched.task(behind).current is None


def test_nothing_joins_the_gpus_of_a_head_refused_beside_tasks_it_was_expected_to_fit_beside() -> None:
    """A expected light but seen saturating GPU 0: the head, expected to fit beside it now, is refused there
    (the risk filter); its reserved GPUs then take no task beside it (B, of 20,000 s, would have taken the
    idle GPU 1, and the next such task GPU 0, holding the head back for good), and it starts once A ends."""
    b, head, _ = _head_behind("magm", known_light=True, seen=1.0, ttfk_unknown_only=True)
    assert b.placed() == {}
    reservation = b.sched.discipline.reservation
    assert reservation is not None and reservation.gpus == {"0", "1"}
    b.advance(995)
    b.exit(1)
    b.set(0, used_mib=0, smact=0.0, smocc=0.0, drama=0.0)
    b.advance(40)
    assert b.placed()[head] == (0, 1)
