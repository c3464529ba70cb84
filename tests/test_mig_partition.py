"""The partition manager: the tightest instance, MIGM's placement rule, fusion and fission of idle
instances, refusals; and over random request/release runs, that every layout is valid, no busy instance is
destroyed, no task lands on an instance smaller than its need and a plan applied is the state it predicted."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carma.core.mig.geometry import Geometry
from carma.core.mig.partition import (
    CreateInstance,
    DestroyInstance,
    Instance,
    InstanceKey,
    InvalidLayout,
    MigGpu,
    Plan,
    Refusal,
    RefusalReason,
    apply,
    plan,
)
from carma.core.mig.profiles import MODELS

A100 = Geometry.of("A100-40GB")
GIB = 1024


def gpu(*instances: tuple[str, int, bool], uuid: str = "GPU-a", geometry: Geometry = A100) -> MigGpu:
    return MigGpu(uuid, geometry, tuple(Instance(geometry.profile(n), s, busy) for n, s, busy in instances))


def ones(busy_from: int) -> MigGpu:
    """Seven 1g.5gb instances, those from `busy_from` on busy."""
    return gpu(*(("1g.5gb", s, s >= busy_from) for s in range(7)))


def test_an_empty_gpu_gets_the_tightest_instance_where_most_layouts_stay_reachable():
    decision = plan([gpu()], 4 * GIB)
    assert isinstance(decision, Plan)
    assert decision.instance == InstanceKey("GPU-a", 6, "1g.5gb")  # MIGM: the last slice keeps most open
    assert decision.steps == (CreateInstance(decision.instance),)
    assert decision.after.text() == "free 0-5 | 1g.5gb@6 idle | free 7"


def test_an_idle_instance_of_the_tightest_profile_is_used_as_it_is():
    decision = plan([gpu(("3g.20gb", 0, True), ("1g.5gb", 4, False))], 3 * GIB)
    assert isinstance(decision, Plan) and not decision.reconfigures
    assert decision.instance == InstanceKey("GPU-a", 4, "1g.5gb")


def test_a_larger_idle_instance_is_not_taken_when_the_tightest_can_be_created():
    decision = plan([gpu(("3g.20gb", 4, False))], 3 * GIB)
    assert isinstance(decision, Plan)
    assert decision.steps == (CreateInstance(decision.instance),) and decision.profile.name == "1g.5gb"
    assert "3g.20gb@4 idle" in decision.after.text()  # created in free slices, the 3g kept


def test_fusion_of_idle_neighbours():
    decision = plan([ones(busy_from=2)], 9 * GIB)
    assert isinstance(decision, Plan)
    assert decision.steps == (
        DestroyInstance(InstanceKey("GPU-a", 0, "1g.5gb")),
        DestroyInstance(InstanceKey("GPU-a", 1, "1g.5gb")),
        CreateInstance(InstanceKey("GPU-a", 0, "2g.10gb")),  # both compute slices: a 1g.10gb would strand one
    )


def test_of_one_memory_footprint_the_most_compute_where_it_costs_no_reachability():
    # 1g.10gb and 2g.10gb both take two memory slices (9856 MiB); the 2g only starts at 0, 2 or 4, and a 1g.10gb
    # at 6 keeps the most layouts open (33 against 22 for a 2g.10gb at 4)
    first = plan([gpu()], 8 * GIB)
    assert isinstance(first, Plan) and first.instance == InstanceKey("GPU-a", 6, "1g.10gb")
    second = plan([first.after.marked(first.instance, busy=True)], 8 * GIB)
    assert isinstance(second, Plan) and second.instance == InstanceKey("GPU-a", 4, "2g.10gb")  # 11 layouts either way
    # 3g.20gb and 4g.20gb both take four: a 3g at 4 keeps 11 layouts, anything at 0 seven; then the 4g at 0
    half = plan([gpu()], 16 * GIB)
    assert isinstance(half, Plan) and half.instance == InstanceKey("GPU-a", 4, "3g.20gb")
    other = plan([half.after.marked(half.instance, busy=True)], 16 * GIB)
    assert isinstance(other, Plan) and other.instance == InstanceKey("GPU-a", 0, "4g.20gb")


def test_a_footprint_reported_a_few_mib_apart_is_still_one_footprint():
    # A card reporting its 2g.10gb 6 MiB below its 1g.10gb: both still hold the need, and reachability decides
    reported = A100.with_reported({"2g.10gb": 9850})
    decision = plan([gpu(geometry=reported)], 8 * GIB)
    assert isinstance(decision, Plan) and decision.instance == InstanceKey("GPU-a", 6, "1g.10gb")


def test_tasks_of_10_10_and_20_gb_all_fit_one_a100_40gb_in_that_order():
    # Taking the most compute first (2g.10gb@4, then 2g.10gb@0) leaves slices 2-3 and 6-7: no 20 GB instance fits
    state, placed = gpu(), []
    for need in (9 * GIB, 9 * GIB, 19 * GIB):
        decision = plan([state], need)
        assert isinstance(decision, Plan), f"refused after {placed}: {decision}"
        state = decision.after.marked(decision.instance, busy=True)
        placed.append(str(decision.instance))
    assert state.text() == "4g.20gb@0 busy | 2g.10gb@4 busy | 1g.10gb@6 busy"


def test_fission_of_an_idle_larger_instance():
    decision = plan([gpu(("4g.20gb", 0, True), ("3g.20gb", 4, False))], 4 * GIB)
    assert isinstance(decision, Plan)
    assert decision.steps == (
        DestroyInstance(InstanceKey("GPU-a", 4, "3g.20gb")),
        CreateInstance(InstanceKey("GPU-a", 6, "1g.5gb")),
    )
    assert decision.after.text() == "4g.20gb@0 busy | free 4-5 | 1g.5gb@6 idle | free 7"


def test_busy_instances_are_never_destroyed_a_refusal_says_why():
    decision = plan([ones(busy_from=1)], 9 * GIB)
    assert decision == Refusal(
        RefusalReason.BLOCKED, "no 1g.10gb / 2g.10gb fits beside the busy instances (idle instances: GPU-a/1g.5gb@0)"
    )


def test_the_margin_counts_toward_the_need():
    decision = plan([gpu()], 4800, margin_mib=100)
    assert isinstance(decision, Plan) and decision.profile.memory_slices == 2  # 4900 MiB > 4864


@pytest.mark.parametrize(
    ("gpus", "need", "reason", "detail"),
    [
        ([gpu()], 50 * GIB, RefusalReason.TOO_LARGE, "51200 MiB is more than 40192 MiB, the largest instance"),
        ([ones(busy_from=0)], GIB, RefusalReason.NO_IDLE_SLICES, "every MIG GPU is filled with busy instances"),
        ([], GIB, RefusalReason.NO_MIG_GPU, "no GPU has MIG mode enabled"),
    ],
)
def test_refusals(gpus, need, reason, detail):
    assert plan(gpus, need) == Refusal(reason, detail)


def test_a_gpu_with_an_idle_fit_wins_over_one_needing_a_reconfiguration():
    needs_fission = gpu(("7g.40gb", 0, False), uuid="GPU-a")
    has_one = gpu(("3g.20gb", 0, True), ("1g.5gb", 5, False), uuid="GPU-b")
    decision = plan([needs_fission, has_one], GIB)
    assert isinstance(decision, Plan) and decision.instance == InstanceKey("GPU-b", 5, "1g.5gb")


def test_a_gpu_refuses_layouts_it_would_not_accept():
    with pytest.raises(InvalidLayout, match=re.escape("1g.5gb@0, 2g.10gb@0 overlap")):
        gpu(("1g.5gb", 0, False), ("2g.10gb", 0, False))
    with pytest.raises(InvalidLayout, match=r"3g.20gb may start at \[0, 4\], not at 2"):
        gpu(("3g.20gb", 2, False))
    with pytest.raises(InvalidLayout, match=r"at most 1 1g.5gb\+me instance"):
        gpu(("1g.5gb+me", 0, False), ("1g.5gb+me", 1, False))


def test_applying_a_plan_refuses_to_destroy_a_busy_instance():
    state = ones(busy_from=2)
    decision = plan([state], 9 * GIB)
    assert isinstance(decision, Plan)
    with pytest.raises(InvalidLayout, match=re.escape("GPU-a/1g.5gb@0 is busy")):
        apply(state.marked(InstanceKey("GPU-a", 0, "1g.5gb"), busy=True), decision)


# ------------------------------------------------------------------ random runs

SETTINGS = settings(
    max_examples=int(os.environ.get("CARMA_HYPOTHESIS_EXAMPLES", 150)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.integers(1, 150 * GIB), st.integers(0, 2 * GIB)),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    max_size=40,
)


def overlapping_or_illegal(state: MigGpu) -> str | None:
    """The GPU's rules checked directly, not through the derived layouts: allowed starts, no shared memory
    slice, compute within the GPU, instance counts."""
    memory, compute, counts = 0, 0, {}
    for i in state.instances:
        if i.start not in i.profile.starts:
            return f"{i} at a start not allowed"
        mask = ((1 << i.profile.memory_slices) - 1) << i.start
        if mask & memory or mask >> state.geometry.memory_slices:
            return f"{i} overlaps or runs past the GPU"
        memory |= mask
        compute += i.profile.compute_slices
        counts[i.profile.name] = counts.get(i.profile.name, 0) + 1
        if counts[i.profile.name] > i.profile.max_count:
            return f"too many {i.profile.name}"
    return "compute slices exceeded" if compute > state.geometry.compute_slices else None


def larger_needs(gpus: dict[str, MigGpu], want: int) -> set[int]:
    """The memory of every profile larger than `want` on these GPUs: a need each is the tightest for."""
    return {p.memory_mib for g in gpus.values() for p in g.geometry.sizing if p.memory_mib and p.memory_mib > want}


@SETTINGS
@given(models=st.lists(st.sampled_from(sorted(MODELS)), min_size=1, max_size=3), ops=OPS)
def test_random_requests_and_releases_keep_every_rule(models, ops):
    gpus = {f"GPU-{k}": MigGpu(f"GPU-{k}", Geometry.of(m)) for k, m in enumerate(models)}
    running: dict[int, tuple[InstanceKey, int]] = {}  # task -> its instance and its need with the margin
    for n, op in enumerate(ops):
        if op[0] == "release":
            if running:
                task = sorted(running)[op[1] % len(running)]
                key, _ = running.pop(task)
                gpus[key.gpu] = gpus[key.gpu].marked(key, busy=False)
            continue
        _, need, margin = op
        decision = plan(list(gpus.values()), need, margin_mib=margin)
        if isinstance(decision, Refusal):
            # Waiting loses nothing: no larger instance could be had either.
            assert all(
                isinstance(plan(list(gpus.values()), more), Refusal) for more in larger_needs(gpus, need + margin)
            )
            continue
        state = gpus[decision.instance.gpu]
        for step in decision.steps:
            if isinstance(step, DestroyInstance):
                assert not state.find(step.key).busy, f"{step.key} destroyed while busy"
        after = apply(state, decision)
        assert after == decision.after, "the plan applied is not the state it predicted"
        assert overlapping_or_illegal(after) is None
        target = after.find(decision.instance)
        assert not target.busy
        assert target.profile.memory_mib is not None and target.profile.memory_mib >= need + margin
        gpus[decision.instance.gpu] = after.marked(decision.instance, busy=True)
        running[n] = (decision.instance, need + margin)
        for key, want in running.values():  # no task lost: each still has its own busy instance, big enough
            held = gpus[key.gpu].find(key)
            assert held.busy and held.profile.memory_mib >= want
        assert len({key for key, _ in running.values()}) == len(running)
