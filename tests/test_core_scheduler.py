"""The scheduler's decisions: policies with preconditions, TTFK, FIFO, recovery, need resolution, cancel."""

import pytest

from carma.core import (
    POLICY_NAMES,
    ExitKind,
    GpuSample,
    Kill,
    NeedKind,
    RiskConfig,
    Scheduler,
    SpecError,
    Target,
    TargetKind,
    TaskSpec,
    TaskState,
)
from carma.core.memory import estimated
from carma.core.types import MemoryNeed
from carma.reasons import HEAD_OF_LINE, RECOVERY_FIRST, UNDECIDED, waiting_reason
from support import OOM_LOG, TOTAL_MIB, Bench


def busy(bench, gpus, used_mib=20_000, smact=0.3, smocc=0.2, drama=0.2, wait=30):
    """Occupy GPUs with foreign-free load as a running carma task would, and let the window fill."""
    for g in gpus:
        task = bench.submit(f"filler{g}")
        launches = bench.decide()
        assert launches and launches[0].task_id == task.id
        bench.set(launches[0].gpus[0], used_mib=used_mib, smact=smact, smocc=smocc, drama=drama)
        bench.first_kernel(task.id)
    bench.advance(wait)


# ------------------------------------------------------------------ policies


def test_exclusive_uses_only_idle_gpus():
    b = Bench(gpus=2, policy="exclusive")
    a, c = b.submit("a"), b.submit("c")
    assert b.placed() == {a.id: (0,), c.id: (1,)}
    third = b.submit("third")
    b.first_kernel(a.id)
    b.advance(60)
    assert b.placed() == {}  # plenty of memory, but no idle GPU
    assert "idle" in waiting_reason(b.sched, third.id)
    b.exit(a.id)
    assert b.placed() == {third.id: (0,)}


def test_magm_picks_the_gpu_with_most_free_memory():
    b = Bench(prefer_idle=False)
    busy(b, [0, 1, 2])
    b.set(0, used_mib=30_000)
    b.set(1, used_mib=10_000)
    b.set(2, used_mib=20_000)
    b.advance(1)
    task = b.submit()
    assert b.placed() == {task.id: (1,)}


def test_magm_breaks_ties_by_gpu_index():
    b = Bench(prefer_idle=False)
    busy(b, [0, 1, 2], used_mib=10_000)
    task = b.submit()
    assert b.placed() == {task.id: (0,)}


def test_lug_picks_the_gpu_with_the_lowest_smact_risk():
    b = Bench(policy="lug", prefer_idle=False)
    busy(b, [0, 1, 2])
    for gpu, smact in ((0, 0.5), (1, 0.7), (2, 0.1)):
        b.set(gpu, smact=smact)
    b.advance(30)
    task = b.submit()
    assert b.placed() == {task.id: (2,)}


def test_best_fit_packs_the_tightest_gpu_that_still_fits_and_first_fit_the_first():
    for policy, expected in (("bf", 1), ("ff", 0)):
        b = Bench(policy=policy, prefer_idle=False)
        busy(b, [0, 1, 2])
        for gpu, used in ((0, 10_000), (1, 30_000), (2, 34_000)):
            b.set(gpu, used_mib=used)
        b.advance(1)
        task = b.submit(mem_mib=5_000)  # needs 5000 + 2048 margin; GPU 2 has 6448 - 512 free
        assert b.placed() == {task.id: (expected,)}, policy


def test_round_robin_cycles_without_preconditions():
    b = Bench(policy="rr", prefer_idle=False)
    busy(b, [0, 1, 2], used_mib=TOTAL_MIB, smact=1.0, smocc=1.0, drama=1.0)  # full and risky
    placed = []
    for _ in range(4):
        task = b.submit(mem_mib=30_000)
        (launch,) = b.decide()
        placed.append(int(launch.gpus[0]))
        b.first_kernel(task.id)
        b.advance(30)
    assert placed == [0, 1, 2, 0]


def test_idle_gpus_are_preferred_as_in_carmas_reference_code():
    b = Bench(policy="bf")
    busy(b, [0], used_mib=10_000)
    task = b.submit(mem_mib=1_000)
    assert b.placed() == {task.id: (1,)}  # BF would pack GPU 0, but an idle GPU comes first


# ------------------------------------------------------------------ preconditions and risk


@pytest.mark.parametrize(
    ("mem_mib", "placed"), [(40_960 - 20_000 - 512 - 2048, True), (40_960 - 20_000 - 512 - 2047, False)]
)
def test_known_need_requires_need_plus_margin_free_after_the_reserve(mem_mib, placed):
    b = Bench(gpus=1)
    busy(b, [0], used_mib=20_000)
    task = b.submit(mem_mib=mem_mib)
    assert (task.id in b.placed()) is placed


