"""xMem's analyzer and orchestrator on a synthetic profiler trace of two training iterations."""

from __future__ import annotations

from typing import Any

import pytest

from carma.estimate.base import EstimateError
from carma.estimate.kernels import META_MARK
from carma.estimate.session import MODULE_MARK, STEP_MARK, split_iterations
from carma.estimate.xmem.allocator import MIB, fragmentation_allowance
from carma.estimate.xmem.analyzer import JobTensors, Phase, analyze, attribute, pair_blocks
from carma.estimate.xmem.orchestrator import Category, GpuBlock, orchestrate
from carma.estimate.xmem.timeline import replay

TID = 1


def mem(ts: float, addr: int, nbytes: int, device_type: int = 0) -> dict[str, Any]:
    args = {"Addr": addr, "Bytes": nbytes, "Device Type": device_type, "Device Id": -1}
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": ts, "tid": TID, "args": args}


def block(alloc: float, free: float | None, addr: int, nbytes: int) -> list[dict[str, Any]]:
    return [mem(alloc, addr, nbytes)] + ([] if free is None else [mem(free, addr, -nbytes)])


def win(cat: str, name: str, start: float, end: float) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "tid": TID, "args": {}}


PARAM, DATASET, TEMP, BATCH0, LABEL0, ACT0, GRAD0, BTEMP0, STATE, STEPTMP0 = range(0x1000, 0x1000 + 10 * 0x100, 0x100)
BATCH1, ACT1, GRAD1 = 0x9000, 0x9100, 0x9200
P = 4 * MIB  # the one parameter's size
NET = f"{MODULE_MARK}Net 0x7f00"  # the window of a call of the model, as the runner names it
JOB = JobTensors(NET, parameters={PARAM: P}, batch={BATCH0: 1 * MIB})


