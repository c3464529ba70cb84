"""What a capture records of each convolution, for the cuDNN workspace the estimate models beside it.

A CPU run allocates no cuDNN workspace, and the trace's memory events carry no shapes, so while the
arithmetic is skipped (`carma.estimate.kernels`) each convolution call runs inside a profiler window whose
name is its geometry (`Convolution.mark`); xMem reads those windows back (`Convolution.parse`) and replays
the workspace cuDNN would take there (`carma.estimate.xmem.orchestrator.conv_workspaces`). No PyTorch here:
the estimating side reads the marks without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CONV_MARK = "carma: convolution"


@dataclass(frozen=True)
class Convolution:
    """One convolution call: `forward`, or `backward` with the gradients it computes (`input_grad`,
    `weight_grad`); shapes as PyTorch's `aten::convolution` takes them (N, C, *spatial; K, C/groups,
    *kernel), `output` the output's spatial size."""

    backward: bool
    input: tuple[int, ...]
    weight: tuple[int, ...]
    output: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool
    itemsize: int
    input_grad: bool = False
    weight_grad: bool = False

    def mark(self) -> str:
        fields = (
            "bwd" if self.backward else "fwd",
            _ints(self.input),
            _ints(self.weight),
            _ints(self.output),
            _ints(self.stride),
            _ints(self.dilation),
            str(self.groups),
            "t" if self.transposed else "n",
            str(self.itemsize),
            ("i" if self.input_grad else "") + ("w" if self.weight_grad else "") or "-",
        )
        return f"{CONV_MARK} {' '.join(fields)}"

    @classmethod
    def parse(cls, name: str) -> Convolution | None:
        """The convolution a window's name marks, or None for any other window."""
        if not name.startswith(CONV_MARK + " "):
            return None
        kind, x, w, out, stride, dilation, groups, transposed, itemsize, grads = name[len(CONV_MARK) + 1 :].split()
        return cls(
            kind == "bwd",
            _tuple(x),
            _tuple(w),
            _tuple(out),
            _tuple(stride),
            _tuple(dilation),
            int(groups),
            transposed == "t",
            int(itemsize),
            "i" in grads,
            "w" in grads,
        )

    @property
    def kernel(self) -> tuple[int, ...]:
        return self.weight[2:]

    @property
    def batch(self) -> int:
        return self.input[0]

    @property
    def in_channels(self) -> int:
        return self.input[1]

    @property
    def out_channels(self) -> int:
        return self.weight[0] if not self.transposed else self.weight[1] * self.groups

    def input_bytes(self) -> int:
        return math.prod(self.input) * self.itemsize

    def output_bytes(self) -> int:
        return self.batch * self.out_channels * math.prod(self.output) * self.itemsize


def _ints(values: tuple[int, ...]) -> str:
    return "x".join(map(str, values)) or "-"


def _tuple(text: str) -> tuple[int, ...]:
    return () if text == "-" else tuple(int(v) for v in text.split("x"))


WINOGRAD_TILE = 4  # F(4x4, 3x3): each 4x4 output tile computed from a 6x6 input tile
WINOGRAD_POINTS = (WINOGRAD_TILE + 2) ** 2  # values of a tile in the transformed domain


def winograd_eligible(conv: Convolution) -> bool:
    """Whether cuDNN can run the call with its Winograd engines, whose workspace holds transformed tensors:
    2-D, 3x3 filters, stride 1, no dilation, not grouped, not transposed (cuDNN's documented support of
    `CUDNN_CONVOLUTION_*_ALGO_WINOGRAD_NONFUSED`). Depthwise, 1x1 and strided convolutions run implicit-GEMM
    engines that need no workspace to speak of."""
    return (
        not conv.transposed
        and conv.groups == 1
        and conv.kernel == (3, 3)
        and conv.stride == (1, 1)
        and conv.dilation == (1, 1)
    )


def cudnn_workspace(conv: Convolution) -> int:
    """The workspace, in bytes, cuDNN may take for the call: for a Winograd-eligible one, the larger of its
    two activation-sized tensors (the input side's C channels, the output side's K) in the F(4x4, 3x3)
    transformed domain: 36 values per 4x4 output tile, per channel and image (Lavin and Gray, "Fast
    Algorithms for Convolutional Neural Networks", 2016; cuDNN documents WINOGRAD_NONFUSED as needing
    "significant workspace ... to store intermediate results"). The same for the backward pass, whose data
    gradient transforms the output's gradient and the input's, and whose filter gradient the input and
    the output's gradient. 0 for every other call.

    Which engine cuDNN's heuristics choose is known on the GPU only (PyTorch's `Conv_v8.cpp` runs the first
    whose workspace it can allocate, `torch.backends.cudnn.benchmark` off); this is the size of the
    transform-based ones, the largest of those a dense 3x3 convolution gets."""
    if not winograd_eligible(conv):
        return 0
    tiles = conv.batch * math.prod(-(-n // WINOGRAD_TILE) for n in conv.output)
    return WINOGRAD_POINTS * tiles * max(conv.in_channels, conv.out_channels) * conv.itemsize