@pytest.mark.parametrize("hold", [True, False])
def test_a_known_need_is_held_before_the_task_has_allocated_it(hold):
    """A task whose memory grows after its TTFK window (a data loader starting) was collocated into its OOM:
    the free memory then read left out what it had yet to allocate."""
    b = Bench(gpus=1, hold_known_needs=hold)
    first = b.submit("grows-late", mem_mib=30_000)
    b.placed()
    b.set(0, used_mib=2_000)  # its CUDA context and weights; its activations come later
    b.first_kernel(first.id)
    b.advance(60)
    second = b.submit("second", mem_mib=10_000)  # 10000 + 2048 margin: 38448 shown free, 10448 not held
    assert (second.id in b.placed()) is not hold
    if hold:
        assert waiting_reason(b.sched, second.id) == (
            "needs 1 GPU with 12560 MiB free (need 10000 + margin 2048 + reserve 512); 0 have it (1 more shows it "
            "free, but their tasks' known needs or predicted growth hold it)"
        )
        b.sched.cancel(second.id, b.t)
        b.set(0, used_mib=31_000)  # it allocated its need and more: what shows used counts, not twice
        b.advance(1)
        third = b.submit("third", mem_mib=40_960 - 31_000 - 512 - 2048)
        assert third.id in b.placed()


def test_a_need_too_large_for_the_margin_is_held_on_the_whole_gpu_it_was_given():
    """It is placed on a whole GPU, but its need in MiB was not held (not a "known" need): once its window
    passed a small task joined it, and it crashed as it grew (a random trace of the property tests)."""
    b = Bench(gpus=1)
    big = b.submit("big", mem_mib=40_000)  # 40000 + 2048 margin exceeds the 40960 - 512 a GPU offers
    assert b.placed() == {big.id: (0,)}
    b.set(0, used_mib=1_000)
    b.first_kernel(big.id)
    b.advance(60)
    small = b.submit("small", mem_mib=100)
    assert b.placed() == {}
    assert "known needs or predicted growth hold it" in waiting_reason(b.sched, small.id)


@pytest.mark.parametrize(("used_mib", "placed"), [(40_960 - 512 - 2048, True), (40_960 - 512 - 2047, False)])
def test_unknown_need_requires_the_minimum_free_memory(used_mib, placed):
    b = Bench(gpus=1)
    busy(b, [0], used_mib=used_mib)
    task = b.submit()
    assert (task.id in b.placed()) is placed
    if not placed:
        assert "2560 MiB free (min_free_mib 2048 + reserve 512)" in waiting_reason(b.sched, task.id)


def test_risk_filter_excludes_saturated_gpus_and_can_be_switched_off():
    for enabled in (True, False):
        b = Bench(gpus=1, risk=RiskConfig(enabled=enabled))
        busy(b, [0], used_mib=5_000, smact=0.9, smocc=0.5, drama=0.1)
        task = b.submit()
        assert (task.id in b.placed()) is not enabled
        if enabled:  # the GPU and the scores over their thresholds, as `carma gpus` shows them
            assert waiting_reason(b.sched, task.id) == (
                "needs 1 GPU; only 0 with enough memory pass the risk filter (GPU 0: SMACT 0.90 >= 0.80, "
                "SMOCC 0.50 >= 0.45)"
            )


def test_a_task_waiting_for_the_risk_filter_is_told_which_gpus_fail_it():
    b = Bench(gpus=4)
    busy(b, [0, 1, 2, 3], used_mib=5_000, smact=0.9, smocc=0.2, drama=0.5)
    task = b.submit(gpus=3)
    b.decide()
    assert waiting_reason(b.sched, task.id) == (
        "needs 3 GPUs; only 0 with enough memory pass the risk filter (GPUs 0, 1, 2, 3: `carma gpus` shows their risk)"
    )
    b.set(2, smact=0.3)
    b.set(3, smact=0.3)
    b.advance(60)  # the window forgets the saturated samples
    b.decide()
    assert waiting_reason(b.sched, task.id).endswith(
        "only 2 with enough memory pass the risk filter (GPU 0: SMACT 0.90 >= 0.80, DRAMA 0.50 >= 0.40; "
        "GPU 1: SMACT 0.90 >= 0.80, DRAMA 0.50 >= 0.40)"
    )


def test_risk_reflects_the_whole_window_not_only_the_latest_sample():
    b = Bench(gpus=1)
    busy(b, [0], smact=0.95, smocc=0.6)
    b.set(0, smact=0.1, smocc=0.1)  # the co-runner just went quiet
    b.advance(2)
    task = b.submit()
    assert b.placed() == {}
    b.advance(28)
    assert b.placed() == {task.id: (0,)}


def test_gpus_without_telemetry_are_never_used():
    sched = Scheduler([Target("GPU-0", "GPU-40GB", TOTAL_MIB)])  # no reading yet
    sched.submit(TaskSpec("task"), 0.0)
    assert sched.decide(0.0) == []


def test_foreign_processes_make_a_gpu_busy():
    b = Bench(gpus=1, policy="exclusive")
    b.sched.record_gpu_processes("0", [], foreign=1, now=b.t)
    b.submit()
    assert b.placed() == {}
    b.sched.record_gpu_processes("0", [], foreign=0, now=b.t)
    assert len(b.placed()) == 1


# ------------------------------------------------------------------ TTFK


