"""xMem's memory orchestrator: CPU lifetimes mapped to the lifetimes the blocks would have on the GPU.

The CPU run executes the same tensors as a GPU run, but a few lifetimes follow the training loop's
semantics rather than the host's timing (xMem section 3.3):

- parameters (and buffers) are moved to the GPU before training and stay for the whole job;
- what the model's calls before training allocated (a model check) keeps its CPU timing;
- the batch lives one iteration: it is freed at the end of its iteration at the latest; an iteration that
  loads nothing (a job function reusing its batch), or whose batches DataLoader worker processes made,
  holds one batch of the first batch's size (the host memory of the workers' batches shows in the trace
  only at times, and one or two of them by chance, as they are prefetched);
- activations and other temporaries keep their CPU timing;
- gradients (blocks the backward pass leaves behind whose size is a parameter's) are freed by
  `optimizer.zero_grad()`, at its start;
- optimizer state (blocks `optimizer.step()` leaves behind) is persistent once created in the first
  step; blocks whose size is a parameter's (Adam's moments, SGD's momentum) are kept to the end. State
  the optimizers held before profiling (loaded from a checkpoint to resume, or made by the constructor,
  as Adagrad's) is resident before the first iteration, like the parameters;
- so is what else the job put on CUDA before training and still holds (a dataset loaded onto the GPU).
The result is the GPU-ordered sequence of allocations and frees the simulator replays, each block
tagged with its category for the breakdown of the peak.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum

from carma.estimate.xmem.analyzer import Analysis, Block, JobTensors, Phase

WORKER_BATCHES = "enumerate(DataLoader)#_MultiProcessingDataLoaderIter"  # its `__next__`'s profiler window


class Category(Enum):
    """The parts of a peak, named as the `Breakdown` fields they add to."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"


@dataclass(slots=True)
class GpuBlock:
    size: int
    category: Category
    alloc: float  # trace time (microseconds); -inf for blocks resident before the first iteration
    free: float | None  # None: alive to the end
    owner: str


def orchestrate(analysis: Analysis, job: JobTensors, prelude: bool = True) -> list[GpuBlock]:
    """GPU lifetimes for the analysed blocks, plus the parameters and batches the trace does not show;
    without the `prelude` (what the model's calls before training allocated) when it is False."""
    parameter_sizes = set(job.parameters.values())
    zero_starts = [s for s, _ in analysis.zero_grads]
    step_starts = [s for s, _ in analysis.steps]
    gpu: list[GpuBlock] = []
    seen_parameters: set[int] = set()
    loads = [0] * len(analysis.iterations)
    for block in analysis.blocks:
        if block.phase is Phase.PARAMETER:
            seen_parameters.add(block.addr)
            gpu.append(GpuBlock(block.size, Category.PARAMETERS, -math.inf, None, block.owner))
            continue
        if block.phase is Phase.PRELUDE:
            if prelude:
                gpu.append(GpuBlock(block.size, Category.ACTIVATIONS, block.alloc, block.free, block.owner))
            continue
        if block.phase is Phase.LOAD and block.owner.startswith(WORKER_BATCHES):
            continue  # the workers' batches in host memory: the iteration's batch is supplied below
        category, free = _map(block, analysis, parameter_sizes, zero_starts, step_starts)
        if block.phase is Phase.LOAD:
            loads[block.iteration] += 1
        gpu.append(GpuBlock(block.size, category, block.alloc, free, block.owner))
    for addr, size in job.parameters.items():
        if addr not in seen_parameters:
            gpu.append(GpuBlock(size, Category.PARAMETERS, -math.inf, None, "parameters (allocated before profiling)"))
    alive = {block.addr for block in analysis.blocks if block.free is None}
    for addr, size in job.state.items():
        if addr not in alive:
            gpu.append(
                GpuBlock(size, Category.OPTIMIZER_STATE, -math.inf, None, "optimizer state (made before profiling)")
            )
    for size in job.data.values():
        gpu.append(GpuBlock(size, Category.ACTIVATIONS, -math.inf, None, "data put on CUDA before training"))
    for k, iteration in enumerate(analysis.iterations):
        if not loads[k]:
            for size in job.batch.values():
                gpu.append(GpuBlock(size, Category.ACTIVATIONS, iteration.start, iteration.end, "batch"))
    return gpu


def _map(
    block: Block,
    analysis: Analysis,
    parameter_sizes: set[int],
    zero_starts: list[float],
    step_starts: list[float],
) -> tuple[Category, float | None]:
    iteration = analysis.iterations[block.iteration]
    if block.phase is Phase.LOAD:
        return Category.ACTIVATIONS, iteration.end if block.free is None else min(block.free, iteration.end)
    if block.phase is Phase.BACKWARD and iteration.backward is not None:
        survives = block.free is None or block.free > iteration.backward[1]
        if survives and block.size in parameter_sizes:
            return Category.GRADIENTS, _zero_grad_start(block.free, analysis.zero_grads, zero_starts)
    if block.phase is Phase.STEP:
        step_end = analysis.steps[bisect_right(step_starts, block.alloc) - 1][1]
        if block.free is None or block.free > step_end:
            return Category.OPTIMIZER_STATE, None if block.size in parameter_sizes else block.free
    return Category.ACTIVATIONS, block.free


def _zero_grad_start(free: float | None, zero_grads: list[tuple[float, float]], starts: list[float]) -> float | None:
    """A gradient freed inside `zero_grad()` is freed when it starts; any other free keeps its time."""
    if free is None:
        return None
    i = bisect_right(starts, free) - 1
    return zero_grads[i][0] if i >= 0 and free <= zero_grads[i][1] else free


def gpu_events(blocks: list[GpuBlock]) -> list[tuple[float, int, int]]:
    """The replay order: (time, kind, block index), frees (0) before allocations (1) at equal times.

    A block whose free is not later than its allocation is freed right after it (kind 2).
    """
    events = [(b.alloc, 1, i) for i, b in enumerate(blocks)]
    events += [(b.free, 0 if b.free > b.alloc else 2, i) for i, b in enumerate(blocks) if b.free is not None]
    events.sort()
    return events
