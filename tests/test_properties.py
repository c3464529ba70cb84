"""Invariants over random traces and servers, run through the twin (hypothesis)."""

from __future__ import annotations

import os
from dataclasses import replace
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from carma.core import POLICY_NAMES, ExitKind, SchedulerConfig, TaskState
from carma.sim import energybound
from carma.sim.bounds import fits, makespan_bounds
from carma.sim.energybound import energy_bound
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import GPU_TYPES
from carma.sim.models import InterferenceModel, PowerModel
from carma.traces.catalog import Workload
from carma.traces.loaders import Trace, TraceEntry

SETTINGS = settings(
    max_examples=int(os.environ.get("CARMA_HYPOTHESIS_EXAMPLES", 150)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
KINDS = [GPU_TYPES["a100-40gb"], GPU_TYPES["a100-80gb"], GPU_TYPES["v100-32gb"]]


@st.composite
def servers(draw):
    gpus = tuple(draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4)))
    return TwinConfig(
        gpus=gpus,
        sharing=draw(st.sampled_from(["mps", "timeslice"])),
        fragmentation=draw(st.sampled_from([0.0, 0.05, 0.2])),
    )


@st.composite
def traces(draw, max_gpus, max_mem_mib, max_warmup_s=25):
    entries = []
    for i in range(draw(st.integers(1, 20))):
        solo = draw(st.floats(30, 4000))
        ttfk = draw(st.floats(1, min(90, solo * 0.5)))  # CUDA start-up alone takes a second or more
        mem = draw(st.integers(200, max_mem_mib))
        workload = Workload(
            name=f"w{i}",
            gpus=draw(st.integers(1, min(2, max_gpus))),
            solo_s=solo,
            mem_mib=mem,
            gract=draw(st.floats(0, 1)),
            smact=draw(st.floats(0, 1)),
            smocc=draw(st.floats(0, 1)),
            drama=draw(st.floats(0, 1)),
            ttfk_s=ttfk,
            # by default warm-ups end within the 30 s TTFK window, so a GPU is judged on its tasks' full
            # allocations; only the needs a task holds (`hold_known_needs`) cover longer ones
            warmup_s=draw(st.floats(0, min(max_warmup_s, solo * 0.4))),
            mem_first_mib=draw(st.integers(0, mem)),
        )
        entries.append(TraceEntry(float(draw(st.integers(0, 3000))), workload))
    entries.sort(key=lambda e: e.submit_s)
    return Trace("random", tuple(entries))


@st.composite
def experiments(draw, policies=POLICY_NAMES, memory=("none", "oracle"), max_mem_mib=60000, max_warmup_s=25):
    twin = draw(servers())
    trace = draw(traces(len(twin.gpus), max_mem_mib, max_warmup_s))
    run = RunConfig(draw(st.sampled_from(policies)), draw(st.sampled_from(memory)), draw(st.booleans()))
    return trace, run, twin


def overlaps(attempt, other):
    """Whether `other` occupied one of `attempt`'s GPUs at the moment `attempt` was dispatched."""
    t = attempt.dispatched_s
    return bool(set(attempt.gpus) & set(other.gpus)) and other.dispatched_s <= t < other.ended_s


