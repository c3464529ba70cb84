"""A model of PyTorch's CUDA caching allocator on top of a device allocator with a fixed capacity.

Replaying a job's allocation sequence through this model gives the memory the GPU would really reserve:
tensors are served from cached segments, so the footprint is the sum of segment sizes, not of tensor
sizes. The rules follow `c10/cuda/CUDACachingAllocator.cpp` of PyTorch 2.x with the default
configuration (no `expandable_segments`, no `max_split_size_mb`, no `roundup_power2_divisions`, no
garbage-collection threshold, one stream):

- requests are rounded up to a multiple of 512 B (at least 512 B); zero-byte requests get no memory;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large
  pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB otherwise;
- a request takes the best-fitting cached free block of its pool (the smallest that fits, lowest address
  on ties) and is carved from its start; the rest is split off as a new free block when it is at least
  512 B (small pool) or more than 1 MiB (large pool), otherwise it stays with the allocation;
- a freed block merges with free neighbours of its segment and stays cached;
- a new segment is reserved only when no cached block fits; when the device cannot supply it, every
  wholly free cached segment is released and the reservation retried once; only then is it out of memory.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 * MIB  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: segment size for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: from this size a request gets a segment of its own size
ROUND_LARGE = 2 * MIB  # kRoundLarge: granularity of such segments


class OutOfMemory(Exception):
    """The device cannot supply a segment even after every cached segment was released."""

    def __init__(self, request: int, reserved: int, capacity: int) -> None:
        super().__init__(f"cannot reserve {request} B: {reserved} B of {capacity} B already reserved")
        self.request = request


def round_size(size: int) -> int:
    """The block size the allocator hands out for a request of `size` bytes."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def segment_size(rounded: int) -> int:
    """How much a new segment for a rounded request reserves from the device."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


def fragmentation_allowance(requests: Iterable[int]) -> int:
    """Headroom for the allocation order a GPU run takes and the replay cannot see: one more segment in
    each pool, a small-pool one and, when the job makes large requests (`requests`: the bytes each block of
    the replay asked for), the largest segment one of them would open.

    The replay follows the CPU run's order, but on the GPU library workspaces and kernel temporaries the
    CPU never makes (cuBLAS, cuDNN, reductions) shift where blocks land, so a pool can end up holding one
    segment more than the replay's. Which request opens it is not known, so the allowance takes the one
    whose segment is largest: not always the largest request, since a 1-10 MiB block opens a 20 MiB
    segment and a 14 MiB one a 14 MiB segment. Any request of the run may: a segment stays reserved once
    opened (released only under device pressure), so one opened before the peak is still there at it, and
    the reserved peak lasts to the end, so one opened after it adds to a later moment as much. (Taking only
    the blocks alive at the peak moment made the allowance hang on which of several equal moments that
    was.) On the GPUMemNet runs the bare replay's shortfalls were within that much but for a few MiB
    (docs/estimate.md).
    """
    large = (segment_size(r) for r in map(round_size, requests) if r > SMALL_SIZE)
    return SMALL_BUFFER + max(large, default=0)


def _should_split(small: bool, remaining: int) -> bool:
    """Whether the unused rest of a block becomes a free block of its own (`should_split`)."""
    return remaining >= MIN_BLOCK_SIZE if small else remaining > SMALL_SIZE


class DeviceMemory:
    """The device-level allocator (cudaMalloc/cudaFree): reservations succeed while they fit the capacity."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.used = 0

    def reserve(self, size: int) -> bool:
        if self.capacity is not None and self.used + size > self.capacity:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used -= size


@dataclass(eq=False, slots=True)
class _Block:
    """A contiguous piece of a segment, allocated or cached; neighbours link the pieces of one segment."""

    addr: int
    size: int
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False


class CachingAllocator:
    """Best-fit with coalescing over cached segments, as PyTorch's CUDA caching allocator does it.

    `malloc` returns the address of the block it hands out (the key for `free`); `allocated` counts the
    sizes of handed-out blocks (PyTorch's `memory_allocated`), `reserved` the segments
    (`memory_reserved`, what the driver and NVML see besides the CUDA context).
    """

    def __init__(self, device: DeviceMemory | None = None) -> None:
        self.device = device or DeviceMemory()
        self.allocated = 0
        self.reserved = 0
        self.segment_log: list[int] = []  # each segment's size when reserved, minus it when released, in order
        self._next_addr = ROUND_LARGE  # segments get disjoint, increasing addresses
        # Cached free blocks per pool, kept sorted by (size, address) for best fit.
        self._free_keys: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._free: dict[int, _Block] = {}
        self._used: dict[int, _Block] = {}

    def malloc(self, size: int) -> int:
        """Hand out a block for `size` bytes; raises `OutOfMemory` when the device cannot supply it."""
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        block = self._best_fit(small, rounded) or self._new_segment(small, rounded)
        remaining = block.size - rounded
        if _should_split(small, remaining):
            rest = _Block(block.addr + rounded, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._cache(rest)
        block.allocated = True
        self._used[block.addr] = block
        self.allocated += block.size
        return block.addr

    def free(self, addr: int) -> None:
        """Return a block to the cache, merged with its free neighbours."""
        block = self._used.pop(addr)
        block.allocated = False
        self.allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._uncache(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and not nxt.allocated:
            self._uncache(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._cache(block)

    def release_cached_segments(self) -> int:
        """Give every wholly free segment back to the device (`emptyCache`); returns the bytes released."""
        whole = [b for b in self._free.values() if b.prev is None and b.next is None]
        for block in whole:
            self._uncache(block)
            self.device.release(block.size)
            self.reserved -= block.size
            self.segment_log.append(-block.size)
        return sum(b.size for b in whole)

    @property
    def segments(self) -> int:
        """How many segments are reserved."""
        return sum(1 if size > 0 else -1 for size in self.segment_log)

    def block_size(self, addr: int) -> int:
        """The size of the allocated block at `addr` (rounded, and including an unsplit remainder)."""
        return self._used[addr].size

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        keys = self._free_keys[small]
        i = bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = self._free[keys[i][1]]
        self._uncache(block)
        return block

    def _new_segment(self, small: bool, rounded: int) -> _Block:
        size = segment_size(rounded)
        if not self.device.reserve(size):
            self.release_cached_segments()
            if not self.device.reserve(size):
                raise OutOfMemory(size, self.reserved, self.device.capacity or 0)
        self.reserved += size
        self.segment_log.append(size)
        block = _Block(self._next_addr, size, small)
        self._next_addr += size
        return block

    def _cache(self, block: _Block) -> None:
        self._free[block.addr] = block
        insort(self._free_keys[block.small], (block.size, block.addr))

    def _uncache(self, block: _Block) -> None:
        del self._free[block.addr]
        keys = self._free_keys[block.small]
        del keys[bisect_left(keys, (block.size, block.addr))]
