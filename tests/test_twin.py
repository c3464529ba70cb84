"""The digital twin: a hand-checked golden trace, OOM and recovery, the GPU models, telemetry."""

import math

import pytest
import yaml

from carma.core import ExitKind, Policy, TaskState
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import GPU_TYPES, parse_gpus
from carma.sim.models import SHARING_MODELS, Load, PowerModel
from carma.traces.catalog import load_catalog
from carma.traces.loaders import load_trace

ONE_GPU = TwinConfig(gpus=parse_gpus("1xA100-40GB"))


def yaml_trace(tmp_path, workloads, tasks, name="golden"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "workloads": workloads, "tasks": tasks}))
    return load_trace(str(path), load_catalog())


@pytest.fixture
def golden(tmp_path):
    """Two identical tasks, 5 s apart, on one A100-40GB (see docs/twin-model.md for the constants)."""
    job = {"gpus": 1, "solo_s": 100, "mem_mib": 10240, "ttfk_s": 10, "smact": 0.3, "smocc": 0.2, "drama": 0.2}
    return yaml_trace(tmp_path, {"a": job, "b": job}, [{"at": 0, "task": "a"}, {"at": 5, "task": "b"}])


def power(smact):
    return 50 + 350 * smact**0.6  # A100-40GB: idle 50 W, 400 W board limit, exponent 0.6


def test_golden_trace_with_magm_by_hand(golden):
    """A runs 0-102; B waits for A's TTFK window (first kernel 10 + 30 s), runs 40-142.

    From 50 s (B's first kernel) both share the GPU under MPS: slowdown max(1, 0.3 + 0.3) * (1 + 0.04) =
    1.04. A has 50 of its 90 GPU seconds left at 50 s, so ends at 50 + 52 = 102; B has done 50 s of work
    by then and runs its last 40 s alone: ends at 142.
    """
    result = simulate(golden, RunConfig(Policy.MAGM), ONE_GPU)
    a, b = result.tasks
    assert (a.attempts[0].dispatched_s, a.attempts[0].first_kernel_s, a.ended_s) == (0, 10, pytest.approx(102))
    assert (b.attempts[0].dispatched_s, b.attempts[0].first_kernel_s, b.ended_s) == (40, 50, pytest.approx(142))
    m = result.metrics
    assert m.makespan_s == pytest.approx(142)
    assert m.wait_mean_s == pytest.approx((0 + 35) / 2)
    assert m.exec_mean_s == pytest.approx(102)
    assert m.jct_mean_s == pytest.approx((102 + 137) / 2)
    energy_j = 10 * 50 + 40 * power(0.3) + 52 * power(0.6 / 1.04) + 40 * power(0.3)
    assert m.energy_mj == pytest.approx(energy_j / 1e6)
    assert m.smact_mean == pytest.approx((40 * 0.3 + 52 * 0.6 / 1.04 + 40 * 0.3) / 142)
    assert m.mem_used_mean_mib == pytest.approx((92 + 92) * 10240 / 142)  # each allocated for 92 s
    assert m.oom_crashes == 0 and m.tasks_completed == 2


def test_golden_trace_exclusive_runs_back_to_back(golden):
    result = simulate(golden, RunConfig(Policy.EXCLUSIVE), ONE_GPU)
    a, b = result.tasks
    assert (a.ended_s, b.attempts[0].dispatched_s, b.ended_s) == (100, 100, 200)
    assert result.metrics.makespan_s == 200
    assert result.metrics.energy_mj == pytest.approx((20 * 50 + 180 * power(0.3)) / 1e6)


def test_time_slicing_slows_collocated_tasks_more_than_mps(golden):
    mps = simulate(golden, RunConfig(Policy.MAGM), ONE_GPU)
    timeslice = simulate(golden, RunConfig(Policy.MAGM), TwinConfig(gpus=ONE_GPU.gpus, sharing="timeslice"))
    assert timeslice.metrics.makespan_s > mps.metrics.makespan_s


@pytest.fixture
def crowded(tmp_path):
    """A big task, then one that does not fit beside it."""
    workloads = {
        "big": {"solo_s": 1000, "mem_mib": 30000, "ttfk_s": 10, "smact": 0.3},
        "late": {"solo_s": 200, "mem_mib": 20000, "ttfk_s": 20, "smact": 0.3},
    }
    return yaml_trace(tmp_path, workloads, [{"at": 0, "task": "big"}, {"at": 1, "task": "late"}])


def test_oom_in_the_twin_is_recovered_exclusively(crowded):
    result = simulate(crowded, RunConfig(Policy.MAGM), ONE_GPU)
    big, late = result.tasks
    crash, relaunch = late.attempts
    assert crash.outcome is ExitKind.OOM and crash.shared
    assert crash.ended_s == crash.dispatched_s + 20  # crashes at its first kernel
    assert "CUDA out of memory" in crash.message
    assert relaunch.recovery and relaunch.exclusive
    assert relaunch.dispatched_s == math.ceil(big.ended_s)  # the next 1 Hz decision after the GPU is free
    assert late.state is TaskState.COMPLETED
    assert result.metrics.oom_crashes == 1


def test_oracle_memory_avoids_the_oom(crowded):
    result = simulate(crowded, RunConfig(Policy.MAGM, "oracle"), ONE_GPU)
    assert result.metrics.oom_crashes == 0
    assert result.tasks[1].attempts[0].dispatched_s >= result.tasks[0].ended_s


