"""The digital twin: hand-checked golden traces, memory appearance and OOM, the GPU models, telemetry.

The golden traces use explicit, round model parameters (not the calibrated ones) so every number can be
derived by hand: time-slicing slowdown 1 + g_own * g_others, MPS keeping half of it, and power linear in
SMACT from 50 W to 400 W.
"""

import math

import pytest
import yaml

from carma.core import ExitKind, TaskState
from carma.core.scheduler import Scheduler
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import GPU_TYPES, parse_gpus
from carma.sim.models import InterferenceModel, Load, PowerModel, calibrated_interference, calibrated_power
from carma.sim.twin import TwinServer
from carma.traces.catalog import load_catalog
from carma.traces.loaders import load_trace

MODEL = InterferenceModel(a=1.0, p=1.0, q=1.0, mps_share=0.5)
LINEAR = PowerModel(exponent=1.0)
ONE_GPU = TwinConfig(gpus=parse_gpus("1xA100-40GB"), interference=MODEL, power=LINEAR)
JOB = {
    "gpus": 1,
    "solo_s": 100,
    "mem_mib": 10240,
    "mem_first_mib": 1024,
    "ttfk_s": 10,
    "warmup_s": 5,
    "gract": 0.5,
    "smact": 0.3,
    "smocc": 0.2,
    "drama": 0.2,
}


def power(smact):
    return 50 + 350 * smact


def yaml_trace(tmp_path, workloads, tasks, name="golden"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "workloads": workloads, "tasks": tasks}))
    return load_trace(str(path), load_catalog())


@pytest.fixture
def golden(tmp_path):
    """Two identical tasks, 5 s apart, on one A100-40GB."""
    return yaml_trace(tmp_path, {"a": JOB, "b": JOB}, [{"at": 0, "task": "a"}, {"at": 5, "task": "b"}])


def test_golden_trace_with_magm_by_hand(golden):
    """a: dispatched 0, seen 10 (context and weights), full at 15, then 85 s of work.

    b waits for a's TTFK window (seen 10 + 30 s): dispatched 40, seen 50, full 55. From 55 both compute:
    time-slicing would slow each by 1 + 0.5 * 0.5 = 1.25; MPS keeps half the excess: 1.125 (the SMs and
    DRAM are not oversubscribed: 0.3 + 0.3 and 0.2 + 0.2 are below 1). a has 45 s of work left at 55, so
    ends at 55 + 45 * 1.125 = 105.625; b has then done 45 s and runs its last 40 s alone: ends 145.625.
    """
    result = simulate(golden, RunConfig("magm"), ONE_GPU)
    a, b = result.tasks
    assert (a.attempts[0].dispatched_s, a.attempts[0].first_kernel_s, a.ended_s) == (0, 10, pytest.approx(105.625))
    assert (b.attempts[0].dispatched_s, b.attempts[0].first_kernel_s, b.ended_s) == (40, 50, pytest.approx(145.625))
    m = result.metrics
    assert m.makespan_s == pytest.approx(145.625)
    assert m.wait_mean_s == pytest.approx((0 + 35) / 2)
    assert m.exec_mean_s == pytest.approx(105.625)
    assert m.jct_mean_s == pytest.approx((105.625 + 140.625) / 2)
    shared = 0.6 / 1.125  # the GPU's SMACT while both compute
    energy_j = 15 * 50 + 40 * power(0.3) + 50.625 * power(shared) + 40 * power(0.3)
    assert m.energy_mj == pytest.approx(energy_j / 1e6)
    assert m.smact_mean == pytest.approx((80 * 0.3 + 50.625 * shared) / 145.625)
    assert m.oom_crashes == 0 and m.tasks_completed == 2


def test_golden_trace_memory_appears_in_two_steps(golden):
    timeline = simulate(golden, RunConfig("magm"), ONE_GPU).timelines[0]
    assert [(s.t, s.used_mib, s.tasks) for s in timeline] == [
        (0, 0, 0),
        (10, 1024, 1),  # a shows on the GPU with its context and weights
        (15, 10240, 1),  # a's full allocation after the warm-up
        (50, 11264, 2),
        (55, 20480, 2),
        (105.625, 10240, 1),
        (145.625, 0, 0),
    ]


def test_golden_trace_exclusive_runs_back_to_back(golden):
    result = simulate(golden, RunConfig("exclusive"), ONE_GPU)
    a, b = result.tasks
    assert (a.ended_s, b.attempts[0].dispatched_s, b.ended_s) == (100, 100, 200)
    assert result.metrics.makespan_s == 200
    assert result.metrics.energy_mj == pytest.approx((30 * 50 + 170 * power(0.3)) / 1e6)


