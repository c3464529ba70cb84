"""xMem's simulator: replay the orchestrated sequence through the caching-allocator model.

The replay yields the GPU memory timeline (bytes held by tensors vs bytes reserved in segments), the peak
of reserved memory (what the device must hold besides the CUDA context) and, at the peak moment, how the
tensor bytes split into parameters, gradients, optimizer state and activations.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from carma.estimate.xmem.allocator import CachingAllocator, DeviceMemory, OutOfMemory
from carma.estimate.xmem.orchestrator import Category, GpuBlock, gpu_events

GIB = 1024**3


@dataclass
class Simulation:
    peak_reserved: int
    peak_allocated: int  # the largest tensor footprint at any moment (not necessarily at the reserved peak)
    at_peak: dict[Category, int]  # tensor bytes by category at the peak moment
    peak_time: float  # milliseconds since the first iteration started
    oom: bool  # the device capacity could not hold the sequence even after releasing cached segments
    requests: list[int]  # bytes asked for by each block replayed
    segments_at_peak: list[int] = field(default_factory=list)  # sizes of the segments reserved then, sorted
    times: array = field(default_factory=lambda: array("d"))  # milliseconds, one point per event
    allocated: array = field(default_factory=lambda: array("q"))
    reserved: array = field(default_factory=lambda: array("q"))
    iteration_starts: list[float] = field(default_factory=list)  # milliseconds

    @property
    def allocated_at_peak(self) -> int:
        return sum(self.at_peak.values())


def replay(
    blocks: list[GpuBlock], origin: float, capacity: int | None = None, iteration_starts: Sequence[float] = ()
) -> Simulation:
    """Replay `blocks` in GPU order; the peak moment is the one with most reserved, then most allocated.

    Times are trace microseconds; `origin` (the first iteration's start) becomes time 0 of the timeline.
    With a `capacity` (device memory less the CUDA context) an allocation the device cannot supply ends
    the replay with `oom` set.
    """
    allocator = CachingAllocator(DeviceMemory(capacity))
    events = gpu_events(blocks)
    addrs = [0] * len(blocks)
    held = [0] * len(blocks)
    by_category = dict.fromkeys(Category, 0)
    sim = Simulation(0, 0, dict(by_category), 0.0, False, [block.size for block in blocks])
    sim.iteration_starts = [(t - origin) / 1000 for t in iteration_starts]
    best = (-1, -1)
    peak_log = 0
    # what is resident before the run (the parameters) is drawn at its start: the first iteration's, or
    # the model's calls before it (negative times)
    resident_ms = min([0.0, *((t - origin) / 1000 for t, _, _ in events if t != -math.inf)])
    for t, kind, i in events:
        block = blocks[i]
        if kind == 1:
            try:
                addrs[i] = allocator.malloc(block.size)
            except OutOfMemory:
                sim.oom = True
                break
            held[i] = allocator.block_size(addrs[i])
            by_category[block.category] += held[i]
        else:
            allocator.free(addrs[i])
            by_category[block.category] -= held[i]
        ms = resident_ms if t == -math.inf else (t - origin) / 1000
        sim.times.append(ms)
        sim.allocated.append(allocator.allocated)
        sim.reserved.append(allocator.reserved)
        sim.peak_allocated = max(sim.peak_allocated, allocator.allocated)
        if (allocator.reserved, allocator.allocated) > best:
            best = (allocator.reserved, allocator.allocated)
            sim.at_peak = dict(by_category)
            sim.peak_time = ms
            peak_log = len(allocator.segment_log)
    sim.peak_reserved = max(best[0], 0)
    sim.segments_at_peak = _held_segments(allocator.segment_log[:peak_log])
    return sim


def _held_segments(log: list[int]) -> list[int]:
    """The sizes of the segments a `segment_log` leaves reserved (released ones cancel their reservation)."""
    held = Counter(size for size in log if size > 0)
    held.subtract(-size for size in log if size < 0)
    return sorted(held.elements())


def draw_png(sim: Simulation, path: str | Path, title: str) -> None:
    """Write a PNG of tensor memory (allocated) against segment memory (reserved) over the replay (its folder
    made if need be, as for carma's other outputs)."""
    from carma.pyplot import pyplot

    plt = pyplot()
    unit, scale = ("GiB", GIB) if sim.peak_reserved >= GIB else ("MiB", 1024**2)  # a small job's peak read 0.00 GiB
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(sim.times, [r / scale for r in sim.reserved], where="post", label="reserved (segments)", color="tab:purple")
    ax.fill_between(sim.times, [a / scale for a in sim.allocated], step="post", alpha=0.5, label="allocated (tensors)")
    for k, start in enumerate(sim.iteration_starts):
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(f"iter {k + 1}", (start, 0), xytext=(3, 3), textcoords="offset points", fontsize=8, color="grey")
    peak = sim.peak_reserved / scale  # in the legend: a note at the peak ran off the plot when it came last
    label = f"peak reserved, {peak:.2f} {unit} (the estimate adds the allowance and the CUDA context)"
    ax.axhline(peak, color="tab:red", linestyle="--", linewidth=0.8, label=label)
    ax.plot([sim.peak_time], [peak], marker="o", color="tab:red", markersize=4)
    ax.set_ylim(0, max(peak, 1e-9) * 1.35)  # room above the peak for the legend
    ax.set_xlabel("CPU trace time (ms)")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
