"""The shapes of the model's inputs in each captured iteration of a script.

A collate that pads each batch to its longest item, or images of varying sizes, give batches whose shapes
change from one iteration to the next: the capture trains only its first few, and a larger batch later in
the GPU run needs more memory than the estimate, which nothing in the trace shows. When the captured
iterations' inputs already differ, the user is told so.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from carma.estimate.base import tensors_in
from carma.estimate.session import split_iterations

Shapes = tuple[tuple[int, ...], ...]


class InputShapes:
    """The training calls of outermost modules with parameters (grad enabled, module in training mode: not
    an evaluation's), by how many optimizer steps came before each."""

    def __init__(self) -> None:
        self._calls: list[tuple[int, int, Shapes]] = []  # (steps before the call, module id, input shapes)

    def record(self, steps: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        if torch.is_grad_enabled() and module.training:
            shapes = tuple(tuple(t.shape) for t in tensors_in((args, kwargs)))
            self._calls.append((steps, id(module), shapes))

    def note(self, order: Sequence[int], short_batch: tuple[int, int] | None) -> list[str]:
        """A note when the iterations (by `order`, the session's steps) gave the modules inputs of different
        shapes. Compared are the shapes each module was called with in an iteration, not how often: a
        WGAN's critic is called once more in the iterations its generator steps. What is no difference: the
        first iteration's calls before each module's last (a summary's forward pass), shapes missing from an
        iteration the stop cut short, and an epoch's short batch moved second (`short_batch`: its size and
        the full one)."""
        sizes, complete = split_iterations(order)
        ends = list(itertools.accumulate(sizes))
        iterations: list[dict[tuple[int, Shapes], None]] = [{} for _ in range(len(sizes) + 1)]
        for steps, module, shapes in self._calls:
            k = bisect_right(ends, steps)
            if k == 0:  # each module's last call only
                iterations[0] = {call: None for call in iterations[0] if call[0] != module}
            iterations[k][(module, _as_full(shapes, short_batch))] = None
        whole = len(sizes) if complete else len(sizes) - 1
        first, later = set(iterations[0]), [set(calls) for calls in iterations[1:whole] if calls]
        cut = [set(calls) for calls in iterations[max(whole, 1) :] if calls]
        if not later and not cut:
            return []
        reference = later[0] if later else set.union(*cut)
        first = {call for call in first if any(call[0] == module for module, _ in reference)}  # not a warm-up's
        if all(calls == reference for calls in later) and all(calls <= reference for calls in (first, *cut)):
            return []
        each = [calls for calls in (first, *later, *cut) if calls]
        flat = [{shape for _, shapes in calls for shape in shapes} for calls in each]
        shown = [_shape(s) for s in sorted(set.union(*flat) - set.intersection(*flat), key=math.prod)]
        which = f" ({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''})" if shown else ""
        return [
            f"the model's inputs differed between the {len(each)} captured iterations{which}: batches padded "
            "to their longest item, or images of varying sizes, differ later too, and a larger batch than those "
            "captured needs more memory than this estimate (capture more with --steps, or train the largest "
            "batch first)"
        ]


def _as_full(shapes: Shapes, short_batch: tuple[int, int] | None) -> Shapes:
    """The shapes with the short batch's size read as the full batch's."""
    if short_batch is None:
        return shapes
    short, full = short_batch
    return tuple(tuple(full if n == short else n for n in shape) for shape in shapes)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"
