"""The caching-allocator model against hand-computed cases (PyTorch 2.x CUDACachingAllocator rules)."""

from __future__ import annotations

import pytest

from carma.estimate.xmem.allocator import (
    MIB,
    CachingAllocator,
    DeviceMemory,
    OutOfMemory,
    fragmentation_allowance,
    round_size,
    segment_size,
)


def test_requests_round_up_to_512_bytes() -> None:
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(3 * MIB + 1) == 3 * MIB + 512


def test_fragmentation_allowance_is_one_more_segment_in_each_pool_in_use() -> None:
    assert fragmentation_allowance([300 * 1024, 512]) == 2 * MIB  # only small blocks: a small-pool segment
    assert fragmentation_allowance([4 * MIB, 512]) == 2 * MIB + 20 * MIB  # a large block under 10 MiB: and 20 MiB
    assert fragmentation_allowance([57 * MIB + 300]) == 2 * MIB + 58 * MIB  # and its own size, rounded to 2 MiB
    assert fragmentation_allowance([]) == 2 * MIB


def test_fragmentation_allowance_takes_the_largest_segment_not_the_largest_request() -> None:
    # A 14.3 MiB block opens a 16 MiB segment, a 4 MiB one a 20 MiB segment: either may be the one that misses.
    assert fragmentation_allowance([4 * MIB, 14 * MIB + 300 * 1024]) == 2 * MIB + 20 * MIB
    assert fragmentation_allowance([4 * MIB, 25 * MIB]) == 2 * MIB + 26 * MIB


def test_segment_sizes_follow_the_pool_and_the_request() -> None:
    assert segment_size(512) == 2 * MIB  # small pool
    assert segment_size(1 * MIB) == 2 * MIB  # 1 MiB is still small
    assert segment_size(1 * MIB + 512) == 20 * MIB  # large pool, under 10 MiB
    assert segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB  # from 10 MiB: its own size, rounded to 2 MiB
    assert segment_size(11 * MIB + 512) == 12 * MIB


def test_small_requests_share_a_2_mib_segment() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1000)
    b = alloc.malloc(1000)
    assert b == a + 1024  # carved one after the other from the same segment
    assert alloc.allocated == 2048
    assert alloc.reserved == 2 * MIB
    assert alloc.segments == 1


def test_small_and_large_pools_do_not_share_segments() -> None:
    alloc = CachingAllocator()
    alloc.malloc(1 * MIB)  # small pool: a 2 MiB segment with 1 MiB left
    alloc.malloc(1 * MIB + 1)  # large pool: cannot use the small remainder, gets 20 MiB
    assert alloc.reserved == 22 * MIB
    assert alloc.segments == 2


def test_large_remainder_of_at_most_1_mib_stays_with_the_block() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(19 * MIB + MIB // 2)  # 20 MiB segment, 0.5 MiB left: not split
    assert alloc.block_size(a) == 20 * MIB
    assert alloc.allocated == 20 * MIB
    b = alloc.malloc(11 * MIB + 512)  # own 12 MiB segment; 1 MiB - 512 left: not split
    assert alloc.block_size(b) == 12 * MIB
    assert alloc.reserved == 32 * MIB


def test_large_remainder_over_1_mib_is_split_and_reused() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(2 * MIB)
    assert alloc.block_size(a) == 2 * MIB
    b = alloc.malloc(18 * MIB)  # exactly the 18 MiB split off the first segment
    assert b == a + 2 * MIB
    assert alloc.reserved == 20 * MIB
    assert alloc.segments == 1


def test_small_pool_splits_any_remainder_of_512_bytes() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1 * MIB)
    b = alloc.malloc(1 * MIB - 512)
    c = alloc.malloc(512)  # the segment's last 512 B, split off b's remainder
    assert (b, c) == (a + 1 * MIB, a + 2 * MIB - 512)
    assert alloc.block_size(b) == 1 * MIB - 512
    assert alloc.segments == 1


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    alloc = CachingAllocator()
    big = alloc.malloc(14 * MIB)
    small = alloc.malloc(12 * MIB)
    alloc.free(big)
    alloc.free(small)
    again = alloc.malloc(11 * MIB)  # both fit; 12 MiB is the best fit
    assert again == small
    assert alloc.block_size(again) == 12 * MIB  # 1 MiB rest: not split
    assert alloc.reserved == 26 * MIB


def test_best_fit_ties_go_to_the_lowest_address() -> None:
    alloc = CachingAllocator()
    first = alloc.malloc(12 * MIB)
    second = alloc.malloc(12 * MIB)
    alloc.free(second)
    alloc.free(first)
    assert alloc.malloc(12 * MIB) == first


def test_freed_neighbours_coalesce() -> None:
    alloc = CachingAllocator()
    x = alloc.malloc(4 * MIB)
    y = alloc.malloc(4 * MIB)
    z = alloc.malloc(4 * MIB)  # the segment's last 8 MiB stay free after z
    assert (y, z) == (x + 4 * MIB, x + 8 * MIB)
    alloc.free(y)
    alloc.free(x)  # x and y merge into one 8 MiB block at x
    merged = alloc.malloc(8 * MIB)  # ties with the 8 MiB tail; the merged block has the lower address
    assert merged == x
    assert alloc.block_size(merged) == 8 * MIB
    alloc.free(merged)
    alloc.free(z)  # everything merges back into the whole segment
    assert alloc.release_cached_segments() == 20 * MIB
    assert alloc.reserved == 0


def test_cached_blocks_are_reused_before_new_segments() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(4 * MIB)
    alloc.free(a)
    assert alloc.allocated == 0
    assert alloc.reserved == 20 * MIB  # cached, not returned
    assert alloc.malloc(4 * MIB) == a
    assert alloc.segments == 1


def test_cached_segments_are_released_only_under_device_pressure() -> None:
    alloc = CachingAllocator(DeviceMemory(capacity=32 * MIB))
    a = alloc.malloc(12 * MIB)
    alloc.free(a)  # a wholly free 12 MiB segment stays cached
    alloc.malloc(14 * MIB)  # does not fit the cached block: new segment, 26 MiB reserved
    assert alloc.reserved == 26 * MIB
    alloc.malloc(16 * MIB)  # 42 MiB would exceed 32: the cached 12 MiB segment is released first
    assert alloc.reserved == 30 * MIB
    assert alloc.segments == 2
    assert alloc.segment_log == [12 * MIB, 14 * MIB, -12 * MIB, 16 * MIB]  # what a GPU trace would show


def test_out_of_memory_when_even_released_segments_do_not_suffice() -> None:
    alloc = CachingAllocator(DeviceMemory(capacity=32 * MIB))
    alloc.malloc(14 * MIB)  # exact 14 MiB segment
    cached = alloc.malloc(12 * MIB)  # exact 12 MiB segment
    alloc.free(cached)
    alloc.malloc(16 * MIB)  # releases the cached 12 MiB segment to fit: 30 MiB reserved
    with pytest.raises(OutOfMemory):
        alloc.malloc(4 * MIB)  # needs a 20 MiB segment; nothing left to release
    assert alloc.reserved == 30 * MIB
    assert alloc.allocated == 30 * MIB


def test_partially_used_segments_are_not_released() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(4 * MIB)
    alloc.malloc(4 * MIB)
    alloc.free(a)
    assert alloc.release_cached_segments() == 0
    assert alloc.reserved == 20 * MIB
