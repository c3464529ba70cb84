"""Makespan bounds: figures worked out by hand on tiny traces, and no simulated policy ever beating them."""

import pytest

from carma.sim.bounds import makespan_bounds
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import parse_gpus
from carma.sim.models import InterferenceModel
from carma.traces.catalog import Workload, load_catalog
from carma.traces.loaders import Trace, TraceEntry, load_trace

A100 = parse_gpus("1xA100-40GB")[0]  # 40960 MiB
# slowdown = 1 + (own GRACT) * (co-runners' GRACT): k tasks of GRACT 1 each take k times as long, so a GPU
# processes their work at rate 1 however many share it; tasks of GRACT 0 do not slow each other at all
LINEAR = InterferenceModel(a=1.0, p=1.0, q=1.0, mps_share=1.0)


def task(submit_s: float, work_s: float, gract: float = 1.0, mem_mib: int = 10240, gpus: int = 1) -> TraceEntry:
    """A task with `work_s` seconds of computing after 5 s to its first kernel and 5 s of warm-up."""
    workload = Workload(f"w{gract}-{mem_mib}", gpus, work_s + 10, mem_mib, gract, gract, 0.0, gract, 5.0, 5.0, 500)
    return TraceEntry(submit_s, workload)


def bounds(*entries: TraceEntry, gpus: int = 1, sharing: str = "timeslice"):
    return makespan_bounds(Trace("hand", entries), [A100] * gpus, LINEAR, sharing)


def test_the_critical_path_is_the_latest_submission_plus_solo_time_from_the_first_submission():
    b = bounds(task(50, 200), task(500, 290, mem_mib=2048), gpus=3)
    assert (b.critical_path_s, b.critical_task) == (500 + 300 - 50, "w1.0-2048")
    assert b.combined_s == b.critical_path_s  # three GPUs: 490 s of work takes 163 s


def test_gpu_bound_tasks_gain_nothing_from_packing():
    """Four tasks of 100 s of work on two GPUs: 200 s, whatever the packing."""
    b = bounds(*(task(0, 100) for _ in range(4)), gpus=2)
    assert b.work_s == pytest.approx(200)
    assert (b.critical_path_s, b.combined_s) == (110, pytest.approx(200))


def test_tasks_that_do_not_interfere_pack_up_to_what_memory_holds():
    """Eight tasks of 10 GiB, 100 s each, that do not slow each other: four fit a 40 GB GPU at once."""
    assert bounds(*(task(0, 100, gract=0.0) for _ in range(8))).work_s == pytest.approx(800 / 4)
    # two tasks only: no more than two run at once, however many would fit
    assert bounds(task(0, 100, gract=0.0), task(0, 100, gract=0.0)).work_s == pytest.approx(200 / 2)


def test_the_heavy_tasks_bound_the_work_when_light_ones_would_hide_them():
    """Two GPU-bound tasks and ten light ones: all twelve, bounded by the lightest, would pack 12-fold (100 s);
    the heavy two alone still need 200 s, light co-runners only slowing them."""
    entries = [task(0, 100), task(0, 100), *(task(0, 100, gract=0.0, mem_mib=1024) for _ in range(10))]
    assert bounds(*entries).work_s == pytest.approx(200)


def test_work_submitted_late_cannot_start_before_its_submission():
    """100 s of work at 0, then 200 s submitted at 1000 s: the server idles in between."""
    b = bounds(task(0, 100), task(1000, 100), task(1000, 100))
    assert b.work_s == pytest.approx(300)
    assert b.critical_path_s == 1110
    assert b.combined_s == pytest.approx(1000 + 200)


def test_a_two_gpu_task_s_work_counts_on_each_of_its_gpus():
    assert bounds(task(0, 100, gpus=2), task(0, 100), gpus=2).work_s == pytest.approx(300 / 2)


def test_tasks_no_gpu_can_hold_are_left_out_and_counted():
    b = bounds(task(0, 100), task(0, 5000, mem_mib=50000))
    assert (b.unplaceable, b.critical_path_s, b.critical_task) == (1, 110, "w1.0-10240")


def test_gain_share_is_the_run_s_part_of_the_gap_between_exclusive_and_the_bound():
    b = bounds(task(0, 100), task(0, 100))  # 210 s alone, in turn; the bound 200 s
    assert b.gain_share(exclusive_s=400, makespan_s=300) == pytest.approx(0.5)
    assert b.gain_share(exclusive_s=200, makespan_s=200) is None  # Exclusive meets the bound: no gain to share


@pytest.mark.parametrize(
    ("trace", "gpus", "sharing"),
    [
        ("carma-t1", "3xA100-40GB", "mps"),
        ("carma-t1", "3xA100-40GB", "timeslice"),
        ("carma-mix90", "2xH200-141GB", "mps"),
    ],
)
def test_no_simulated_policy_beats_the_bound(trace, gpus, sharing):
    loaded = load_trace(trace, load_catalog(), skip_unknown=True)
    loaded = Trace(loaded.name, loaded.entries[:30])
    twin = TwinConfig(gpus=parse_gpus(gpus), sharing=sharing)
    b = makespan_bounds(loaded, twin.gpus, twin.interference, twin.sharing)
    runs = (RunConfig("magm"), RunConfig("bf", "oracle"), RunConfig("magm", "oracle", risk_filter=False))
    makespans = [simulate(loaded, run, twin).metrics.makespan_s for run in runs]
    assert b.work_s > 0 and min(makespans) >= b.combined_s
