"""An epoch's short last batch, trained second while capturing.

A DataLoader whose samples do not divide into its batches (and that does not `drop_last`) ends every
epoch with a shorter batch. The GPU run meets it at each epoch's end: its smaller tensors are placed in
the cached segments around what stays alive across the step, and the full batch after it can need one
segment more than the full batches before it ever did. A capture of a few steps never reaches an epoch's
end, so while capturing, each epoch of a `BatchSampler` (what a DataLoader given `batch_size` uses)
yields its short batch second: [full, short, full, ...], the same batches' sizes in another order, which
puts the step after a short batch among the captured ones (what this changed on the GPUMemNet runs:
docs/estimate.md). A batch of one sample stays last: batch norm cannot train on it, so the GPU run
stops there, with the peak of the steps before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def short_batch_second(seen: Callable[[int, int, bool], None]) -> Iterator[None]:
    """Within the block, a `BatchSampler` epoch of three or more batches whose last is short (two samples
    or more) yields it second. `seen(short, full, moved)` is called with the two sizes for each epoch of
    full batches and a short one, and whether it was moved (an epoch of two batches has it second already)."""
    from torch.utils.data import BatchSampler

    original = BatchSampler.__iter__

    def reordered(self: Any) -> Iterator[list[int]]:
        try:
            samples = len(self.sampler)
        except TypeError:  # an iterable of unknown length: its epoch's end is unknown too
            samples = 0
        full, short = self.batch_size, samples % self.batch_size
        if self.drop_last or short == 0 or samples < full:
            yield from original(self)
            return
        moved = short >= 2 and samples >= 2 * full + short
        seen(short, full, moved)
        if not moved:
            yield from original(self)
            return
        indices = iter(self.sampler)
        for size in itertools.chain((full, short), itertools.repeat(full)):
            batch = list(itertools.islice(indices, size))
            if not batch:
                return
            yield batch

    BatchSampler.__iter__ = reordered  # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchSampler.__iter__ = original  # type: ignore[method-assign]
