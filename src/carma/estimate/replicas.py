"""A job that trains on several GPUs with `torch.nn.DataParallel`, captured as its first GPU runs it.

On the CPU DataParallel finds no device and calls its module with the whole batch, so a capture would size one
GPU for every replica's activations. On N GPUs each forward splits the batch along `dim` into N chunks, the
first GPU runs the module (the original, not a copy) on the first chunk while the others run copies on theirs,
and the replicas' outputs are gathered on the first GPU (a scalar loss becomes a vector of N); the backward
pass reduces the copies' gradients into the module's. The first GPU holds the most: the module's weights,
their gradients and the optimizer's state, its share of the activations and every replica's outputs. So, told
the job's GPU count, the capture calls the module on the first chunk only and gathers N outputs of that
chunk's shape, and the module's weights pass through the broadcast's backward as on the GPUs (`_reduce_function`:
the reduced gradients are new tensors, made while the first replica's are still held): the estimate is the first
GPU's, which carma asks of each of the job's GPUs.
`torch.cuda.device_count()` answers N too, so a script that wraps its model only when it sees several GPUs
(PyTorch's tutorial: `if torch.cuda.device_count() > 1`; Hugging Face's Trainer, which then also loads N
devices' batches at once) takes the path it takes on them; PyTorch itself, Accelerate and Lightning get the
machine's count, as they would take the CUDA path on N. The other replicas' outputs are copies of the first's
(their gradients never reach the module, as only their memory matters here). A subclass with a forward or
scatter of its own (mmcv's `MMDataParallel`, PyG's) runs as on the CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from carma.estimate.base import tensors_in
from carma.estimate.session import module_window

NOTE = (
    "the model trains under torch.nn.DataParallel on {gpus} GPUs: the estimate is the first GPU's (its "
    "share of each batch, every replica's outputs, the optimizer's state), the most any of them holds, less "
    "their communication (NCCL's buffers, the gradients' reduction), which it does not size: the server holds "
    "its margin with it"
)


@contextmanager
def data_parallel(gpus: int) -> Iterator[list[int]]:
    """With `gpus` > 1, `torch.nn.DataParallel` behaves as on that many GPUs (see the module's docstring);
    yields a list that gets the replica count of each DataParallel call."""
    import torch

    calls: list[int] = []
    if gpus <= 1:
        yield calls
        return
    from torch.profiler import record_function

    wrapper, gather, reduce = torch.nn.DataParallel, _gather_function(), _reduce_function()
    init, call = wrapper.__init__, wrapper.__call__
    device_count = torch.cuda.device_count

    def own(self: Any) -> bool:
        """DataParallel itself, not a subclass with a scatter or forward of its own (mmcv's, PyG's): those
        run as on the CPU."""
        return all(getattr(type(self), name) is getattr(wrapper, name) for name in _OWN)

    def __init__(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> None:
        init(self, module, device_ids, output_device, dim)
        if own(self):
            self.dim = dim  # on a machine without GPUs DataParallel keeps no `dim`
            self.device_ids = list(range(gpus)) if device_ids is None else list(device_ids)

    def __call__(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        replicas = min(len(self.device_ids), gpus)
        if not own(self) or replicas <= 1:
            return call(self, *inputs, **kwargs)
        # without inputs DataParallel runs one replica; what is not a tensor goes to each
        chunks = _chunk_count((inputs, kwargs), replicas, self.dim) if inputs or kwargs else 1
        calls.append(chunks)
        # the first replica's inputs: each tensor's first chunk (a view: a chunk already on the first GPU is
        # not copied); its outputs gathered with `chunks - 1` others of the same shapes
        first = lambda t: t.chunk(chunks, self.dim)[0]  # noqa: E731
        args, named = _mapped(inputs, first), _mapped(kwargs, first)
        with record_function(module_window(self)):  # the gathered outputs are the call's, before training too
            trained = {name: w for name, w in self.module.named_parameters() if w.requires_grad}
            scripted = isinstance(self.module, torch.jit.ScriptModule)  # the stateless call refuses it
            if chunks > 1 and trained and torch.is_grad_enabled() and not scripted:
                weights = dict(zip(trained, reduce.apply(*trained.values()), strict=True))
                output = torch.func.functional_call(self.module, weights, args, named)
            else:
                output = self.module(*args, **named)
            return _mapped(output, lambda t: gather.apply(t, chunks, self.dim))

    patched = {name: wrapper.__dict__.get(name) for name in ("__init__", "__call__")}
    wrapper.__init__, wrapper.__call__ = __init__, __call__  # type: ignore[method-assign]

    def count() -> int:
        """N to the job's code (and transformers' `TrainingArguments`, which wraps on it); the machine's count
        to PyTorch itself and to the launchers that would take the CUDA path on it (`fork_rng` reading each
        device's state, Lightning and Accelerate choosing CUDA and their distributed strategies)."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return device_count() if caller.partition(".")[0] in _MACHINE_ANSWERED else gpus

    torch.cuda.device_count = count
    try:
        yield calls
    finally:
        torch.cuda.device_count = device_count
        for name, value in patched.items():  # `__call__` is nn.Module's: DataParallel gets none of its own
            if value is None:
                delattr(wrapper, name)
            else:
                setattr(wrapper, name, value)


_OWN = ("forward", "scatter", "gather", "replicate", "parallel_apply")  # what a subclass may change
_MACHINE_ANSWERED = {"torch", "accelerate", "lightning", "lightning_fabric", "pytorch_lightning"}


def _chunk_count(inputs: Any, replicas: int, dim: int) -> int:
    """How many replicas run: as many as the chunks of the smallest tensor input (`torch.chunk` gives fewer
    than asked for a batch smaller than the GPU count); all of them when no input is a tensor."""
    counts = [len(t.chunk(replicas, dim)) for t in tensors_in(inputs)]
    return min(counts, default=replicas)


def _mapped(value: Any, change: Any) -> Any:
    """`value` with `change` applied to each tensor in it, its containers (tuples, named ones too, lists,
    dicts, model outputs) rebuilt around them, anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)._make(_mapped(v, change) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _mapped(v, change)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_mapped(v, change) for v in value)
    return value


def _reduce_function() -> Any:
    """DataParallel's broadcast of the weights, as the first GPU sees it: its replica computes with the module's
    own weights, but their gradients reach the module only through the broadcast's backward, which runs once
    every replica's gradients are in (the end of the backward pass) and reduces them into new tensors there
    (`ReduceAddCoalesced`), while the first replica's are still held: one more copy of the gradients at that
    moment than a module trained without DataParallel holds."""
    import torch

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *weights: Any) -> Any:
            return tuple(w.detach() for w in weights)  # the same memory, and a forward may change it in place

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return tuple(g.clone() for g in grads)

    return Reduce


def _gather_function() -> Any:
    """DataParallel's gather of one output on the first GPU: a new tensor with every replica's part (a
    scalar becomes a vector of them); its gradient's first part goes back to the first replica."""
    import torch

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, part: Any, replicas: int, dim: int) -> Any:
            ctx.scalar = part.dim() == 0
            part = part.unsqueeze(0) if ctx.scalar else part
            ctx.dim, ctx.size = dim, part.size(dim)
            shape = list(part.shape)
            shape[dim] *= replicas
            gathered = part.new_empty(shape)
            for k in range(replicas):  # values a script may read (its loss), not uninitialised memory
                gathered.narrow(dim, k * ctx.size, ctx.size).copy_(part)
            return gathered

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
            first = grad.narrow(ctx.dim, 0, ctx.size)
            return (first.squeeze(0) if ctx.scalar else first), None, None

    return Gather
