"""Horus baseline: GPU memory as a formula over a model summary, as CARMA used it.

Horus (Yeung et al., "Horus: Interference-Aware and Prediction-Based Scheduling in Deep Learning Systems",
IEEE TPDS 33(1), 2022) predicts a job's GPU memory analytically from its model summary; CARMA (section 3.4)
describes it as "an analytical formula based on #activations, #parameters, batch_size, and #gradients".
The formula here:

    parameters + gradients + optimizer state + activations + device context

- parameters: the bytes of every parameter and buffer; gradients: those of the trainable parameters;
- optimizer state: the trainable bytes times the optimizer's per-parameter state copies, by type
  (`STATE_COPIES`: 0 for SGD without momentum, 1 with it, 2 for Adam/AdamW, 3 with amsgrad, ...);
- activations: the sum of every layer's output (leaf modules, forward hooks) for the captured batch, which
  already has the batch dimension, i.e. "activations times batch size" of a per-sample summary.

No allocator, no temporaries, no lifetimes: everything is counted as if alive at once, and what happens
outside modules (functional attention, the loss) is not counted. CARMA's artifact
(itu-rad/CARMA, workloads/ehsan-horus_estimator.py) computed `activations * batch + parameters +
batch * gradients` in fp32 bytes from a torchsummary printout; we keep those terms but count gradients
once (one per parameter, as PyTorch holds them), with real element sizes, and add the optimizer state and
the device context.

The summary's forward runs on fake tensors (see `carma.estimate.faketensor`), so it costs no real compute.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from carma.estimate.base import Breakdown, Estimate, EstimateError, TrainingJob
from carma.estimate.faketensor import call_model, fake_copy, tensors, values_needed


@dataclass(frozen=True)
class ModelSummary:
    """What a model summary (torchsummary-like) says about a job: sizes, layer types and outputs."""

    parameters: int  # elements of the parameters, as a model summary counts them
    parameter_bytes: int  # parameters and buffers: the model's state on the GPU
    trainable_bytes: int
    layers: Counter[str]  # leaf modules by class name
    weight_layers: int  # Linear and convolution layers: the depth
    activations: int  # elements of all leaf-module outputs for the whole batch
    activation_bytes: int
    batch_size: int


def summarize(job: TrainingJob) -> ModelSummary:
    """Summarize the job's model by one forward pass of its batch on fake tensors, with hooks on leaf modules."""
    outputs: list[torch.Tensor] = []
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        model, batch, _ = fake_copy(job, mode)
        leaves = [m for m in model.modules() if not any(True for _ in m.children())]
        hooks = [m.register_forward_hook(lambda _m, _i, out: outputs.extend(tensors(out))) for m in leaves]
        try:
            with values_needed("horus"):
                job.loss(model, batch) if job.loss is not None else call_model(model, batch)
        finally:
            for hook in hooks:
                hook.remove()
    state = list(job.model.parameters()) + list(job.model.buffers())
    first = next(tensors(job.batch), None)
    if first is None or first.dim() == 0:
        raise EstimateError("the batch holds no tensor with a batch dimension")
    return ModelSummary(
        parameters=sum(p.numel() for p in job.model.parameters()),
        parameter_bytes=sum(_nbytes(t) for t in state),
        trainable_bytes=sum(_nbytes(p) for p in job.model.parameters() if p.requires_grad),
        layers=Counter(type(m).__name__ for m in leaves),
        weight_layers=sum(isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd) for m in leaves),
        activations=sum(t.numel() for t in outputs),
        activation_bytes=sum(_nbytes(t) for t in outputs),
        batch_size=first.shape[0],
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Per-parameter state tensors of PyTorch's optimizers, each the size of its parameter (scalar step counters
# left out); a callable reads the hyperparameters of the parameter group.
STATE_COPIES: dict[str, Any] = {
    "SGD": lambda g: 1 if g.get("momentum") else 0,
    "Adam": lambda g: 3 if g.get("amsgrad") else 2,
    "AdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "RMSprop": lambda g: 1 + bool(g.get("momentum")) + bool(g.get("centered")),
    "Adagrad": lambda g: 1,
    "Adadelta": lambda g: 2,
    "Adamax": lambda g: 2,
    "NAdam": lambda g: 2,
    "RAdam": lambda g: 2,
    "Rprop": lambda g: 2,
}


def optimizer_state_bytes(optimizer: Any) -> int:
    """The optimizer's state by the formula: trainable bytes of each group times its state copies."""
    copies = STATE_COPIES.get(type(optimizer).__name__)
    if copies is None:
        raise EstimateError(
            f"Horus has no state rule for the optimizer {type(optimizer).__name__} "
            f"(known: {', '.join(STATE_COPIES)}); use --method xmem"
        )
    return sum(
        copies(group) * sum(_nbytes(p) for p in group["params"] if p.requires_grad) for group in optimizer.param_groups
    )


def estimate_horus(capture: Any, context_bytes: int, device: str) -> Estimate:
    start = time.perf_counter()
    job: TrainingJob = capture.job
    summary = summarize(job)
    breakdown = Breakdown(
        parameters=summary.parameter_bytes,
        gradients=summary.trainable_bytes,
        optimizer_state=optimizer_state_bytes(job.optimizer),
        activations=summary.activation_bytes,
        context=context_bytes,
    )
    return Estimate("horus", breakdown.total, breakdown, device, time.perf_counter() - start)