def test_gpu_awaiting_a_first_kernel_takes_no_further_tasks():
    b = Bench(gpus=2, prefer_idle=False)
    first, second, third = b.submit(), b.submit(), b.submit()
    assert b.placed() == {first.id: (0,), second.id: (1,)}  # the other GPU stays schedulable
    b.advance(100)
    assert b.placed() == {}
    assert "TTFK" in waiting_reason(b.sched, third.id)
    b.first_kernel(first.id)
    assert b.sched.task(first.id).state is TaskState.RUNNING
    assert b.sched.task(first.id).current.first_kernel_s == b.t
    b.advance(29)
    assert b.placed() == {}
    assert b.sched.next_timer(b.t) == b.t + 1
    b.advance(1)
    assert b.placed() == {third.id: (0,)}


def test_a_task_waiting_for_memory_is_told_of_a_gpu_with_it_that_awaits_a_first_kernel():
    """A CPU-only task (`sleep`) holds its GPU in its TTFK window for its whole run: a task waiting for memory
    read "0 have it" while that GPU stood empty, the TTFK left unsaid."""
    b = Bench(gpus=2, prefer_idle=False)
    cpu_only = b.submit("sleep")
    assert b.placed() == {cpu_only.id: (0,)}
    busy(b, [1], used_mib=30_000)
    waiting = b.submit(mem_mib=15_360)
    b.advance(100)
    assert b.placed() == {}
    assert waiting_reason(b.sched, waiting.id) == (
        "needs 1 GPU with 17920 MiB free (need 15360 + margin 2048 + reserve 512); 0 have it (1 more has it free, "
        "but awaits its task's first kernel (TTFK))"
    )


def test_a_task_that_dies_before_its_first_kernel_frees_its_gpu_at_once():
    b = Bench(gpus=1, prefer_idle=False)
    first, second = b.submit(), b.submit()
    b.decide()
    b.exit(first.id, code=1, log="ImportError: no module named torchvision")
    assert b.placed() == {second.id: (0,)}


# ------------------------------------------------------------------ queues


def test_the_head_of_the_queue_before_any_decision_is_not_said_to_wait_behind_itself():
    """Before the GPUs' first sample (or the next decision) the only task read "behind the head of the
    queue (FIFO)"."""
    b = Bench(gpus=1)
    first, second = b.submit(), b.submit()
    assert [waiting_reason(b.sched, t.id) for t in (first, second)] == [UNDECIDED, HEAD_OF_LINE]


def test_fifo_head_of_line_blocks_later_tasks():
    b = Bench(gpus=1)
    busy(b, [0], used_mib=20_000)
    big, small = b.submit(mem_mib=30_000), b.submit(mem_mib=1_000)
    assert b.placed() == {}
    assert waiting_reason(b.sched, small.id) == HEAD_OF_LINE
    assert b.sched.queue == [big.id, small.id]


def test_multi_gpu_task_needs_all_its_gpus_at_once():
    b = Bench(gpus=3, prefer_idle=False)
    busy(b, [0, 1, 2], used_mib=10_000)
    b.set(1, used_mib=39_000)
    b.set(2, used_mib=39_000)
    b.advance(1)
    task = b.submit(gpus=2)
    assert b.placed() == {}
    b.set(2, used_mib=12_000)
    b.advance(1)
    assert b.placed() == {task.id: (0, 2)}


def test_submitting_more_gpus_than_the_server_has_is_refused():
    b = Bench(gpus=2)
    with pytest.raises(SpecError, match="needs 3 GPUs but this server has 2"):
        b.submit(gpus=3)
    assert b.sched.queue == []


@pytest.mark.parametrize(("gpus", "mem"), [(0, None), (-1, None), (1, 0), (1, -5)])
def test_invalid_specs_are_refused(gpus, mem):
    with pytest.raises(ValueError):
        TaskSpec("bad", gpus, mem)


# ------------------------------------------------------------------ exits and recovery


def collocated_oom(b):
    """A task placed next to a running one crashes out of memory; returns (running, crashed)."""
    busy(b, [0], used_mib=30_000)
    victim = b.submit("victim")
    assert b.placed() == {victim.id: (0,)}
    assert b.sched.task(victim.id).current.shared
    assert b.oom(victim.id) is ExitKind.OOM
    return next(t for t in b.sched.tasks if t.spec.name == "filler0"), b.sched.task(victim.id)


def test_oom_crashed_task_is_recovered_on_a_whole_idle_gpu():
    b = Bench(gpus=1)
    running, victim = collocated_oom(b)
    assert victim.state is TaskState.OOM_CRASHED
    assert "CUDA out of memory" in victim.current.message
    waiting = b.submit("next")
    assert b.placed() == {}  # GPU 0 is busy: recovery waits, and the main queue waits behind it
    assert victim.state is TaskState.RECOVERING
    assert b.sched.recovery_queue == [victim.id]
    assert waiting_reason(b.sched, waiting.id) == RECOVERY_FIRST
    b.exit(running.id)
    launches = b.decide()
    assert [(launch.task_id, launch.recovery, launch.exclusive) for launch in launches] == [(victim.id, True, True)]
    assert victim.current.need.kind is NeedKind.WHOLE_GPU
    b.first_kernel(victim.id)
    b.exit(victim.id)
    assert victim.state is TaskState.COMPLETED
    assert [a.outcome for a in victim.attempts] == [ExitKind.OOM, ExitKind.SUCCESS]