def test_time_slicing_keeps_the_whole_slowdown(golden):
    timeslice = TwinConfig(gpus=ONE_GPU.gpus, interference=MODEL, power=LINEAR, sharing="timeslice")
    a, b = simulate(golden, RunConfig("magm"), timeslice).tasks
    assert a.ended_s == pytest.approx(55 + 45 * 1.25)
    assert b.ended_s == pytest.approx(a.ended_s + 40)


@pytest.fixture
def crowded(tmp_path):
    """A big task, then one whose full allocation does not fit beside it."""
    workloads = {
        "big": {**JOB, "solo_s": 1000, "mem_mib": 30000},
        "late": {**JOB, "solo_s": 200, "mem_mib": 20000, "ttfk_s": 20},
    }
    return yaml_trace(tmp_path, workloads, [{"at": 0, "task": "big"}, {"at": 1, "task": "late"}])


def test_oom_at_the_full_allocation_is_recovered_exclusively(crowded):
    result = simulate(crowded, RunConfig("magm"), ONE_GPU)
    big, late = result.tasks
    crash, relaunch = late.attempts
    assert crash.outcome is ExitKind.OOM and crash.shared
    assert crash.first_kernel_s == crash.dispatched_s + 20  # its context fitted...
    assert crash.ended_s == crash.dispatched_s + 20 + 5  # ...its full allocation did not
    assert "CUDA out of memory" in crash.message and "Tried to allocate 18.53 GiB" in crash.message
    assert relaunch.recovery and relaunch.exclusive
    assert relaunch.dispatched_s == math.ceil(big.ended_s)  # the next 1 Hz decision after the GPU is free
    assert late.state is TaskState.COMPLETED
    assert result.metrics.oom_crashes == 1


def test_oracle_memory_avoids_the_oom(crowded):
    result = simulate(crowded, RunConfig("magm", "oracle"), ONE_GPU)
    assert result.metrics.oom_crashes == 0
    assert result.tasks[1].attempts[0].dispatched_s >= result.tasks[0].ended_s


def test_a_task_larger_than_the_gpu_fails_with_its_reason(tmp_path):
    trace = yaml_trace(tmp_path, {"huge": {**JOB, "mem_mib": 50000}}, [{"at": 0, "task": "huge"}])
    result = simulate(trace, RunConfig("magm"), ONE_GPU)
    (task,) = result.tasks
    assert task.state is TaskState.FAILED and "alone on GPU 0" in task.reason
    assert result.metrics.tasks_failed == 1


def test_a_task_too_large_for_the_first_idle_gpu_completes_on_a_larger_one(tmp_path):
    """On a server of unequal GPUs, Exclusive with no memory need puts the task on the first idle GPU, where it
    runs out of memory alone, then relaunches it on the larger GPU; knowing the need, it goes there first."""
    trace = yaml_trace(tmp_path, {"big": {**JOB, "mem_mib": 36000}}, [{"at": 0, "task": "big"}])
    mixed = TwinConfig(gpus=parse_gpus("1xV100-32GB,1xA100-40GB"))
    (task,) = simulate(trace, RunConfig("exclusive"), mixed).tasks
    assert task.state is TaskState.COMPLETED
    assert [(a.gpus, a.outcome) for a in task.attempts] == [
        (("SIM-GPU-0",), ExitKind.OOM),
        (("SIM-GPU-1",), ExitKind.SUCCESS),
    ]
    (task,) = simulate(trace, RunConfig("bf", "oracle"), mixed).tasks
    assert [(a.gpus, a.outcome) for a in task.attempts] == [(("SIM-GPU-1",), ExitKind.SUCCESS)]


def test_multi_gpu_task_runs_at_the_pace_of_its_busiest_gpu(tmp_path):
    pair = {**JOB, "gpus": 2, "solo_s": 1015, "gract": 0.6, "smact": 0.5, "drama": 0.1}
    hog = {**JOB, "solo_s": 5000, "gract": 0.9, "smact": 0.7, "drama": 0.1}
    trace = yaml_trace(tmp_path, {"pair": pair, "hog": hog}, [{"at": 0, "task": "hog"}, {"at": 0, "task": "pair"}])
    twin = TwinConfig(gpus=parse_gpus("2xA100-40GB"), interference=MODEL, power=LINEAR)
    _, pair_task = simulate(trace, RunConfig("magm", risk_filter=False), twin).tasks
    attempt = pair_task.attempts[0]
    assert attempt.gpus == ("SIM-GPU-0", "SIM-GPU-1") and attempt.dispatched_s == 40  # waits for the hog's TTFK window
    # on the hog's GPU: MPS keeps half of 0.6 * 0.9 = 0.54, but SMs are oversubscribed (0.5 + 0.7 = 1.2)
    slowdown = min(1 + 0.54, max(1 + 0.27, 1.2))
    assert pair_task.ended_s == pytest.approx(attempt.dispatched_s + 10 + 5 + 1000 * slowdown)


