"""xMem's analyzer: from a CPU profiler trace to memory blocks attributed to the training loop.

The trace (chrome-trace events of `torch.profiler` with `profile_memory=True`, and the capture session's windows
around module calls and optimizer steps) has `[memory]` instants (address, signed byte count) but no
link between them and the code that caused them. The analyzer pairs each allocation with the next free
of the same address (an address freed and allocated again starts a new block), attributes each block to
the innermost operator window around its allocation, and places it in a phase of a training iteration.
The session puts every optimizer step in a window naming the optimizer that made it and ends a
`ProfilerStep#k` window there; an iteration is the windows of its steps, grouped as the session counted
them (`split_iterations`: one step each for one optimizer, a step of each for a GAN's two). The first
one starts at its batch or at the model's first training forward (the first call a backward pass
follows), so what the script did before (building the dataset, initialising the model) is left out,
except the parameters and buffers, which live on the GPU for the whole job, and what calls of the model
before it allocated (a model check, a summary's forward pass): they run where the model is, and what they hold
stays reserved by the caching allocator (a check on a batch twice the size of the training one's, with
gradients on, can be the job's peak).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from carma.estimate.base import EstimateError
from carma.estimate.convolutions import Convolution
from carma.estimate.kernels import META_MARK
from carma.estimate.session import CLOSURE_MARK, MODULE_MARK, STEP_MARK, split_iterations

MEMORY_EVENT = "[memory]"
CPU_DEVICE = 0  # "Device Type" of memory events on the host
WINDOW_CATEGORIES = ("cpu_op", "user_annotation")
ITERATION_PREFIX = "ProfilerStep#"
ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
# Windows that never explain an allocation: the allocation primitives every operator calls (empty,
# empty_strided, empty_like).
_PLUMBING = "aten::empty"


class Phase(Enum):
    PARAMETER = "parameter"  # the model's parameters and buffers, alive before the loop and after it
    PRELUDE = "prelude"  # inside a module call before the first iteration (a model check): on the GPU
    LOAD = "load"  # allocated before the iteration's forward: the batch
    FORWARD = "forward"  # forward pass and loss
    BACKWARD = "backward"
    ZERO_GRAD = "zero_grad"
    STEP = "step"  # inside optimizer.step()


@dataclass(frozen=True)
class JobTensors:
    """What the analyzer needs to know about the live job, to recognise its blocks by address."""

    model_window: str  # name of the trace window of the model's calls (`session.module_window`)
    parameters: dict[int, int]  # storage address -> bytes, of parameters and buffers
    batch: dict[int, int]  # storage address -> bytes, of the first batch's tensors
    # storage address -> bytes, of the optimizers' state when the capture ended: state made before
    # profiling (a resumed checkpoint's, Adagrad's from its constructor) is in no trace
    state: dict[int, int] = field(default_factory=dict)
    # storage address -> bytes, of the rest the job put on CUDA before training and holds (its dataset)
    data: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class Block:
    """One allocation's lifetime in the CPU run (microseconds; `free` None = still alive at the end)."""

    addr: int
    size: int
    alloc: float
    free: float | None
    tid: Any = None  # thread that allocated
    owner: str = ""  # innermost profiler window around the allocation
    phase: Phase = Phase.FORWARD
    iteration: int = -1  # -1 for parameters and the prelude


@dataclass(frozen=True)
class Iteration:
    start: float
    end: float
    forward: float  # start of the model's first forward in this iteration
    backward: tuple[float, float] | None  # first to last autograd function of this iteration


@dataclass
class Analysis:
    blocks: list[Block]  # parameters and blocks of the training iterations, by allocation time
    iterations: list[Iteration]
    steps: list[tuple[float, float]]  # optimizer.step() windows
    zero_grads: list[tuple[float, float]]  # optimizer.zero_grad() windows
    dropped: int  # script-level blocks left out (allocated outside the training iterations)
    dropped_bytes: int
    # each convolution call of the training iterations (`carma.estimate.convolutions`): when its window
    # ends (its outputs allocated), its geometry, and whether it ran in a backward pass
    convolutions: list[tuple[float, Convolution]] = field(default_factory=list)