@pytest.mark.parametrize("exclusive", [True, False])
def test_a_relaunch_keeps_its_gpu_to_itself_while_it_runs_if_configured(exclusive):
    """A task joined on the GPU of its relaunch can make it run out of memory again, using up its relaunches;
    `exclusive_relaunch` keeps the relaunch alone (by default others join once its TTFK window is over)."""
    b = Bench(gpus=2, exclusive_relaunch=exclusive)
    busy(b, [0, 1])
    victim = b.submit("victim")
    assert b.placed() == {victim.id: (0,)}
    b.oom(victim.id)
    b.exit(next(t.id for t in b.sched.tasks if t.spec.name == "filler1"))
    assert b.placed() == {victim.id: (1,)}
    b.first_kernel(victim.id)
    b.set(1, used_mib=5_000)
    b.advance(60)  # its TTFK window is long over, and its GPU has the most free memory
    newcomer = b.submit("newcomer")
    assert b.placed() == {newcomer.id: (0,) if exclusive else (1,)}  # beside the filler, or the relaunch (MAGM)
    if not exclusive:
        return
    b.exit(victim.id)
    b.advance(1)
    assert b.sched.task(victim.id).state is TaskState.COMPLETED
    later = b.submit("later")
    assert b.placed() == {later.id: (1,)}  # shareable again once it ended


def test_relaunches_are_bounded():
    b = Bench(gpus=1, max_relaunches=0)
    _, victim = collocated_oom(b)
    b.decide()
    assert victim.state is TaskState.FAILED
    assert victim.reason.startswith("out of memory, and OOM relaunches are off (max_relaunches = 0)")
    assert "CUDA out of memory" in victim.reason  # was "out of memory again after 0 relaunch(es)"


def test_oom_while_alone_fails_at_once():
    b = Bench(gpus=1)
    task = b.submit()
    b.decide()
    b.first_kernel(task.id)
    b.oom(task.id)
    b.decide()
    assert task.state is TaskState.FAILED
    assert "alone on GPU 0" in task.reason
    assert b.sched.recovery_queue == []


def test_a_task_joined_by_another_is_saved_as_shared():
    """The flag was set on the co-runner but the co-runner was not among the changes: after a restart its run
    read as alone, and its history (warmup_risk's activity, pair's load) took its neighbour's activity for its
    own."""
    b = Bench(gpus=1, prefer_idle=False)
    first = b.submit(mem_mib=1000)
    b.placed()
    b.first_kernel(first.id)
    b.advance(31)
    b.sched.take_changes()
    second = b.submit(mem_mib=1000)
    assert b.placed() == {second.id: (0,)}
    assert first.current.shared and first in b.sched.take_changes()


def test_a_process_of_someone_else_arriving_later_makes_the_task_no_longer_alone():
    """Sharing was judged at launch only: an OOM caused by a process started beside it afterwards failed
    the task for good, "out of memory alone", with another GPU idle."""
    b = Bench(gpus=2)
    task = b.submit()
    assert b.placed() == {task.id: (0,)}
    b.first_kernel(task.id)
    b.sched.record_gpu_processes("0", {task.id}, 1, b.t)
    assert task.current.shared and b.sched.take_changes()[-1] is task  # persisted: a restart keeps it
    b.oom(task.id)
    assert b.placed() == {task.id: (1,)} and task.state is TaskState.DISPATCHED


def test_a_task_needing_a_whole_gpu_takes_idle_ones_in_the_policys_order():
    """A task of unknown size (no usable estimate) took the lowest index, the 16 GiB GPU, not MAGM's 80."""
    for policy, expected in (("magm", 1), ("bf", 0), ("exclusive", 0)):
        b = Bench(totals=(16_384, 81_920), policy=policy, estimator=FixedEstimator(None))
        task = b.submit("opaque")
        assert b.placed() == {task.id: (expected,)}, policy
        assert task.current.need.kind is NeedKind.WHOLE_GPU


def test_a_relaunch_goes_only_to_a_gpu_that_holds_the_need_it_was_placed_with():
    """The relaunch took the lowest idle GPU, 16 GiB for a need of 24000 MiB: it ran out again there."""
    b = Bench(totals=(16_384, 40_960), max_relaunches=1)
    filler = b.submit("filler")
    b.placed()
    b.set(1, used_mib=4_000, smact=0.3, smocc=0.2, drama=0.2)
    b.first_kernel(filler.id)
    b.advance(30)
    big = b.submit("big", mem_mib=24_000)
    assert b.placed() == {big.id: (1,)}
    b.oom(big.id)
    assert b.placed() == {}
    assert waiting_reason(b.sched, big.id) == (
        "recovery: waiting for 1 whole idle GPU that can hold 26048 MiB (its need when first placed, with the margin)"
    )
    b.exit(filler.id)
    assert b.placed() == {big.id: (1,)}


def test_a_multi_gpu_task_that_outgrew_every_whole_gpu_fails_instead_of_holding_the_recovery_queue():
    """MIG instances were counted as larger GPUs it could relaunch on: it waited forever, and every other
    task behind it."""
    b = Bench(totals=(16_384, 16_384, 40_960, 40_960), mig=(2, 3))
    pair = b.submit("pair", gpus=2)
    assert b.placed() == {pair.id: (0, 1)}
    b.first_kernel(pair.id)
    b.oom(pair.id)
    small = b.submit("small")
    assert small.id in b.placed()
    assert pair.state is TaskState.FAILED and "alone on GPU 0,1" in pair.reason