def test_idle_gpus_draw_idle_power_for_the_whole_makespan(golden):
    three = TwinConfig(gpus=parse_gpus("3xA100-40GB"), interference=MODEL, power=LINEAR)
    result = simulate(golden, RunConfig("exclusive"), three)
    # a computes on GPU 0 over 15-100, b on GPU 1 over 20-105; GPU 2 stays idle for all 105 s
    assert result.metrics.makespan_s == 105
    idle_s = (15 + 5) + 20 + 105
    assert result.metrics.energy_mj * 1e6 == pytest.approx(2 * 85 * power(0.3) + idle_s * 50)


def test_time_slicing_slowdown_depends_on_own_and_co_runners_busy_time():
    light, heavy = Load(0.2, 0.1, 0.05, 0.05), Load(0.9, 0.7, 0.3, 0.5)
    assert MODEL.slowdowns([heavy], "timeslice") == [1.0]
    assert MODEL.slowdowns([light, heavy], "timeslice") == pytest.approx([1 + 0.2 * 0.9, 1 + 0.9 * 0.2])
    three = MODEL.slowdowns([light, light, heavy], "timeslice")
    assert three[0] == pytest.approx(1 + 0.2 * (0.2 + 0.9))  # all co-runners count
    fitted = calibrated_interference()
    beside_light = fitted.slowdowns([light, light], "timeslice")[0]
    beside_heavy = fitted.slowdowns([light, heavy], "timeslice")[0]
    assert beside_heavy > beside_light > 1  # the busier the co-runner, the slower the task


def test_mps_keeps_a_share_of_time_slicing_but_not_more_than_the_gpu_has():
    light = Load(0.5, 0.3, 0.1, 0.2)
    assert MODEL.slowdowns([light, light], "mps") == pytest.approx([1.125, 1.125])
    saturating = Load(0.5, 0.7, 0.3, 0.2)  # same busy time, but the SMs are oversubscribed (1.4)
    assert MODEL.slowdowns([saturating, saturating], "mps") == pytest.approx([1.25, 1.25])  # time-slicing's
    bandwidth = Load(0.5, 0.5, 0.1, 0.6)
    assert MODEL.slowdowns([bandwidth, bandwidth], "mps") == pytest.approx([1.2, 1.2])  # DRAM: 0.6 + 0.6
    for loads in ([light, light], [saturating, light, bandwidth]):
        for mps, ts in zip(MODEL.slowdowns(loads, "mps"), MODEL.slowdowns(loads, "timeslice"), strict=True):
            assert 1 <= mps <= ts  # MPS never does worse than time-slicing


def test_power_model_runs_from_idle_to_the_board_limit():
    gpu = GPU_TYPES["a100-40gb"]
    fitted = calibrated_power()
    assert fitted.power_w(gpu, 0.0) == gpu.idle_w
    assert fitted.power_w(gpu, 1.0) == fitted.power_w(gpu, 1.5) == gpu.max_w
    assert fitted.power_w(gpu, 0.5) > (gpu.idle_w + gpu.max_w) / 2  # sublinear (fitted exponent below 1)
    with pytest.raises(ValueError):
        PowerModel(exponent=0)


def test_parse_gpus_notation():
    assert [g.name for g in parse_gpus("2xA100-40GB,h100-80gb")] == ["A100-40GB", "A100-40GB", "H100-80GB"]
    for bad, message in (("3xB300", "unknown GPU type"), ("x", "unknown GPU type"), ("0xA100-40GB", "at least 1")):
        with pytest.raises(ValueError, match=message):
            parse_gpus(bad)


def test_telemetry_feeds_the_core_1hz_samples_without_gaps_or_repeats(golden):
    """Whatever instants the loop runs at, the core's window holds the last 30 one-second samples."""
    server = TwinServer(ONE_GPU.gpus, Scheduler, MODEL, "mps", LINEAR, 0.05, oracle_memory=False)
    telemetry = server.loop.telemetry
    fed = []

    class Spy:
        def read(self, now):
            reading = telemetry.read(now)
            fed.append((now, [s.t for s in reading.samples], dict(reading.processes)))
            return reading

    server.loop.telemetry = Spy()
    server.run(golden)
    times = [t for _, samples, _ in fed for t in samples]
    assert times == sorted(set(times)) and all(t == int(t) for t in times)
    prev = -1
    for now, samples, _ in fed:
        if samples:
            assert samples[-1] == now and len(samples) <= 30
            assert samples[0] == prev + 1 or samples[0] == now - 29  # contiguous, or a full fresh window
            prev = samples[-1]
    seen = {now: procs["SIM-GPU-0"].tasks for now, _, procs in fed}
    assert seen[10] == {1} and seen[50] == {1, 2} and seen[146] == frozenset()
