"""xMem end to end: analyze the captured trace, orchestrate GPU lifetimes, replay through the allocator."""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from carma.estimate.base import TIMELINE_NOT_WRITTEN, Breakdown, Capture, Estimate, capture_storages
from carma.estimate.session import module_window
from carma.estimate.xmem.allocator import fragmentation_allowance
from carma.estimate.xmem.analyzer import JobTensors, analyze
from carma.estimate.xmem.orchestrator import Category, conv_workspaces, orchestrate
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
    workspaces: list[int] = field(default_factory=list)  # sizes of the cuDNN workspaces modelled (`conv_workspaces`)


def job_tensors(capture: Capture) -> JobTensors:
    """What the analyzer recognises the job's blocks by (`carma.estimate.base.capture_storages`)."""
    held = capture_storages(capture)
    return JobTensors(module_window(capture.job.model), held.parameters, held.batch, held.state, held.data)


def run_xmem(capture: Capture, capacity: int | None = None, workspace_ratio: float = 0.0) -> XMemResult:
    """The simulated GPU memory of the captured job, with cuDNN's convolution workspaces at
    `workspace_ratio` (`conv_workspaces`); with a `capacity` (device memory less the CUDA context) the
    replay may release cached segments to fit, and `simulation.oom` tells when even that fails (the peak is
    then the unconstrained one, what the job would need)."""
    started = time.perf_counter()
    job = job_tensors(capture)
    analysis = analyze(capture.trace, job)
    workspaces = conv_workspaces(analysis, workspace_ratio)
    blocks = orchestrate(analysis, job) + workspaces
    starts = [it.start for it in analysis.iterations]
    sim = replay(blocks, starts[0], capacity, starts)
    if sim.oom:
        sim = replay(blocks, starts[0], None, starts)
        sim.oom = True
    peak_iteration = bisect_right(sim.iteration_starts, sim.peak_time) - 1
    seconds = time.perf_counter() - started
    sizes = [block.size for block in workspaces]
    return XMemResult(sim, peak_iteration, len(blocks), analysis.dropped, analysis.dropped_bytes, seconds, sizes)


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
    workspace_ratio: float = 0.0,
) -> Estimate:
    """xMem's peak for `device`: the simulated peak of reserved segments, the fragmentation allowance
    (`fragmentation_allowance`) and the device's CUDA context.

    With `device_memory_bytes` the simulation runs against that capacity (see `run_xmem`); a predicted
    OOM shows as a peak above the device memory. `timeline` writes the PNG of the simulated memory.
    `workspace_ratio`: cuDNN's convolution workspaces, modelled (`conv_workspaces`); a note says what the
    estimate models rather than captures.
    """
    capacity = None if device_memory_bytes is None else max(device_memory_bytes - device_context_bytes, 0)
    result = run_xmem(capture, capacity, workspace_ratio)
    sim = result.simulation
    allowance = fragmentation_allowance(sim.requests)
    notes: tuple[str, ...] = ()
    if result.workspaces:
        notes = (
            f"modelled, not captured: cuDNN's workspaces beside the {len(result.workspaces)} blocks convolutions "
            f"allocate in the captured steps, up to {size_text(max(result.workspaces))} each ({workspace_ratio:g} x "
            "the block, the stack's ratio); the context's cuBLAS workspaces are the device's constant",
        )
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
        workspaces=sim.at_peak[Category.WORKSPACES],
        allocator=sim.peak_reserved - sim.allocated_at_peak + allowance,
        context=device_context_bytes,
    )
    peak = sim.peak_reserved + allowance + device_context_bytes
    return Estimate("xmem", peak, breakdown, device, capture.seconds + result.seconds, notes)