def test_a_mig_instance_without_metrics_is_not_shown_as_excluded_by_the_risk_filter():
    """NVML reads no SMACT/SMOCC/DRAMA per instance; an instance is never collocated, so never filtered: the
    dashboard and `carma gpus` marked every one "risk filter: excluded"."""
    b = Bench(totals=(40_960, 20_480), mig=(1,))
    for gpu in (0, 1):
        b.set(gpu, smact=None, smocc=None, drama=None)
    b.advance(30)
    assert [status.excluded for status in b.sched.gpu_status(b.t)] == [True, False]  # "missing": risky


def test_other_errors_fail_with_their_reason_and_success_completes():
    b = Bench(gpus=2)
    bad, good = b.submit("bad"), b.submit("good")
    b.decide()
    assert b.exit(bad.id, 2, "Traceback...\nValueError: bad learning rate\n") is ExitKind.ERROR
    assert bad.state is TaskState.FAILED
    assert bad.reason == "exit code 2: ValueError: bad learning rate"
    assert b.exit(good.id) is ExitKind.SUCCESS
    assert good.state is TaskState.COMPLETED
    assert good.ended_s == b.t
    assert b.exit(good.id) is None  # a second report of the same exit changes nothing


def test_a_failure_reason_is_one_line_of_bounded_length():
    """200 kB written without a new line made an 8 kB reason: 42 rows of `carma history` for one task."""
    b = Bench(gpus=1)
    task = b.submit()
    b.decide()
    b.exit(task.id, 3, "E" * 200_000)
    assert task.reason == "exit code 3: " + "E" * 299 + "…"


def test_a_task_that_never_started_fails_with_why_not_an_exit_code():
    b = Bench(gpus=1)
    task = b.submit()
    b.decide()
    why = "carma: could not start task 1 in '/gone': [Errno 2] No such file or directory: '/gone'"
    b.exit(task.id, None, why)  # type: ignore[arg-type]
    assert (task.state, task.reason) == (TaskState.FAILED, why)


def test_cancel_a_queued_task_and_a_running_one():
    b = Bench(gpus=1)
    running, queued = b.submit(), b.submit()
    b.decide()
    assert b.sched.cancel(queued.id, b.t) == []
    assert queued.state is TaskState.CANCELLED and b.sched.queue == []
    assert b.sched.cancel(running.id, b.t) == [Kill(running.id, 1)]  # the world must kill its process
    assert running.state is TaskState.DISPATCHED
    b.exit(running.id, code=-9, log=OOM_LOG)  # whatever the log says, it was cancelled
    assert running.state is TaskState.CANCELLED
    assert b.sched.cancel(running.id, b.t) == []


def test_cancel_a_task_waiting_for_recovery():
    b = Bench(gpus=1)
    _, victim = collocated_oom(b)
    b.decide()
    b.sched.cancel(victim.id, b.t)
    assert victim.state is TaskState.CANCELLED and b.sched.recovery_queue == []


def test_unknown_task_id_is_a_clear_error():
    with pytest.raises(KeyError, match="no task with id 42"):
        Bench().sched.task(42)


# ------------------------------------------------------------------ memory needs


class FixedEstimator:
    name = "fixed"

    def __init__(self, value, partial=False):
        self.value = value
        self.partial = partial

    def need(self, task):
        return estimated(self.name, self.value, self.partial)


class SlowEstimator:
    """Answers once told to: not yet, then a value or a failure (recovery only)."""

    name = "slow"

    def __init__(self):
        self.answers = {}

    def need(self, task):
        return self.answers.get(task.id)


def test_estimator_value_is_used_with_the_margin():
    b = Bench(gpus=1, estimator=FixedEstimator(18_500))
    busy(b, [0], used_mib=20_000)  # 20448 MiB free after the reserve
    task = b.submit()
    assert b.placed() == {}
    assert "21060 MiB free (need 18500 + margin 2048 + reserve 512)" in waiting_reason(b.sched, task.id)
    b.set(0, used_mib=19_900)
    b.advance(1)
    assert b.placed() == {task.id: (0,)}
    assert task.current.need.source == "fixed"


@pytest.mark.parametrize("partial", [False, True])
def test_a_partial_estimate_holds_its_margin(partial):
    """xMem's estimate of a job on several GPUs leaves out their communication buffers, which the task's MPS
    limit (its need plus the margin) lets it allocate: a neighbour placed into that margin would crash."""
    b = Bench(gpus=2, estimator=FixedEstimator(20_000, partial))
    job = b.submit("data-parallel", gpus=2)
    assert b.placed() == {job.id: (0, 1)}
    for gpu in (0, 1):
        b.set(gpu, used_mib=2_000)  # its weights; the rest comes later
    b.first_kernel(job.id)
    b.advance(60)
    assert {gpu.held_mib for gpu in b.sched.gpu_status(b.t)} == {20_000 + 2048 * partial}
    beside = b.submit("beside", mem_mib=17_000)  # 17000 + 2048: 20448 MiB left beside the need, 18400 beside both
    assert (beside.id in b.placed()) is not partial