def analyze(events: list[dict[str, Any]], job: JobTensors) -> Analysis:
    windows = [e for e in events if e.get("ph") == "X" and e.get("cat") in WINDOW_CATEGORIES]
    blocks = _outside_meta_kernels(pair_blocks(events), windows)
    attribute(blocks, windows)
    steps, owners = _marked_steps(windows)
    zero_grads = _spans(windows, "user_annotation", ZERO_GRAD_PREFIX)
    iterations = _iterations(windows, steps, owners, blocks, job)
    kept: list[Block] = []
    dropped = dropped_bytes = 0
    starts = [it.start for it in iterations]
    in_steps, in_zero_grads = _Windows(steps), _Windows(zero_grads)
    in_closures = _Windows(_spans(windows, "user_annotation", CLOSURE_MARK))
    in_prelude = _Windows(_prelude(windows, job.model_window, starts[0]))
    for block in blocks:
        if block.addr in job.parameters and block.free is None:
            block.phase = Phase.PARAMETER
            kept.append(block)
            continue
        k = bisect_right(starts, block.alloc) - 1
        if k < 0 and block.alloc in in_prelude:
            block.phase = Phase.PRELUDE
            kept.append(block)
            continue
        if k < 0 or block.alloc > iterations[k].end:
            dropped += 1
            dropped_bytes += block.size
            continue
        block.iteration = k
        block.phase = _phase(block.alloc, iterations[k], in_steps, in_closures, in_zero_grads)
        kept.append(block)
    convolutions = []
    for w in windows:
        if (conv := Convolution.parse(w["name"])) is not None:
            end = w["ts"] + w.get("dur", 0.0)
            k = bisect_right(starts, end) - 1
            if k >= 0 and end <= iterations[k].end:
                convolutions.append((end, conv))
    convolutions.sort(key=lambda c: c[0])
    return Analysis(kept, iterations, steps, zero_grads, dropped, dropped_bytes, convolutions)


def pair_blocks(events: list[dict[str, Any]]) -> list[Block]:
    """Host memory blocks from the `[memory]` events, by allocation time.

    An allocation closes a block still open at its address (its free was not recorded); a free with no
    open block belongs to memory allocated before profiling and is ignored.
    """
    memory = [
        e
        for e in events
        if e.get("name") == MEMORY_EVENT and e["args"].get("Device Type") == CPU_DEVICE and e["args"].get("Bytes")
    ]
    memory.sort(key=lambda e: e["ts"])  # stable: equal timestamps keep the profiler's order
    open_blocks: dict[int, Block] = {}
    blocks: list[Block] = []
    for e in memory:
        addr, size, ts = e["args"]["Addr"], e["args"]["Bytes"], e["ts"]
        if size > 0:
            stale = open_blocks.get(addr)
            if stale is not None:
                stale.free = ts
            block = Block(addr, size, ts, None, e.get("tid"))
            open_blocks[addr] = block
            blocks.append(block)
        else:
            block = open_blocks.pop(addr, None)
            if block is not None:
                block.free = ts
    return blocks


def _outside_meta_kernels(blocks: list[Block], windows: list[dict[str, Any]]) -> list[Block]:
    """The blocks less those allocated in a `META_MARK` window of their thread: host scalars of the shape
    computations the capture runs instead of skipped operators, which no GPU run makes."""
    spans: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for w in windows:
        if w["cat"] == "user_annotation" and w["name"] == META_MARK:
            spans[w.get("tid")].append((w["ts"], w["ts"] + w.get("dur", 0.0)))
    inside = {tid: _Windows(sorted(thread_spans)) for tid, thread_spans in spans.items()}
    return [b for b in blocks if b.tid not in inside or b.alloc not in inside[b.tid]]


def attribute(blocks: list[Block], windows: list[dict[str, Any]]) -> None:
    """Set each block's owner: the innermost window of its thread whose span contains its allocation.

    One sweep per thread over windows sorted by start (outer first on ties) and blocks in allocation
    order, keeping the stack of windows still open. Other windows opening inside an operator (a module
    a checkpoint's backward runs again) are skipped, so such an allocation belongs to the operator.
    """
    spans_by_thread: dict[Any, list[tuple[float, float, str, bool]]] = defaultdict(list)
    for w in windows:
        name = w["name"]
        if not name.startswith(_PLUMBING):
            start = w["ts"]
            spans_by_thread[w.get("tid")].append((start, start + w.get("dur", 0.0), name, w["cat"] == "cpu_op"))
    blocks_by_thread: dict[Any, list[Block]] = defaultdict(list)
    for block in blocks:
        blocks_by_thread[block.tid].append(block)
    for tid, thread_blocks in blocks_by_thread.items():
        spans = sorted(spans_by_thread.get(tid, ()), key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str, bool]] = []
        ops = 0  # operators on the stack
        i = 0
        for block in thread_blocks:
            t = block.alloc
            while i < len(spans) and spans[i][0] <= t:
                span = spans[i]
                i += 1
                while stack and stack[-1][1] < span[0]:
                    ops -= stack.pop()[3]
                if span[3] or not ops:
                    stack.append(span)
                    ops += span[3]
            while stack and stack[-1][1] < t:
                ops -= stack.pop()[3]
            if stack:
                block.owner = stack[-1][2]


def _spans(windows: list[dict[str, Any]], category: str, prefix: str) -> list[tuple[float, float]]:
    return sorted(
        (w["ts"], w["ts"] + w.get("dur", 0.0)) for w in windows if w["cat"] == category and w["name"].startswith(prefix)
    )


def _marked_steps(windows: list[dict[str, Any]]) -> tuple[list[tuple[float, float]], list[int]]:
    """The optimizer steps the session put in windows of their own (the steps that ran to their end), and
    the optimizer of each (its index in the order optimizers first stepped)."""
    marked = sorted(
        (w["ts"], w["ts"] + w.get("dur", 0.0), int(w["name"][len(STEP_MARK) :]))
        for w in windows
        if w["cat"] == "user_annotation" and w["name"].startswith(STEP_MARK)
    )
    return [(start, end) for start, end, _ in marked], [index for _, _, index in marked]


