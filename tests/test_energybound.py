"""Energy bound: figures worked out by hand on tiny traces, and the most SMACT a GPU carries never understated."""

import itertools
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carma.sim import energybound
from carma.sim.bounds import makespan_bounds
from carma.sim.energybound import TOLERANCE, energy_bound, peak_smact
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import parse_gpus
from carma.sim.models import InterferenceModel, Load, PowerModel, calibrated_interference
from carma.traces.catalog import Workload
from carma.traces.loaders import Trace, TraceEntry

A100 = parse_gpus("1xA100-40GB")[0]  # 40960 MiB, 50 W idle, 400 W at SMACT 1
POWER = PowerModel(exponent=0.8)
# slowdown = 1 + (own GRACT) * (co-runners' GRACT): two GPU-bound tasks run at half speed each
LINEAR = InterferenceModel(a=1.0, p=1.0, q=1.0, mps_share=1.0)


def task(
    submit_s: float, work_s: float, gract: float = 1.0, smact: float = 1.0, mem_mib: int = 10240, name: str = ""
) -> TraceEntry:
    """A task with `work_s` seconds of computing after 5 s to its first kernel and 5 s of warm-up."""
    workload = Workload(name or f"w{gract}-{smact}", 1, work_s + 10, mem_mib, gract, smact, 0.0, 0.0, 5.0, 5.0, 500)
    return TraceEntry(submit_s, workload)


def bound(*entries: TraceEntry, gpus: int = 1, interference: InterferenceModel = LINEAR, sharing: str = "mps"):
    trace = Trace("hand", entries)
    makespan = makespan_bounds(trace, [A100] * gpus, interference, sharing).combined_s
    return energy_bound(trace, [A100] * gpus, interference, POWER, sharing, makespan)


def test_a_lone_task_spends_exactly_the_bound():
    """Alone, a task of SMACT 0.5 draws 50 + 350 * 0.5**0.8 W while it computes and 50 W before: nothing to save."""
    entry = task(0, 1000, gract=0.6, smact=0.5)
    b = bound(entry)
    assert b.peak_smact == pytest.approx(0.5)
    assert b.energy_j == pytest.approx(50 * 1010 + 350 * 0.5**0.8 * 1000)
    twin = TwinConfig(gpus=(A100,), interference=LINEAR, power=POWER)
    assert simulate(Trace("hand", (entry,)), RunConfig("exclusive"), twin).metrics.energy_mj * 1e6 == pytest.approx(
        b.energy_j
    )


def test_gpu_bound_tasks_cannot_hide_smact_under_the_board_limit():
    """Two GPU-bound tasks together carry SMACT 1 (each at half speed): every SMACT-second costs the full 350 W."""
    b = bound(task(0, 100, name="a"), task(0, 100, name="b"))
    assert 1.0 <= b.peak_smact <= 1 + TOLERANCE
    assert b.smact_work_s == 200 and b.dynamic_j == pytest.approx(350 * 200 / b.peak_smact)
    assert b.idle_j == 50 * 200  # the makespan bound: 200 s of work, at most one task-second per second


def test_a_light_co_runner_lets_a_gpu_carry_more_than_smact_1():
    """Under the calibrated model a GPU-bound task keeps most of its speed beside a middling one, which adds its own
    SMACT: power stops at the board limit, so packing them saves what the SMACT above 1 would have cost."""
    im = calibrated_interference()
    heavy, middling = task(0, 100, name="heavy"), task(0, 100, gract=0.604, smact=0.522, name="middling")
    pair = im.slowdowns([Load(1.0, 1.0, 0.0, 0.0), Load(0.604, 0.522, 0.0, 0.0)], "mps")
    carried = 1.0 / pair[0] + 0.522 / pair[1]
    assert carried > 1.1
    b = bound(heavy, middling, interference=im)
    assert carried <= b.peak_smact <= carried * (1 + TOLERANCE)
    assert b.dynamic_j == pytest.approx(350 * b.smact_work_s / b.peak_smact)
    assert b.dynamic_j < 350 * b.smact_work_s


def test_tasks_without_smact_or_room_leave_only_the_idle_floor():
    b = bound(task(0, 100, gract=0.2, smact=0.0), task(0, 100, mem_mib=50000), gpus=2)
    assert (b.peak_smact, b.dynamic_j, b.energy_j) == (0.0, 0.0, b.idle_j)


# GRACT, SMACT, DRAMA, memory; at least 4 GB, so that a GPU holds 10 copies at most: the peak's search grows with
# the copies a GPU holds, and small tasks test the same rule as large ones
PROFILE = st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.integers(4000, 25000))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(PROFILE, min_size=1, max_size=6),
    st.sampled_from(["mps", "timeslice"]),
    st.one_of(
        st.just(calibrated_interference()),
        st.builds(InterferenceModel, st.floats(0, 2), st.floats(0, 3), st.floats(0, 3), st.floats(0, 1)),
    ),
    st.booleans(),
)
def test_no_set_that_fits_carries_more_smact_than_the_peak(profiles, sharing, interference, pooled):
    """Also with the tasks pooled in a grid's cells, as a trace of many profiles is."""
    workloads = [Workload(f"w{i}", 1, 100, m, g, z, 0.0, d, 1, 1, 10) for i, (g, z, d, m) in enumerate(profiles)]
    with patch.object(energybound, "PROFILES", 1 if pooled else energybound.PROFILES):
        peak = peak_smact([TraceEntry(0, w) for w in workloads], A100.total_mib, interference, sharing)
    for size in range(1, len(workloads) + 1):
        for group in itertools.combinations(workloads, size):
            if sum(w.mem_mib for w in group) <= A100.total_mib:
                loads = [Load(w.gract, w.smact, w.smocc, w.drama) for w in group]
                slowdowns = interference.slowdowns(loads, sharing)
                assert sum(x.smact / s for x, s in zip(loads, slowdowns, strict=True)) <= peak + 1e-9