def test_user_value_beats_the_estimator():
    b = Bench(gpus=1, estimator=FixedEstimator(18_000))
    busy(b, [0], used_mib=20_000)
    task = b.submit(mem_mib=1_000)
    assert b.placed() == {task.id: (0,)}
    assert task.current.need.source == "user"


@pytest.mark.parametrize("estimator", [FixedEstimator(None), FixedEstimator(39_000)])
def test_no_usable_estimate_means_a_whole_gpu(estimator):
    b = Bench(gpus=2, estimator=estimator, prefer_idle=False)
    busy(b, [0], used_mib=1_000)
    task = b.submit()
    assert b.placed() == {task.id: (1,)}
    assert task.current.need.kind is NeedKind.WHOLE_GPU
    assert task.current.exclusive
    other = b.submit()
    assert b.placed() == {}
    assert "idle" in waiting_reason(b.sched, other.id)


def test_a_task_whose_estimate_is_not_ready_lets_the_tasks_behind_it_go():
    """It held the head of the queue: a user's captures, minutes each and one after another, held every user's
    tasks (the queue stays FIFO among the tasks ready to be placed)."""
    estimator = SlowEstimator()
    b = Bench(gpus=2, estimator=estimator)
    first, second = b.submit(), b.submit(mem_mib=1_000)
    assert b.placed() == {second.id: (0,)}
    assert waiting_reason(b.sched, first.id) == "waiting for its memory estimate"
    estimator.answers[first.id] = MemoryNeed(NeedKind.KNOWN, 4_000, "slow")
    b.advance(1)
    assert b.placed() == {first.id: (1,)}
    assert (first.current.need.kind, first.current.need.mib) == (NeedKind.KNOWN, 4_000)


def test_a_failed_estimate_means_recovery_only():
    estimator = SlowEstimator()
    b = Bench(gpus=1, estimator=estimator)
    task = b.submit()
    estimator.answers[task.id] = MemoryNeed(NeedKind.UNKNOWN, source="slow failed: no optimizer step")
    b.advance(1)
    assert b.placed() == {task.id: (0,)}
    assert task.current.need.kind is NeedKind.UNKNOWN and task.current.need.source.startswith("slow failed")


# ------------------------------------------------------------------ what a persisting world needs


def test_a_world_can_number_tasks_itself():
    b = Bench(gpus=1)
    task = b.sched.submit(TaskSpec("x"), b.t, task_id=41)
    assert task.id == 41 and b.submit().id == 42
    with pytest.raises(ValueError, match="already taken"):
        b.sched.submit(TaskSpec("y"), b.t, task_id=41)


def test_changes_are_handed_out_once_in_id_order():
    b = Bench(gpus=1)
    first, second = b.submit(), b.submit()
    assert [t.id for t in b.sched.take_changes()] == [first.id, second.id]
    assert b.sched.take_changes() == []
    b.decide()
    assert [t.id for t in b.sched.take_changes()] == [first.id]  # its placement
    b.first_kernel(first.id)
    assert [t.state for t in b.sched.take_changes()] == [TaskState.RUNNING]


def test_a_recovery_is_a_change_too():
    b = Bench(gpus=1)
    _, victim = collocated_oom(b)
    b.sched.take_changes()
    b.decide()  # the recovery scan
    assert b.sched.take_changes() == [victim] and victim.state is TaskState.RECOVERING


def test_restored_tasks_take_up_queues_and_gpus_as_they_were():
    b = Bench(gpus=2)
    running, waiting, crashed = b.submit("running"), b.submit("waiting"), b.submit("crashed")
    b.decide()  # running on GPU 0, waiting on GPU 1 (both idle)
    b.first_kernel(running.id)
    after = Bench(gpus=2)  # a new scheduler over the same state, as after a daemon restart
    waiting.state, waiting.attempts = TaskState.QUEUED, []
    crashed.state = TaskState.RECOVERING
    for task in (running, waiting, crashed):
        after.sched.restore(task, after.t)
    assert after.sched.queue == [waiting.id] and after.sched.recovery_queue == [crashed.id]
    assert after.sched.submit(TaskSpec("new"), after.t).id == crashed.id + 1
    status = {int(s.gpu.id): s for s in after.sched.gpu_status(after.t)}
    assert status[0].tasks == (running.id,) and not status[0].valid  # its TTFK window still runs
    after.t = running.current.first_kernel_s + 30
    assert after.sched.gpu_status(after.t)[0].valid


def test_a_waiting_task_a_server_restarted_with_fewer_gpus_cannot_run_fails_and_the_queue_moves_on():
    """Restored at the head of the queue, a 2-GPU task on 1 GPU stopped the scheduling loop (an IndexError),
    at every start: nothing could cancel it."""
    b = Bench(gpus=2)
    pair, crashed, single = b.submit("pair", gpus=2), b.submit("crashed", gpus=2), b.submit("single")
    crashed.state = TaskState.RECOVERING
    after = Bench(gpus=1)
    after.t = 500.0
    for task in (pair, crashed, single):
        after.sched.restore(task, after.t)
    assert (pair.state, pair.ended_s) == (TaskState.FAILED, 500.0)
    assert pair.reason == "task 'pair' needs 2 GPUs but this server has 1 since it restarted"
    assert crashed.state is TaskState.FAILED and after.sched.recovery_queue == []
    assert [t.id for t in after.sched.take_changes()] == [pair.id, crashed.id]  # for the world to persist
    assert after.sched.queue == [single.id]
    after.decide()
    assert single.current.gpus == ("0",)