def _iterations(
    windows: list[dict[str, Any]],
    steps: list[tuple[float, float]],
    owners: list[int],
    blocks: list[Block],
    job: JobTensors,
) -> list[Iteration]:
    # The session calls profiler.step() from the optimizer's post-hook, so ProfilerStep#k closes right
    # after the k-th step's window: an iteration runs from the ProfilerStep window of its first step to
    # the end of that of its last.
    profiler_steps = _spans(windows, "user_annotation", ITERATION_PREFIX)
    windows_of_steps = [next(((s, e) for s, e in profiler_steps if s <= start <= e), None) for start, _ in steps]
    if not steps or None in windows_of_steps:
        raise EstimateError("the trace has no ProfilerStep window with an optimizer step")
    bounds, first = [], 0
    for size in split_iterations(owners)[0]:
        bounds.append((windows_of_steps[first][0], windows_of_steps[first + size - 1][1]))
        first += size
    forwards = sorted(w["ts"] for w in windows if w["cat"] == "user_annotation" and w["name"] == job.model_window)
    backward_ops = sorted(
        (w["ts"], w["ts"] + w.get("dur", 0.0))
        for w in windows
        if w["cat"] == "cpu_op" and w["name"].startswith(BACKWARD_PREFIX)
    )
    backward_starts = [s for s, _ in backward_ops]
    iterations = []
    for k, (start, end) in enumerate(bounds):
        # The first forward may open before ProfilerStep#0 does: the session starts profiling from it.
        earliest = -math.inf if k == 0 else start
        calls = [t for t in forwards if earliest <= t <= end]
        forward = _training_forward(calls, backward_starts) if k == 0 else next(iter(calls), None)
        if forward is None:
            model = job.model_window.removeprefix(MODULE_MARK).split()[0]  # its class, not its identity
            raise EstimateError(
                f"iteration {k} never calls the model (a {model}): xMem reads each iteration's forward pass from "
                "the model's call, so a job function's loss must call the model itself, not only its parts "
                "(wrap a container such as nn.ModuleDict in a module whose forward runs them)"
            )
        if k == 0:
            start = _first_iteration_start(start, forward, blocks, job.batch)
        inside = [(s, e) for s, e in backward_ops if start <= s <= end]
        backward = (inside[0][0], max(e for _, e in inside)) if inside else None
        iterations.append(Iteration(start, end, forward, backward))
    return iterations


def _training_forward(calls: list[float], backward_starts: list[float]) -> float | None:
    """The first of the model's calls that a backward pass follows before the next call: a script's calls
    before training (a model summary, a warm-up, an evaluation without gradients) are not its forward."""
    for t, following in zip(calls, [*calls[1:], math.inf], strict=False):
        i = bisect_right(backward_starts, t)
        if i < len(backward_starts) and backward_starts[i] < following:
            return t
    return calls[0] if calls else None


def _first_iteration_start(window_start: float, forward: float, blocks: list[Block], batch: dict[int, int]) -> float:
    """The first iteration starts where its batch was allocated, or else at the model's first forward."""
    batch_allocs = [
        b.alloc
        for b in blocks
        if b.addr in batch and window_start <= b.alloc <= forward and (b.free is None or b.free > forward)
    ]
    return min([forward, *batch_allocs])


def _prelude(windows: list[dict[str, Any]], model_window: str, first: float) -> list[tuple[float, float]]:
    """The outermost module calls before the iteration starting at `first` that call the model (a check, a
    summary, DataParallel around it): what they allocate is on the GPU, where the model is. Other calls (a
    data transform that is a module) may run on the host."""
    model = [(w["ts"], w["ts"] + w.get("dur", 0.0)) for w in windows if w["name"] == model_window]
    outer = _merged(s for s in _spans(windows, "user_annotation", MODULE_MARK) if s[1] < first)
    return [(start, end) for start, end in outer if any(start <= s and e <= end for s, e in model)]


def _merged(spans: Any) -> list[tuple[float, float]]:
    """Time windows, nested or overlapping ones merged into the outermost: disjoint and sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class _Windows:
    """Disjoint time windows, sorted, asked whether they hold a moment."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self.spans = spans
        self.starts = [start for start, _ in spans]

    def __contains__(self, t: float) -> bool:
        i = bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.spans[i][1]


def _phase(t: float, iteration: Iteration, steps: _Windows, closures: _Windows, zero_grads: _Windows) -> Phase:
    if t in steps and t not in closures:  # a closure's forward and backward are no part of the update
        return Phase.STEP
    if t in zero_grads:
        return Phase.ZERO_GRAD
    if iteration.backward is not None and iteration.backward[0] <= t <= iteration.backward[1]:
        return Phase.BACKWARD
    if t < iteration.forward:
        return Phase.LOAD
    return Phase.FORWARD
