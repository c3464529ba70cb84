"""A DataLoader's epochs while capturing: its short last batch trained second, and its end reached early.

**The short batch.** A DataLoader whose samples do not divide into its batches (and that does not
`drop_last`) ends every epoch with a shorter batch. The GPU run meets it at each epoch's end: its smaller
tensors are placed in the cached segments around what stays alive across the step, and the full batch after
it can need one segment more than the full batches before it ever did. A capture of a few steps never reaches
an epoch's end, so while capturing, each epoch of a `BatchSampler` (what a DataLoader given `batch_size`
uses) yields its short batch second: [full, short, full, ...], the same batches' sizes in another order,
which puts the step after a short batch among the captured ones (what this changed on the GPUMemNet runs:
docs/estimate.md). A batch of one sample stays last: batch norm cannot train on it, so the GPU run stops
there, with the peak of the steps before it.

**The epoch's end.** What a script does between two epochs runs on the GPU too, and can be its peak: a
validation pass without `torch.no_grad()` keeps one batch's graph alive while it computes the next (CARMA's
UNet task: 9.9 GiB against 6 GiB in training). Once the capture has its steps (`ending`), every epoch yields
no batch past its second: the epoch under way ends, the code after it runs (a validation loader's epoch
included, on two batches), and, when that code called the model in eval mode, the capture takes one step of
the next epoch (`carma.estimate.session`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EPOCH_END_BATCHES = 2  # the batches an epoch yields at most once the capture ends epochs


@contextmanager
def captured_epochs(
    seen: Callable[[int, int, bool], None], ending: Callable[[], bool], opened: Callable[[int], None], reorder: bool
) -> Iterator[None]:
    """Within the block, with `reorder`, a `BatchSampler` epoch of three or more batches whose last is short
    (two samples or more) yields it second, and `seen(short, full, moved)` is called with the two sizes for
    each epoch of full batches and a short one, and whether it was moved (an epoch of two batches has it
    second already). Whenever `ending()` is true, an epoch yields no batch past its `EPOCH_END_BATCHES`-th.
    `opened(+1)` is called as an epoch begins, `opened(-1)` as it ends."""
    from torch.utils.data import BatchSampler

    original = BatchSampler.__iter__

    def batches(self: Any) -> Iterator[list[int]]:
        opened(1)
        try:
            for index, batch in enumerate(reordered(self) if reorder else original(self)):
                if index >= EPOCH_END_BATCHES and ending():
                    return
                yield batch
        finally:
            opened(-1)

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

    BatchSampler.__iter__ = batches  # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchSampler.__iter__ = original  # type: ignore[method-assign]
