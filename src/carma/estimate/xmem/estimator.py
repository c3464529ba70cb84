"""xMem end to end: analyze the captured trace, orchestrate GPU lifetimes, replay through the allocator."""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from carma.estimate.base import TIMELINE_NOT_WRITTEN, Breakdown, Capture, Estimate, capture_storages
from carma.estimate.convolutions import Convolution, cudnn_workspace
from carma.estimate.session import module_window
from carma.estimate.xmem.allocator import fragmentation_allowance, round_size, segment_size
from carma.estimate.xmem.analyzer import Analysis, JobTensors, Phase, analyze
from carma.estimate.xmem.orchestrator import Category, GpuBlock, orchestrate
from carma.estimate.xmem.timeline import Simulation, draw_png, replay
from carma.units import size_text


@dataclass
class XMemResult:
    simulation: Simulation  # peak, breakdown at the peak, timeline
    peak_iteration: int  # the iteration holding the peak moment (0-based; -1 before the first)
    blocks: int  # blocks replayed
    dropped: int  # script-level blocks left out
    dropped_bytes: int
    seconds: float  # analysis and simulation
    workspace: Workspace = field(default_factory=lambda: Workspace(0, 0, None))  # cuDNN's, modelled


@dataclass(frozen=True)
class Workspace:
    """The largest cuDNN workspace of the run (`largest_workspace`): the bytes cuDNN asks for, the segment
    the caching allocator opens for them (`segment`, added to the peak) and the convolution that takes it."""

    size: int
    segment: int
    convolution: Convolution | None


def job_tensors(capture: Capture) -> JobTensors:
    """What the analyzer recognises the job's blocks by (`carma.estimate.base.capture_storages`)."""
    held = capture_storages(capture)
    return JobTensors(module_window(capture.job.model), held.parameters, held.batch, held.state, held.data)


def largest_workspace(analysis: Analysis) -> Workspace:
    """The largest cuDNN workspace a convolution of the training iterations takes (`cudnn_workspace`), and
    the segment it opens.

    No CPU kernel allocates it. On the GPU, PyTorch allocates each call's workspace through the caching
    allocator just before the kernel and frees it after (`aten/src/ATen/native/cudnn/Conv_v8.cpp`,
    `run_conv_plan`): served from a cached free block when one fits, else from a new segment of its own
    size rounded up to 2 MiB, which stays reserved. It is not replayed: which engine, and so which workspace,
    each call gets is known on the GPU only, and one workspace more or less at one call moves where every
    later block lands (replaying a share of each call's size moved VGG-16's estimate by -20% to +40%, not
    in order of the share). The estimate adds the segment of the largest one to the replay's peak, as if the
    caching allocator had nothing cached to serve it when it was asked for at the peak: conservative by up
    to its size (a dense 3x3 convolution near the input of a large-batch ImageNet CNN: 1.7 GiB for VGG-16 at
    batch 64), and 0 for a network without Winograd-eligible convolutions (an MLP, a transformer, MobileNet)."""
    size, conv = max(((cudnn_workspace(c), c) for _, c in analysis.convolutions), default=(0, None), key=lambda s: s[0])
    if not size:
        return Workspace(0, 0, None)
    return Workspace(size, segment_size(round_size(size)), conv)


def run_xmem(capture: Capture, capacity: int | None = None) -> XMemResult:
    """The simulated GPU memory of the captured job, and the largest cuDNN workspace (`largest_workspace`);
    with a `capacity` (device memory less the CUDA context) the replay may release cached segments to fit,
    and `simulation.oom` tells when even that fails (the peak is then the unconstrained one, what the job
    would need)."""
    started = time.perf_counter()
    job = job_tensors(capture)
    analysis = analyze(capture.trace, job)
    blocks = orchestrate(analysis, job)
    sim = _replayed(blocks, analysis, capacity)
    if any(block.phase is Phase.PRELUDE for block in analysis.blocks):
        # The segments the model's calls before training leave reserved can only add to the peak: a replay
        # placing the training's blocks in them may pack them better than the caching allocator does.
        training = orchestrate(analysis, job, prelude=False)
        without = _replayed(training, analysis, capacity)
        if without.peak_reserved > sim.peak_reserved:
            blocks, sim = training, without
    peak_iteration = bisect_right(sim.iteration_starts, sim.peak_time) - 1
    workspace = largest_workspace(analysis)
    seconds = time.perf_counter() - started
    return XMemResult(sim, peak_iteration, len(blocks), analysis.dropped, analysis.dropped_bytes, seconds, workspace)