def test_a_restored_multi_gpu_task_counts_as_seen_only_where_it_is_seen_again():
    """Its first kernel is kept per task: restored as seen on both GPUs, the one it never showed on was
    open to collocation at once."""
    b = Bench(gpus=2)
    pair = b.submit("pair", gpus=2)
    b.placed()
    b.sched.record_gpu_processes("0", {pair.id}, 0, b.t)  # seen on GPU 0 only
    b.advance(31)
    assert [s.valid for s in b.sched.gpu_status(b.t)] == [True, False]
    assert [s.awaiting_first_kernel for s in b.sched.gpu_status(b.t)] == [False, True]
    after = Bench(gpus=2)
    after.t = b.t
    after.sched.restore(pair, after.t)
    assert [s.valid for s in after.sched.gpu_status(after.t)] == [False, False]
    after.sched.record_gpu_processes("0", {pair.id}, 0, after.t)
    after.advance(30)
    assert [s.valid for s in after.sched.gpu_status(after.t)] == [True, False]


def test_gpu_status_shows_samples_risk_and_waiting_for_a_first_kernel():
    b = Bench(gpus=1)
    busy(b, [0], used_mib=10_000, smact=0.9, smocc=0.5, drama=0.1)
    task = b.submit()
    b.sched.record_gpu_processes("0", [], foreign=1, now=b.t)
    (status,) = b.sched.gpu_status(b.t)
    assert status.latest.used_mib == 10_000 and status.excluded and status.foreign == 1
    assert status.risk.smact == pytest.approx(0.9)
    assert task.id not in status.tasks and not status.awaiting_first_kernel


# ------------------------------------------------------------------ degraded telemetry and MIG instances


def test_a_gpu_without_profiling_metrics_is_kept_out_of_collocation_unless_configured_to_skip():
    for missing, placed in (("risky", False), ("skip", True)):
        b = Bench(gpus=1, risk=RiskConfig(missing=missing))
        busy(b, [0], used_mib=5_000, smact=None, smocc=None, drama=None)
        task = b.submit()
        assert (task.id in b.placed()) is placed, missing
        if not placed:
            assert waiting_reason(b.sched, task.id).endswith("the risk filter (GPU 0: no SMACT/SMOCC/DRAMA reading)")


def test_lug_ranks_gpus_of_unknown_smact_last():
    b = Bench(gpus=2, policy="lug", prefer_idle=False, risk=RiskConfig(missing="skip"))
    busy(b, [0, 1])
    b.set(0, smact=None)
    b.set(1, smact=0.7)
    b.advance(30)
    task = b.submit()
    assert b.placed() == {task.id: (1,)}


def test_mig_instances_take_one_task_each():
    b = Bench(totals=(20096,), mig=(0,))
    first, second = b.submit(), b.submit()
    assert b.placed() == {first.id: (0,)}
    b.first_kernel(first.id)
    b.advance(60)
    assert b.placed() == {}  # plenty of memory, but an instance is never shared
    assert "none another task may join (a MIG instance runs one task" in waiting_reason(b.sched, second.id)
    b.exit(first.id)
    assert b.placed() == {second.id: (0,)}


def test_a_multi_gpu_task_takes_whole_gpus_never_mig_instances():
    """CUDA enumerates one MIG instance per process: a 2-GPU task on two instances would see one device."""
    b = Bench(totals=(20_096, 20_096, TOTAL_MIB, TOTAL_MIB), mig=(0, 1))
    pair = b.submit("pair", gpus=2)
    assert b.placed() == {pair.id: (2, 3)}  # not the idle instances 0 and 1, which come first
    b.first_kernel(pair.id)
    b.exit(pair.id)
    b.sched.record_gpu_processes("2", (), 1, b.t)  # someone else's process: the next run shares GPU 2
    b.advance(30)
    again = b.submit("again", gpus=2)
    assert b.placed() == {again.id: (2, 3)}
    b.first_kernel(again.id)
    b.sched.record_gpu_processes("2", {again.id}, 1, b.t)  # the other process is still there
    assert b.oom(again.id) is ExitKind.OOM
    b.advance(1)
    assert b.placed() == {}  # recovery waits for two whole idle GPUs: the idle instances are none
    b.sched.record_gpu_processes("2", (), 0, b.t)
    b.advance(1)
    assert b.placed() == {again.id: (2, 3)}
    with pytest.raises(SpecError, match="needs 3 GPUs but this server has 2 whole one"):
        b.submit("three", gpus=3)
    assert Bench(totals=(20_096, 20_096), mig=(0, 1)).submit("one", gpus=1).state is TaskState.QUEUED


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_known_need_goes_whole_only_to_a_gpu_that_can_hold_it(policy):
    """On a server of unequal GPUs, an idle GPU too small for a known need is passed over: the task would
    only run out of memory alone there. While the large one is busy, an exclusive task waits for it."""
    b = Bench(totals=(32_768, 40_960), policy=policy)
    big = b.submit("big", mem_mib=36_000)
    assert b.placed() == {big.id: (1,)}
    if policy == "exclusive":
        b.first_kernel(big.id)
        again = b.submit("again", mem_mib=36_000)
        assert b.placed() == {}
        assert waiting_reason(b.sched, again.id) == "waiting for 1 whole idle GPU that can hold 38048 MiB"