def test_a_task_larger_than_the_gpu_fails_with_its_reason(tmp_path):
    trace = yaml_trace(tmp_path, {"huge": {"solo_s": 100, "mem_mib": 50000}}, [{"at": 0, "task": "huge"}])
    result = simulate(trace, RunConfig(Policy.MAGM), ONE_GPU)
    (task,) = result.tasks
    assert task.state is TaskState.FAILED and "alone on GPU 0" in task.reason
    assert result.metrics.tasks_failed == 1


def test_multi_gpu_task_runs_at_the_pace_of_its_busiest_gpu(tmp_path):
    workloads = {
        "pair": {"gpus": 2, "solo_s": 1010, "mem_mib": 1000, "ttfk_s": 10, "smact": 0.6, "drama": 0.1},
        "hog": {"solo_s": 5000, "mem_mib": 1000, "ttfk_s": 10, "smact": 0.9, "drama": 0.1},
    }
    trace = yaml_trace(tmp_path, workloads, [{"at": 0, "task": "hog"}, {"at": 0, "task": "pair"}])
    twin = TwinConfig(gpus=parse_gpus("2xA100-40GB"))
    result = simulate(trace, RunConfig(Policy.MAGM, risk_filter=False), twin)
    _hog, pair = result.tasks
    assert pair.attempts[0].gpus == (0, 1)  # waits for the hog's TTFK window, then takes both GPUs
    assert pair.attempts[0].dispatched_s == 40
    slowdown = (0.9 + 0.6) * 1.04  # on the hog's GPU; the other GPU alone would not slow it
    expected_end = pair.attempts[0].first_kernel_s + 1000 * slowdown
    assert pair.ended_s == pytest.approx(expected_end)


def test_idle_gpus_draw_idle_power_for_the_whole_makespan(golden):
    three = TwinConfig(gpus=parse_gpus("3xA100-40GB"))
    one = simulate(golden, RunConfig(Policy.EXCLUSIVE), ONE_GPU)
    result = simulate(golden, RunConfig(Policy.EXCLUSIVE), three)
    # a runs on GPU 0 (0-100), b on GPU 1 (5-105); GPU 2 stays idle. Idle seconds: GPU 0 before a's first
    # kernel (10) and after it ends (5), GPU 1 before b's first kernel (15), GPU 2 throughout (105).
    assert result.metrics.makespan_s == 105
    idle_s = 10 + 5 + 15 + 105
    assert result.metrics.energy_mj * 1e6 == pytest.approx(2 * 90 * power(0.3) + idle_s * 50)
    assert one.metrics.makespan_s == 200


def test_sharing_models():
    light, heavy = Load(0.3, 0.2, 0.2), Load(0.9, 0.5, 0.5)
    mps, ts = SHARING_MODELS["mps"], SHARING_MODELS["timeslice"]
    assert mps.slowdown([heavy]) == ts.slowdown([heavy]) == 1.0  # solo runs at its measured speed
    assert mps.slowdown([light, light]) == pytest.approx(1.04)  # fits: only the co-runner overhead
    assert mps.slowdown([heavy, heavy]) == pytest.approx(1.8 * 1.04)  # SMs oversubscribed
    assert mps.slowdown([Load(0.1, 0.1, 0.7), Load(0.1, 0.1, 0.7)]) == pytest.approx(1.4 * 1.04)  # DRAM bound
    assert ts.slowdown([light, light]) > mps.slowdown([light, light])
    assert mps.slowdown([light] * 3) > mps.slowdown([light] * 2)


def test_power_model_rises_sublinearly_from_idle_to_the_board_limit():
    gpu, model = GPU_TYPES["a100-40gb"], PowerModel()
    assert model.power_w(gpu, 0.0) == gpu.idle_w
    assert model.power_w(gpu, 1.0) == gpu.max_w
    assert model.power_w(gpu, 1.5) == gpu.max_w
    assert model.power_w(gpu, 0.5) > (gpu.idle_w + gpu.max_w) / 2


def test_parse_gpus_notation():
    assert [g.name for g in parse_gpus("2xA100-40GB,h100-80gb")] == ["A100-40GB", "A100-40GB", "H100-80GB"]
    for bad, message in (("3xB300", "unknown GPU type"), ("x", "unknown GPU type"), ("0xA100-40GB", "at least 1")):
        with pytest.raises(ValueError, match=message):
            parse_gpus(bad)


def test_timeline_shows_memory_from_the_first_kernel_to_the_exit(golden):
    timeline = simulate(golden, RunConfig(Policy.EXCLUSIVE), ONE_GPU).timelines[0]
    assert [(s.t, s.used_mib, s.tasks) for s in timeline] == [
        (0, 0, 0),
        (10, 10240, 1),
        (100, 0, 0),
        (110, 10240, 1),
        (200, 0, 0),
    ]


def test_telemetry_feeds_the_core_1hz_samples_without_gaps_or_repeats(golden):
    """Whatever instants the loop runs at, the core's window holds the last 30 one-second samples."""
    from carma.core.scheduler import Scheduler
    from carma.sim.models import SHARING_MODELS, PowerModel
    from carma.sim.twin import TwinServer

    server = TwinServer(ONE_GPU.gpus, Scheduler, SHARING_MODELS["mps"], PowerModel(), 0.05, oracle_memory=False)
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
    for now, samples, _ in fed:
        assert samples[-1] == now and len(samples) <= 30
    prev = -1
    for now, samples, _ in fed:
        assert samples[0] == prev + 1 or samples[0] == now - 29  # contiguous, or a full fresh window
        prev = samples[-1]
    seen = {now: procs[0].tasks for now, _, procs in fed}
    assert seen[10] == {1} and seen[50] == {1, 2} and seen[142] == frozenset()