@SETTINGS
@given(experiments())
def test_scheduling_invariants(case):
    trace, run, twin = case
    result = simulate(trace, run, twin)
    tasks = result.tasks
    assert len(tasks) == len(trace.entries)
    attempts = [a for t in tasks for a in t.attempts]
    for task in tasks:
        # every task ends exactly once: completed by its last attempt, or failed with a reason
        assert task.state in (TaskState.COMPLETED, TaskState.FAILED)
        assert task.ended_s is not None and task.ended_s >= task.submit_s
        assert all(a.ended_s is not None for a in task.attempts)
        outcomes = [a.outcome for a in task.attempts]
        if task.state is TaskState.COMPLETED:
            assert outcomes[-1] is ExitKind.SUCCESS and outcomes.count(ExitKind.SUCCESS) == 1
            assert task.ended_s == task.attempts[-1].ended_s
        else:
            assert task.reason
        assert all(o is ExitKind.OOM for o in outcomes[:-1])  # only OOMs are relaunched
        # no task starts before it was submitted; attempts follow each other
        assert task.attempts[0].dispatched_s >= task.submit_s
        for before, after in zip(task.attempts, task.attempts[1:], strict=False):
            assert after.dispatched_s >= before.ended_s and after.recovery
        # collocation only ever slows a task down
        if task.state is TaskState.COMPLETED:
            last = task.attempts[-1]
            assert last.ended_s - last.dispatched_s >= task_workload(trace, task).solo_s - 1e-6
    # main-queue tasks start in FIFO order (ids follow submission order)
    firsts = [t.attempts[0].dispatched_s for t in sorted(tasks, key=lambda t: t.id)]
    assert firsts == sorted(firsts)
    # recovered tasks start on GPUs nobody else occupies
    for attempt in attempts:
        if attempt.recovery:
            assert attempt.exclusive
            assert not any(overlaps(attempt, other) for other in attempts if other is not attempt)
    # the twin never over-commits a GPU's memory
    for segments, kind in zip(result.timelines, twin.gpus, strict=True):
        assert all(s.used_mib <= kind.total_mib for s in segments)


def task_workload(trace, task):
    return next(e.workload for e in trace.entries if e.workload.name == task.spec.name)


@SETTINGS
@given(
    experiments(
        policies=("exclusive", "magm", "lug", "ff", "bf"),
        memory=("oracle",),
        max_mem_mib=32768,  # every need fits the smallest GPU
        max_warmup_s=1200,  # memory growing long after the TTFK window: the needs held cover it
    ),
    st.sampled_from([0, 512]),
    st.sampled_from([0, 2048]),
    st.booleans(),
)
def test_exact_known_needs_without_fragmentation_never_oom(case, reserve_mib, margin_mib, own):
    """Also with carma's own decisions: warm-ups of known needs open to further tasks, and backfilling."""
    trace, run, twin = case
    scheduler = SchedulerConfig(reserve_mib=reserve_mib, margin_mib=margin_mib)
    twin = replace(twin, fragmentation=0.0, scheduler=scheduler)
    run = replace(run, own=own)
    result = simulate(trace, run, twin)
    assert result.metrics.oom_crashes == 0
    assert all(t.state is TaskState.COMPLETED for t in result.tasks)


@SETTINGS
@given(experiments(policies=("exclusive",)))
def test_exclusive_never_collocates(case):
    trace, run, twin = case
    result = simulate(trace, run, twin)
    attempts = [a for t in result.tasks for a in t.attempts]
    for attempt in attempts:
        assert attempt.exclusive and not attempt.shared
        assert not any(overlaps(attempt, other) for other in attempts if other is not attempt)
    for task in result.tasks:
        if task.state is TaskState.COMPLETED:
            assert task.ended_s - task.attempts[-1].dispatched_s == pytest.approx(task_workload(trace, task).solo_s)


@SETTINGS
@given(
    experiments(),
    st.booleans(),
    st.one_of(
        st.none(),  # the calibrated model
        st.builds(InterferenceModel, st.floats(0, 2), st.floats(0, 3), st.floats(0, 3), st.floats(0, 1)),
    ),
    st.floats(0.3, 1.0),
)
def test_no_policy_beats_the_makespan_and_energy_bounds(case, own, interference, exponent):
    """Whenever every task some GPU can hold completes (the bounds' premise), under any interference and
    concave power model. A short search for the most SMACT a GPU carries only loosens the energy bound."""
    trace, run, twin = case
    twin = replace(twin, interference=interference or twin.interference, power=PowerModel(exponent))
    result = simulate(trace, replace(run, own=own), twin)
    placeable = [e.workload.name for e in trace.entries if fits(e, twin.gpus)]
    done = {t.spec.name for t in result.tasks if t.state is TaskState.COMPLETED}
    assume(done.issuperset(placeable))
    makespan = makespan_bounds(trace, twin.gpus, twin.interference, twin.sharing).combined_s
    with patch.object(energybound, "NODES", 300):
        energy = energy_bound(trace, twin.gpus, twin.interference, twin.power, twin.sharing, makespan)
    assert result.metrics.makespan_s >= makespan - 1e-6
    assert result.metrics.energy_mj * 1e6 >= energy.energy_j * (1 - 1e-9)