def test_a_need_beyond_the_second_largest_gpu_takes_the_two_largest_for_a_two_gpu_task():
    b = Bench(totals=(81_920, 32_768, 40_960))
    task = b.submit("wide", gpus=2, mem_mib=45_000)
    assert b.placed() == {task.id: (0, 2)}
    assert task.current.need.kind is NeedKind.WHOLE_GPU
    assert task.current.need.source == "user: 45000 MiB exceeds the 2 largest GPUs with the margin"


def test_a_task_out_of_memory_alone_is_relaunched_on_a_larger_gpu_until_none_is_larger():
    """A task of unknown need that runs out of memory alone on a small GPU is relaunched on the largest idle
    GPU that is larger (here the middle one, the largest being busy), then on a larger one still; it fails
    only when no GPU is larger than one it outgrew."""
    b = Bench(totals=(32_768, 40_960, 81_920), policy="exclusive")
    task = b.submit("grows")
    assert b.placed() == {task.id: (0,)}
    b.sched.record_gpu_processes("2", (), 1, b.t)  # another user's process holds the largest
    b.oom(task.id)
    assert b.placed() == {task.id: (1,)}
    assert task.current.recovery and task.current.exclusive
    b.oom(task.id)
    assert b.placed() == {}
    assert waiting_reason(b.sched, task.id) == "recovery: waiting for 1 whole idle GPU larger than 40960 MiB"
    b.sched.record_gpu_processes("2", (), 0, b.t)
    assert b.placed() == {task.id: (2,)}
    b.oom(task.id)
    b.decide()
    assert task.state is TaskState.FAILED and task.reason.startswith("out of memory alone on GPU 2: it needs more")


def test_a_target_that_joins_takes_tasks_once_telemetry_has_read_it():
    b = Bench(gpus=1)
    b.set(0, used_mib=TOTAL_MIB)  # someone else's memory fills GPU 0
    b.sched.record_gpu_processes("0", (), foreign=1, now=b.t)
    b.advance(1)
    task = b.submit(mem_mib=15_000)
    assert b.placed() == {}
    b.sched.add_target(Target("MIG-new", "A100 MIG 3g.20gb", 20_096, TargetKind.MIG, parent="0", shareable=False))
    assert b.placed() == {}  # never read yet: no decision on a target never seen
    b.sched.record_sample(GpuSample("MIG-new", b.t, 0, 20_096, None, None, None))
    (launch,) = b.decide()
    assert launch.gpus == ("MIG-new",) and launch.task_id == task.id
    with pytest.raises(ValueError, match="already known"):
        b.sched.add_target(Target("MIG-new", "A100 MIG 3g.20gb", 20_096))


def test_only_an_idle_target_leaves_and_tasks_the_smaller_server_cannot_run_fail():
    b = Bench(gpus=3)
    running = b.submit()
    (launch,) = b.decide()
    busy_gpu = launch.gpus[0]
    with pytest.raises(ValueError, match="only an idle target can be removed"):
        b.sched.remove_target(busy_gpu, b.t)
    wide = b.submit(gpus=3)  # waits: one of the three GPUs is taken
    assert b.placed() == {}
    idle = next(g for g in ("0", "1", "2") if g != busy_gpu)
    b.sched.remove_target(idle, b.t)
    assert [s.gpu.id for s in b.sched.gpu_status(b.t)] == [g for g in ("0", "1", "2") if g != idle]
    assert wide.state is TaskState.FAILED and "needs 3 GPUs but this server has 2" in wide.reason
    b.sched.record_sample(GpuSample(idle, b.t + 1, 0, TOTAL_MIB, 0.0, 0.0, 0.0))  # a late reading: ignored
    b.sched.record_gpu_processes(idle, (), 1, b.t + 1)
    b.first_kernel(running.id)
    b.exit(running.id)
    assert running.state is TaskState.COMPLETED
    assert b.sched.position(idle) is None and b.sched.position(busy_gpu) is not None


def test_an_attempt_never_ends_before_it_was_dispatched():
    """An end time from the world (the daemon reads it from a file the task could write) before the dispatch
    is taken as the dispatch: an attempt of negative length would count negative GPU time."""
    from carma.core.types import ProcessExit

    b = Bench(1)
    b.advance(100)
    task = b.submit()
    b.placed()
    b.sched.record_exit(task.id, ProcessExit(0, ""), 5.0)
    attempt = b.sched.task(task.id).attempts[0]
    assert attempt.ended_s == attempt.dispatched_s == 100.0 and b.sched.task(task.id).ended_s == 100.0
