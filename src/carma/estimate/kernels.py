"""What the CPU runs while a training job is captured: the memory of CUDA's kernels, not the CPU's.

Three CPU operators are swapped for the ones CUDA would run, because their memory differs (the estimate
is for the GPU): optimizers use their `foreach` implementation (the CUDA default, whose step allocates a
parameter-sized list of temporaries), dropout uses `native_dropout` (the fused CUDA kernel, saving a
1-byte mask where the CPU saves a float one) and attention is computed without dropout so the CPU takes
its flash kernel (the CUDA flash/efficient kernels apply dropout inside and, like it, never materialise
the attention matrix). Unless the capture is `exact`, the arithmetic of matrix products, convolutions,
attention, dropout, activations, normalisations and softmax is skipped: their outputs are allocated with
the shapes the operator's meta kernel gives (shape errors raised as CUDA's kernels raise them), but not
computed. Memory depends on shapes, not values, so the trace keeps the allocations the GPU makes and the
run takes a fraction of the time (for BERT-base about seven times less). It also drops temporaries that
only the CPU kernels allocate (the CPU batch-norm backward allocates an input-sized one; the CUDA
kernels, only their outputs). Mixed precision's GradScaler, the one common reader of those values, is
told its gradients did not overflow, so its steps run; a script that fails on the values some other way
(a step skipped while the gradient norm is not finite) is captured again computing them
(`carma.estimate.runner`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from carma.estimate.convolutions import Convolution

META_MARK = "carma: meta kernel"  # the trace window of a skipped operator's shape computation

# Operators whose output's shape is set by their input's values (a boolean mask's `x[x > 0]` calls
# nonzero): on uncomputed values they would size their outputs by chance, so the capture stops there,
# unless every value is computed there (`value_free_arithmetic`'s `values_computed`); then those in
# `_COMPUTED` run (the others have no kernel of their own here and still stop it).
VALUE_SHAPED = (
    "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "repeat_interleave.Tensor", "bincount",
)  # fmt: skip
values_read: list[str] = []  # those the job called with the arithmetic skipped (the capture is then redone)
# Whether this process has skipped arithmetic yet: a job that failed before would fail the same way computing it.
skipping = False


class ValuesRead(RuntimeError):
    """A value-shaped operator called on what may be uncomputed values."""


def take_cuda_foreach(group: dict[str, Any]) -> None:
    """An optimizer param group left to choose its implementation takes `foreach`, its default on CUDA
    (whose step allocates a parameter-sized list of temporaries); fused and differentiable ones keep theirs."""
    if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
        group["foreach"] = True


@contextmanager
def cuda_like_operators() -> Iterator[None]:
    """Dropout and attention as their CUDA kernels allocate (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    dropout, attention = F.dropout, F.scaled_dot_product_attention

    def fused_dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, training)[0]
        return dropout(input, p, training, inplace)

    def attention_without_dropout(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            args = (args[0], 0.0, *args[2:])
        else:
            kwargs["dropout_p"] = 0.0
        return attention(query, key, value, *args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = fused_dropout, attention_without_dropout
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, attention


# The operators CUDA autocast runs in float32 (PyTorch's `fp32` and `fp32_set_opt_dtype` cast policies for
# CUDA; the second keeps a dtype the call gives), where CPU autocast runs most of them in half precision:
# pointwise math, softmax, normalisations, reductions, distances, losses and upsampling.
CUDA_FLOAT32_OPERATORS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
    "frobenius_norm", "nuclear_norm", "norm", "linalg_vector_norm", "linalg_matrix_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "softmax", "log_softmax", "cumprod", "cumsum", "prod", "sum",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
)  # fmt: skip


@contextmanager
def cuda_autocast() -> Iterator[list[str]]:
    """Mixed precision as CUDA runs it, on the CPU; yields the device type ("cuda", "cpu", ...) of each
    autocast region the job entered enabled.

    With CUDA hidden, `torch.autocast("cuda")` (and `torch.cuda.amp.autocast`) would turn itself off and
    leave the job in float32; it becomes CPU autocast in CUDA's default dtype (float16) instead. And every
    CPU autocast region, whichever device the script named, casts as CUDA's does: matrix products and
    convolutions in half precision (both agree there), `CUDA_FLOAT32_OPERATORS` in float32, where CPU
    autocast would keep half precision (a float32 softmax of the attention scores takes twice the bytes)."""
    import torch
    from torch.amp.autocast_mode import autocast

    regions: list[str] = []
    original_init = autocast.__init__

    def init(self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
        if enabled:
            regions.append(device_type)
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.get_autocast_dtype("cuda")
        original_init(self, device_type, dtype, enabled, cache_enabled)

    library = torch.library.Library("aten", "IMPL")
    autocast.__init__ = init  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
            for name in CUDA_FLOAT32_OPERATORS:
                for overload in _overloads(name):
                    library.impl(overload.name().removeprefix("aten::"), _in_float32(overload), "AutocastCPU")
        yield regions
    finally:
        autocast.__init__ = original_init  # type: ignore[method-assign]
        library._destroy()


def _overloads(name: str) -> list[Any]:
    """The functional overloads of `aten::name` in this PyTorch (none if it has no such operator)."""
    import torch

    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return [op for op in overloads if not op._schema.is_mutable]


def _in_float32(op: Any) -> Callable[..., Any]:
    """An autocast kernel running `op` on float32 copies of its half-precision tensors, unless it is given a
    dtype (as CUDA's `fp32_set_opt_dtype` policy does)."""
    import torch
    from torch.utils._pytree import tree_map_only

    below_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype") if "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("dtype") if at is None or at >= len(args) else args[at]
        if given is None:
            args, kwargs = tree_map_only(torch.Tensor, _float32, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(below_autocast):
            return op(*args, **kwargs)

    return kernel


def _float32(tensor: Any) -> Any:
    return tensor.float() if tensor.is_floating_point() else tensor  # a float32 tensor is returned as it is


@contextmanager
def value_free_arithmetic(values_computed: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Replace the CPU kernels of the costly operators by ones that allocate their outputs, uncomputed.

    A value-shaped operator (`VALUE_SHAPED`) called where `values_computed()` says every value is computed
    (outside the model's calls, its backward and the optimizer's step: a masked-LM collator's boolean
    masks, drawn from `torch.bernoulli`) runs on the real values; elsewhere it ends the capture, which is
    redone computing everything (for BERT-base's masked LM, 25 times slower).

    Outputs are left uninitialised (zeroing them took a BERT-base capture from 10 s to 15-19 s): nearly nothing
    downstream depends on their values for its memory; what does, an operator whose output's shape its input's
    values set (`VALUE_SHAPED`), raises `ValuesRead` instead, and the capture is redone. Matrix products get
    their (contiguous) output shape directly, checked as CUDA's kernels check it (a shape bug crashes the
    capture as it crashes the job); the others take shapes and strides from the operator's meta kernel, run in a
    `META_MARK` window: some meta kernels (Python decompositions) make host scalars, which the analysis leaves
    out. Autograd is untouched (it sits above the CPU kernels), and so is every other operator. One operator
    reads the values: mixed precision's overflow check, whose finding makes `GradScaler` skip `optimizer.step()`
    (uncomputed values often hold infinities or NaNs). It works in place, allocating nothing, so it becomes a
    no-op: its `found_inf` stays at the zero GradScaler set, and the steps run, as nearly all of a real run's
    do.
    """
    import torch
    from torch.profiler import record_function

    aten = torch.ops.aten

    def product(shape_of: Callable[..., tuple[int, ...]]) -> Callable[..., Any]:
        return lambda *args, **kwargs: torch.empty(shape_of(*args), dtype=args[1].dtype)

    def by_meta(op: Any) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with record_function(META_MARK):  # the host scalars a meta kernel makes are not the job's
                meta = op(*map(_to_meta, args), **{k: _to_meta(v) for k, v in kwargs.items()})
            return _allocate(meta)

        return kernel

    def marked(kernel: Callable[..., Any], geometry: Callable[..., Any]) -> Callable[..., Any]:
        def in_window(*args: Any, **kwargs: Any) -> Any:
            with record_function(geometry(*args, **kwargs).mark()):  # the cuDNN workspace xMem models there
                return kernel(*args, **kwargs)

        return in_window

    kernels = {
        "mm": product(_matrices),
        "addmm": product(lambda bias, a, b, *_: _matrices(a, b)),
        "bmm": product(_batches),
        "baddbmm": product(lambda bias, a, b, *_: _batches(a, b)),
        "convolution": marked(by_meta(aten.convolution.default), _forward_convolution),
        "convolution_backward": marked(by_meta(aten.convolution_backward.default), _backward_convolution),
        "_scaled_dot_product_flash_attention_for_cpu": by_meta(
            aten._scaled_dot_product_flash_attention_for_cpu.default
        ),
        "_scaled_dot_product_flash_attention_for_cpu_backward": by_meta(
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        ),
        "native_dropout": by_meta(aten.native_dropout.default),
        # Activations, normalisations and softmax: their inputs come from the products above, so their
        # outputs would hold meaningless values anyway; they are most of what is left of the time.
        **{
            name: by_meta(getattr(aten, name).default)
            for name in (
                "native_dropout_backward",
                "gelu",
                "gelu_backward",
                "silu",
                "silu_backward",
                "native_layer_norm",
                "native_layer_norm_backward",
                "native_group_norm",
                "native_group_norm_backward",
                "native_batch_norm",
                "native_batch_norm_backward",
                "_softmax",
                "_softmax_backward_data",
                "_log_softmax",
                "_log_softmax_backward_data",
            )
        },
        "_amp_foreach_non_finite_check_and_unscale_": lambda grads, found_inf, inv_scale: None,
        **{name: _value_shaped(name, values_computed) for name in VALUE_SHAPED},
    }
    global skipping
    values_read.clear()
    skipping = True
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
            for name, kernel in kernels.items():
                library.impl(name, kernel, "CPU")
        yield
    finally:
        library._destroy()  # restores the original kernels


def _value_shaped(name: str, values_computed: Callable[[], bool]) -> Callable[..., Any]:
    """A kernel that computes the operator where `values_computed()` and it has a kernel here (`_COMPUTED`),
    and elsewhere records the call and raises: the capture is redone computing every value
    (`carma.estimate.runner`), also when the job catches the error and goes on."""
    computed = _COMPUTED.get(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if computed is not None and values_computed():
            return computed(*args, **kwargs)
        values_read.append(name)
        raise ValuesRead(f"{name}: an output shaped by values the capture left uncomputed")

    return kernel


def _nonzero(x: Any) -> Any:
    """`torch.nonzero` by NumPy (the CPU kernel is overridden), into a tensor of PyTorch's allocator, whose
    allocation the profiler records."""
    import numpy as np
    import torch

    found = np.argwhere(x.detach().ne(0).numpy())
    return torch.empty(found.shape, dtype=torch.long).copy_(torch.from_numpy(found))


def _masked_select(x: Any, mask: Any) -> Any:
    """`torch.masked_select` by NumPy, as `_nonzero`."""
    import numpy as np
    import torch

    shape = torch.broadcast_shapes(x.shape, mask.shape)
    values = np.broadcast_to(x.detach().numpy(), shape)[np.broadcast_to(mask.detach().numpy(), shape)]
    return torch.empty(values.shape, dtype=x.dtype).copy_(torch.from_numpy(np.ascontiguousarray(values)))


_COMPUTED = {"nonzero": _nonzero, "masked_select": _masked_select}


def _matrices(a: Any, b: Any) -> tuple[int, int]:
    """The shape of `a @ b`, refused as CUDA's kernel refuses it: a script's shape bug crashes its capture."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"{'self' if a.dim() != 2 else 'mat2'} must be a matrix")
    if a.shape[1] != b.shape[0]:
        shapes = f"{a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]}"
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({shapes})")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return a.shape[0], b.shape[1]


def _batches(a: Any, b: Any) -> tuple[int, int, int]:
    """The shape of a batched `a @ b`, refused as CUDA's kernel refuses it."""
    if a.dim() != 3 or b.dim() != 3:
        raise RuntimeError(f"{'batch1' if a.dim() != 3 else 'batch2'} must be a 3D tensor")
    if (b.shape[0], b.shape[1]) != (a.shape[0], a.shape[2]):
        raise RuntimeError(
            f"Expected size for first two dimensions of batch2 tensor to be: [{a.shape[0]}, {a.shape[2]}] but got: "
            f"[{b.shape[0]}, {b.shape[1]}]."
        )
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected batch1 and batch2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return a.shape[0], a.shape[1], b.shape[2]


def _forward_convolution(
    input: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, *rest: Any
) -> Convolution:
    """The geometry of an `aten::convolution` call (`carma.estimate.convolutions`)."""
    groups = rest[-1]
    output = _output_size(input.shape[2:], weight.shape[2:], stride, padding, dilation, transposed, rest[0])
    return Convolution(
        False, tuple(input.shape), tuple(weight.shape), output, tuple(stride), tuple(dilation), groups, transposed,
        input.element_size(),
    )  # fmt: skip


def _backward_convolution(
    grad_output: Any, input: Any, weight: Any, bias_sizes: Any, stride: Any, padding: Any, dilation: Any,
    transposed: bool, output_padding: Any, groups: int, output_mask: Any,
) -> Convolution:  # fmt: skip
    """The geometry of an `aten::convolution_backward` call, with the gradients it computes."""
    return Convolution(
        True, tuple(input.shape), tuple(weight.shape), tuple(grad_output.shape[2:]), tuple(stride), tuple(dilation),
        groups, transposed, input.element_size(), bool(output_mask[0]), bool(output_mask[1]),
    )  # fmt: skip


def _output_size(
    size: Any, kernel: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any
) -> tuple[int, ...]:
    """The spatial size of a convolution's output, by PyTorch's formula (stride, padding and dilation may be
    given once for every dimension)."""

    def at(values: Any, i: int) -> int:
        return values[i] if len(values) > 1 else values[0]

    out = []
    for i, (n, k) in enumerate(zip(size, kernel, strict=True)):
        span = at(dilation, i) * (k - 1)
        if transposed:
            out.append((n - 1) * at(stride, i) - 2 * at(padding, i) + span + at(output_padding, i) + 1)
        else:
            out.append((n + 2 * at(padding, i) - span - 1) // at(stride, i) + 1)
    return tuple(out)


def _to_meta(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, list):
        return [_to_meta(v) for v in x]
    return x


def _allocate(meta: Any) -> Any:
    import torch

    if isinstance(meta, torch.Tensor):
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
    if isinstance(meta, tuple | list):
        return type(meta)(_allocate(m) for m in meta)
    return meta