def two_iterations() -> list[dict[str, Any]]:
    """Setup, then two iterations: zero_grad (set_to_none), load, forward, backward, Adam-like step.

    As the runner records it, each optimizer step is a window naming its optimizer, and ProfilerStep#k
    closes right after the k-th.
    """
    events = [
        *block(5, None, DATASET, 3 * MIB),  # script-level: the dataset, kept on the host
        *block(6, 7, TEMP, 1 * MIB),  # script-level temporary
        *block(8, None, PARAM, P),  # the parameter, created at setup
        win("user_annotation", "ProfilerStep#0", 50, 296),
        win("user_annotation", "Optimizer.zero_grad#Adam.zero_grad", 52, 55),
        *block(60, None, BATCH0, 1 * MIB),  # the captured batch (held by the runner: never freed)
        *block(62, 330, LABEL0, 1024),  # labels: freed when the loop rebinds them
        win("user_annotation", NET, 100, 150),
        win("cpu_op", "aten::linear", 105, 140),
        win("cpu_op", "aten::addmm", 108, 139),
        win("cpu_op", "aten::empty", 109, 110),
        *block(109.5, 230, ACT0, 8 * MIB),  # activation, saved for backward
        win("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 200, 240),
        *block(205, 304, GRAD0, P),  # the gradient: freed by the next zero_grad
        *block(207, 220, BTEMP0, 2 * MIB),  # backward temporary
        win("user_annotation", f"{STEP_MARK}0", 250, 297),  # optimizer #0's step, in the runner's window
        win("cpu_op", "aten::zeros_like", 254, 256),
        *block(255, None, STATE, P),  # optimizer state
        *block(260, 270, STEPTMP0, P),  # step temporary
        win("user_annotation", "ProfilerStep#1", 296, 500),
        win("user_annotation", "Optimizer.zero_grad#Adam.zero_grad", 302, 310),
        *block(320, None, BATCH1, 1 * MIB),  # next batch
        win("user_annotation", NET, 350, 400),
        *block(360, 430, ACT1, 8 * MIB),
        win("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 420, 440),
        *block(425, None, GRAD1, P),
        win("user_annotation", f"{STEP_MARK}0", 450, 498),
    ]
    return events


def test_pairing_handles_address_reuse_and_ignores_foreign_events() -> None:
    events = [
        *block(10, 20, 0xA, 100),
        *block(30, None, 0xA, 200),  # the same address again: a new block
        mem(40, 0xB, -64),  # freed, but allocated before profiling: ignored
        mem(50, 0xC, 0),  # zero bytes: ignored
        mem(60, 0xD, 512, device_type=1),  # not host memory: ignored
        mem(70, 0xE, 300),
        mem(80, 0xE, 400),  # allocated again without a recorded free: the first block ends here
    ]
    blocks = [(b.addr, b.size, b.alloc, b.free) for b in pair_blocks(events)]
    assert blocks == [(0xA, 100, 10, 20), (0xA, 200, 30, None), (0xE, 300, 70, 80), (0xE, 400, 80, None)]


def test_blocks_belong_to_the_innermost_window_but_not_to_allocation_primitives() -> None:
    events = two_iterations()
    blocks = pair_blocks(events)
    attribute(blocks, [e for e in events if e.get("ph") == "X"])
    owners = {b.addr: b.owner for b in blocks}
    assert owners[ACT0] == "aten::addmm"  # not aten::empty, not the enclosing linear or module
    assert owners[STATE] == "aten::zeros_like"
    assert owners[GRAD0] == "autograd::engine::evaluate_function: AddmmBackward0"
    assert owners[DATASET] == ""


def test_windows_opening_inside_an_operator_do_not_own_its_blocks() -> None:
    events = [  # a checkpoint's backward running a module's forward again
        win("cpu_op", "autograd::engine::evaluate_function: CheckpointFunctionBackward", 0, 10),
        win("user_annotation", f"{MODULE_MARK}Block 0x7f10", 1, 9),
        *block(2, None, 0xA, 512),
    ]
    blocks = pair_blocks(events)
    attribute(blocks, [e for e in events if e["ph"] == "X"])
    assert blocks[0].owner == "autograd::engine::evaluate_function: CheckpointFunctionBackward"


def test_host_scalars_of_a_skipped_operators_meta_kernel_are_left_out() -> None:
    scalar, output = 0xC000, 0xC100
    events = [
        *two_iterations(),
        win("cpu_op", "aten::gelu", 141, 149),
        win("user_annotation", META_MARK, 142, 144),  # the shape computation the runner runs instead
        *block(143, 143.5, scalar, 8),  # a wrapped Python number of the decomposition
        *block(145, 230, output, 8 * MIB),  # the operator's output, allocated after it
    ]
    kept = {b.addr for b in analyze(events, JOB).blocks}
    assert output in kept and scalar not in kept


def test_analysis_drops_script_temporaries_and_finds_iterations_and_phases() -> None:
    analysis = analyze(two_iterations(), JOB)
    assert analysis.dropped == 2  # the dataset and the setup temporary
    assert analysis.dropped_bytes == 4 * MIB
    first, second = analysis.iterations
    assert (first.start, first.forward, first.backward) == (60, 100, (200, 240))  # starts at its batch
    assert (second.start, second.forward) == (296, 350)
    phases = {b.addr: (b.phase, b.iteration) for b in analysis.blocks}
    assert phases == {
        PARAM: (Phase.PARAMETER, -1),
        BATCH0: (Phase.LOAD, 0),
        LABEL0: (Phase.LOAD, 0),
        ACT0: (Phase.FORWARD, 0),
        GRAD0: (Phase.BACKWARD, 0),
        BTEMP0: (Phase.BACKWARD, 0),
        STATE: (Phase.STEP, 0),
        STEPTMP0: (Phase.STEP, 0),
        BATCH1: (Phase.LOAD, 1),
        ACT1: (Phase.FORWARD, 1),
        GRAD1: (Phase.BACKWARD, 1),
    }


def test_a_forward_no_backward_follows_is_not_the_first_iteration_forward() -> None:
    """A model summary's forward pass (at 20-30, where the runner starts profiling) comes before the
    training loop: the first iteration still starts at its batch. What the call allocated is the
    prelude, on the GPU as the model is; the input the script made before calling it is setup, and so is
    what a data transform that is a module (no model inside) allocates on the host."""
    SUMMARY_IN, SUMMARY_ACT, TRANSFORMED = 0x7000, 0x7100, 0x7200
    events = [
        *block(18, 40, SUMMARY_IN, 512),
        win("user_annotation", NET, 20, 30),
        *block(25, 28, SUMMARY_ACT, 1024),
        win("user_annotation", f"{MODULE_MARK}Normalize 0x7f10", 42, 46),
        *block(43, 58, TRANSFORMED, 2048),
        *two_iterations(),
    ]
    analysis = analyze(events, JOB)
    first = analysis.iterations[0]
    assert (first.start, first.forward) == (60, 100)
    phases = {b.addr: b.phase for b in analysis.blocks}
    assert SUMMARY_IN not in phases and TRANSFORMED not in phases and phases[SUMMARY_ACT] is Phase.PRELUDE
    assert analysis.dropped == 4


def test_analysis_needs_iterations_and_the_model() -> None:
    with pytest.raises(EstimateError, match="no ProfilerStep"):
        analyze([*block(1, None, 0xA, 512)], JOB)
    events = [e for e in two_iterations() if e["name"] != NET]
    with pytest.raises(EstimateError, match="never calls the model"):
        analyze(events, JOB)


def gan_iteration(k: int, t: float) -> list[dict[str, Any]]:
    """A GAN's iteration from `t`: the discriminator's update (optimizer #0), then the generator's (#1),
    each step closing a ProfilerStep window, as the runner records them."""
    return [
        win("user_annotation", f"ProfilerStep#{2 * k}", t, t + 100),
        *block(t + 10, t + 200, 0xB000 + k, 1 * MIB),  # the real batch
        win("user_annotation", NET, t + 20, t + 30),
        win("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", t + 40, t + 50),
        win("user_annotation", f"{STEP_MARK}0", t + 60, t + 99),
        *block(t + 70, None, 0xC000 + k, P),  # the discriminator's state (iteration 0) or a leftover
        win("user_annotation", f"ProfilerStep#{2 * k + 1}", t + 100, t + 200),
        win("user_annotation", f"{MODULE_MARK}Gen 0x7f80", t + 110, t + 120),
        win("user_annotation", NET, t + 121, t + 130),
        win("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", t + 140, t + 150),
        win("user_annotation", f"{STEP_MARK}1", t + 160, t + 199),
        *block(t + 170, None, 0xD000 + k, P),  # the generator's state
    ]


def test_an_iteration_holds_a_step_of_every_optimizer() -> None:
    """Two optimizers stepping in turn (a GAN) make one iteration of two steps, not two iterations; a step
    the runner stopped before it ran (PyTorch's window, not the runner's) is no iteration."""
    events = [
        *gan_iteration(0, 0),
        *gan_iteration(1, 200),
        win("user_annotation", "ProfilerStep#4", 400, 420),
        win("user_annotation", "Optimizer.step#Adam.step", 410, 420),
    ]
    analysis = analyze(events, JobTensors(NET, parameters={PARAM: P}, batch={0xB000: 1 * MIB}))
    assert [(it.start, it.end, it.forward) for it in analysis.iterations] == [(10, 200, 20), (200, 400, 220)]
    assert [it.backward for it in analysis.iterations] == [(40, 150), (240, 350)]
    assert len(analysis.steps) == 4
    phases = {b.addr: (b.phase, b.iteration) for b in analysis.blocks}
    assert phases[0xB001] == (Phase.LOAD, 1)
    assert phases[0xD000] == phases[0xC000] == (Phase.STEP, 0)


@pytest.mark.parametrize(
    ("order", "sizes", "complete"),
    [
        ([0, 0, 0], [1, 1, 1], True),  # one optimizer: a step is an iteration
        ([0], [1], False),  # the first iteration is over only when its optimizer steps again
        ([0, 1, 0, 1, 0, 1], [2, 2, 2], True),  # a GAN: discriminator, generator
        ([0, 1, 0], [2, 1], False),
        ([0, 1, 2, 0, 1, 2], [3, 3], True),
        ([0, 0, 1, 0], [1, 1, 2], True),  # a later optimizer's first step opens an iteration #0's next one closes
    ],
)
def test_optimizer_steps_split_into_iterations(order: list[int], sizes: list[int], complete: bool) -> None:
    assert split_iterations(order) == (sizes, complete)


def lifetimes(blocks: list[Any]) -> list[tuple[Any, ...]]:
    return sorted(((b.category, b.size, b.alloc, b.free) for b in blocks), key=str)


def test_orchestrator_maps_cpu_lifetimes_to_gpu_lifetimes() -> None:
    blocks = orchestrate(analyze(two_iterations(), JOB), JOB)
    assert lifetimes(blocks) == sorted(
        [
            (Category.PARAMETERS, P, float("-inf"), None),  # persistent, resident before the first iteration
            (Category.ACTIVATIONS, 1 * MIB, 60, 296),  # the batch: freed at the end of its iteration
            (Category.ACTIVATIONS, 1024, 62, 296),  # labels too (the CPU freed them later)
            (Category.ACTIVATIONS, 8 * MIB, 109.5, 230),  # activations keep their CPU timing
            (Category.GRADIENTS, P, 205, 302),  # freed at the start of the next zero_grad
            (Category.ACTIVATIONS, 2 * MIB, 207, 220),
            (Category.OPTIMIZER_STATE, P, 255, None),  # persistent from the first step
            (Category.ACTIVATIONS, P, 260, 270),  # a step temporary
            (Category.ACTIVATIONS, 1 * MIB, 320, 500),
            (Category.ACTIVATIONS, 8 * MIB, 360, 430),
            (Category.GRADIENTS, P, 425, None),
        ],
        key=str,
    )


def test_batches_worker_processes_made_are_the_jobs_batch_however_many_the_trace_shows() -> None:
    """Host memory the main process takes for batches a DataLoader's workers made shows in the trace at
    times, one or two of them (prefetched) by chance: the estimate of one script moved by a batch between
    runs. Each iteration holds the job's batch instead, as when none shows."""
    next_batch = win("user_annotation", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 315, 324)
    events = [*two_iterations(), next_batch, *block(321, 480, 0x9900, 1 * MIB)]  # a prefetched batch besides
    job = JobTensors(NET, parameters={PARAM: P}, batch={BATCH0: 1 * MIB})
    second = [b for b in orchestrate(analyze(events, job), job) if b.size == 1 * MIB and b.alloc >= 296]
    assert [(b.alloc, b.free, b.owner) for b in second] == [(296, 500, "batch")]


def test_orchestrator_supplies_what_the_trace_does_not_show() -> None:
    """Parameters allocated before profiling, and a batch for each iteration that loads none."""
    job = JobTensors(NET, parameters={PARAM: P, 0xF000: 2 * MIB}, batch={0xF100: 3 * MIB})
    events = [e for e in two_iterations() if e["args"].get("Addr") != BATCH1]
    analysis = analyze(events, job)
    assert analysis.iterations[0].start == 100  # no captured batch in the trace: it starts at the forward
    assert analysis.dropped == 4  # so the batch and labels allocated before are setup now
    synthetic = [
        b for b in orchestrate(analysis, job) if b.owner in ("batch", "parameters (allocated before profiling)")
    ]
    assert lifetimes(synthetic) == sorted(
        [
            (Category.ACTIVATIONS, 3 * MIB, 100, 296),
            (Category.ACTIVATIONS, 3 * MIB, 296, 500),
            (Category.PARAMETERS, 2 * MIB, float("-inf"), None),
        ],
        key=str,
    )


def test_peak_is_read_in_the_second_iteration_on_top_of_persistent_state() -> None:
    analysis = analyze(two_iterations(), JOB)
    starts = [it.start for it in analysis.iterations]
    sim = replay(orchestrate(analysis, JOB), starts[0], None, starts)
    # Large pool: the parameter opens a 20 MiB segment every later large block fits in (by best fit, split
    # and coalescing); small pool: one 2 MiB segment for batches and labels. Iteration 0 holds at most
    # 19 MiB (its backward); iteration 1's backward holds 21 MiB: its gradient, activation and batch on
    # top of the parameter and the optimizer state created in iteration 0.
    assert sim.peak_reserved == 22 * MIB
    assert sim.segments_at_peak == [2 * MIB, 20 * MIB]
    assert sim.peak_allocated == 21 * MIB
    assert sim.at_peak == {
        Category.PARAMETERS: P,
        Category.GRADIENTS: P,
        Category.OPTIMIZER_STATE: P,
        Category.ACTIVATIONS: 1 * MIB + 8 * MIB,
    }
    assert sim.peak_time == pytest.approx((425 - 60) / 1000)
    assert sim.iteration_starts == [0.0, pytest.approx((296 - 60) / 1000)]
    assert not sim.oom


def test_replay_signals_oom_when_the_device_is_too_small() -> None:
    analysis = analyze(two_iterations(), JOB)
    starts = [it.start for it in analysis.iterations]
    assert replay(orchestrate(analysis, JOB), starts[0], 22 * MIB, starts).oom is False
    assert replay(orchestrate(analysis, JOB), starts[0], 21 * MIB, starts).oom is True


def test_segments_at_the_peak_leave_out_those_released_before_it() -> None:
    blocks = [
        GpuBlock(12 * MIB, Category.ACTIVATIONS, 0, 1, "a"),  # its segment stays cached, wholly free
        GpuBlock(16 * MIB, Category.ACTIVATIONS, 2, None, "b"),  # the device cannot hold both segments
        GpuBlock(1000, Category.ACTIVATIONS, 3, None, "c"),
    ]
    sim = replay(blocks, 0, 20 * MIB)
    assert not sim.oom
    assert sim.segments_at_peak == [2 * MIB, 16 * MIB]


def test_the_allowance_counts_a_large_segment_whose_block_is_gone_at_the_peak() -> None:
    """The reserved peak is reached when only a small block is alive; the 20 MiB segment a freed large
    block opened is still reserved then, and a GPU run could have opened one more: the allowance holds it
    whichever of the equal moments the peak is read at."""
    blocks = [
        GpuBlock(4 * MIB, Category.ACTIVATIONS, 0, 1, "a"),  # opens a 20 MiB segment, freed before the peak
        GpuBlock(1000, Category.ACTIVATIONS, 2, None, "b"),  # opens a 2 MiB segment: the reserved peak
    ]
    sim = replay(blocks, 0)
    assert (sim.peak_reserved, sim.at_peak[Category.ACTIVATIONS]) == (22 * MIB, 1024)
    assert fragmentation_allowance(sim.requests) == 2 * MIB + 20 * MIB