def _replayed(blocks: list[GpuBlock], analysis: Analysis, capacity: int | None) -> Simulation:
    """The replay of `blocks` (see `run_xmem` for `capacity`)."""
    starts = [it.start for it in analysis.iterations]
    sim = replay(blocks, starts[0], capacity, starts)
    if sim.oom:
        sim = replay(blocks, starts[0], None, starts)
        sim.oom = True
    return sim


def plot_timeline(result: XMemResult, path: str | Path, device: str = "") -> None:
    """PNG of tensor memory (allocated) against segment memory (reserved) over the simulated iterations."""
    where = f" on {device}" if device else ""
    k = result.peak_iteration
    when = f"in iteration {k + 1}" if k >= 0 else "before the first iteration"  # counted from 1, as the docs do
    draw_png(result.simulation, path, f"xMem{where}: peak {when}")


def estimate_xmem(
    capture: Capture,
    device_context_bytes: int,
    device: str,
    *,
    device_memory_bytes: int | None = None,
    timeline: str | Path | None = None,
) -> Estimate:
    """xMem's peak for `device`: the simulated peak of reserved segments, the fragmentation allowance
    (`fragmentation_allowance`), the segment of the largest cuDNN workspace (`largest_workspace`) and the
    device's CUDA context.

    With `device_memory_bytes` the simulation runs against that capacity (see `run_xmem`); a predicted
    OOM shows as a peak above the device memory. `timeline` writes the PNG of the simulated memory. A note
    says what the estimate models rather than captures.
    """
    capacity = None if device_memory_bytes is None else max(device_memory_bytes - device_context_bytes, 0)
    result = run_xmem(capture, capacity)
    sim = result.simulation
    allowance = fragmentation_allowance(sim.requests)
    workspace = result.workspace
    notes: tuple[str, ...] = ()
    if workspace.convolution is not None:
        notes = (workspace_note(workspace),)
    if timeline:
        try:
            plot_timeline(result, timeline, device)
        except OSError as e:  # the folder changed since it was checked: the estimate is still worth its capture
            notes = (*notes, f"{TIMELINE_NOT_WRITTEN}: {e}")
    breakdown = Breakdown(
        parameters=sim.at_peak[Category.PARAMETERS],
        gradients=sim.at_peak[Category.GRADIENTS],
        optimizer_state=sim.at_peak[Category.OPTIMIZER_STATE],
        activations=sim.at_peak[Category.ACTIVATIONS],
        workspaces=workspace.segment,
        allocator=sim.peak_reserved - sim.allocated_at_peak + allowance,
        context=device_context_bytes,
    )
    peak = sim.peak_reserved + allowance + workspace.segment + device_context_bytes
    return Estimate("xmem", peak, breakdown, device, capture.seconds + result.seconds, notes)


def workspace_note(workspace: Workspace) -> str:
    """What the estimate models rather than captures, for a job whose convolutions take a cuDNN workspace."""
    conv = workspace.convolution
    assert conv is not None
    shape = "x".join(map(str, conv.input[2:]))
    call = f"{conv.in_channels}->{conv.out_channels} channels at {shape}, batch {conv.batch}"
    return (
        f"modelled, not captured: the {size_text(workspace.segment)} segment of cuDNN's largest convolution "
        f"workspace ({size_text(workspace.size)}, a Winograd transform of the 3x3 convolution {call}), added to "
        "the peak; the context's cuBLAS workspaces are the device's constant"
    )
