"""One entry point for every estimation method, with the device's constant and the time it took."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from carma.estimate.base import Breakdown, Estimate, EstimateError, capture_storages, optimizer_parameters
from carma.estimate.devices import Device, get_device
from carma.estimate.session import CPU_AUTOCAST, CUDA_AUTOCAST
from carma.units import size_text

if TYPE_CHECKING:
    from carma.estimate.base import Capture
    from carma.estimate.gpumemnet import Classifier

METHODS = ("xmem", "faketensor", "horus", "gpumemnet", "history")
CPU_METHODS = METHODS[:-1]  # those that estimate from a CPU capture
_EMULATED = (
    "{} ran as CPU autocast casting as CUDA does (half-precision matrix products, float32 softmax, "
    "normalisations and losses); not yet checked against a GPU run"
)
_LEFT_OUT = "{} counts activations in float32: it leaves out the job's mixed precision ({}), which xmem follows"


def estimate_captured(
    method: str,
    capture: Capture,
    device: str | Device,
    *,
    timeline: str | Path | None = None,
    classifier: Classifier | None = None,
) -> Estimate:
    """Estimate a captured job's peak on `device` (its name, looked up here, or its constants as the process
    that asked for the estimate found them) by `method`; `timeline` (xmem only) is a PNG to draw;
    `classifier` (gpumemnet only) replaces the shipped weights (the accuracy benchmark's, trained without
    the run it judges).

    `seconds` is the whole cost of the estimate: the capture's CPU run plus the method's own work.
    """
    known = device if isinstance(device, Device) else get_device(device)
    device = known.name
    if method == "history":
        raise EstimateError(
            "history is no CPU estimate: it is the observed peak of an earlier run of the same task, "
            "which needs that run recorded by the carma server"
        )
    if method not in CPU_METHODS:
        raise EstimateError(f"unknown method {method!r}; choose one of {', '.join(CPU_METHODS)}")
    if timeline and method != "xmem":
        raise EstimateError("a timeline is drawn by xmem only")
    if classifier and method != "gpumemnet":
        raise EstimateError("a classifier's weights are gpumemnet's only")
    if method != "xmem":
        one_model(capture, method)
    start = time.perf_counter()
    if method == "xmem":
        from carma.estimate.xmem import estimate_xmem

        result = estimate_xmem(
            capture,
            known.context_bytes,
            device,
            device_memory_bytes=known.total_bytes,
            timeline=timeline,
        )
    elif method == "faketensor":
        from carma.estimate.faketensor import estimate_faketensor

        result = estimate_faketensor(capture, known.context_bytes, device)
    elif method == "horus":
        from carma.estimate.horus import estimate_horus

        result = estimate_horus(capture, known.context_bytes, device)
    else:
        from carma.estimate.gpumemnet import estimate_gpumemnet

        result = estimate_gpumemnet(capture, known.context_bytes, device, classifier)
    notes = (*precision_notes(method, capture), *data_notes(method, capture), *result.notes)
    return replace(result, seconds=capture.seconds + time.perf_counter() - start, notes=notes)


def check_steps(method: str, steps: int) -> None:
    """Refuse, before a capture, too few steps for the method: xMem's peak is in the second iteration,
    where the first's optimizer state is alive with the second's activations; one step would hide it."""
    least = 2 if method == "xmem" else 1
    if steps < least:
        why = " (its peak is in the second step, beside the first's optimizer state)" if least > 1 else ""
        raise EstimateError(f"{method} needs at least {least} training steps, not {steps}{why}")


def precision_notes(method: str, capture: Capture) -> tuple[str, ...]:
    """What the estimate makes of the job's mixed precision. xMem follows the capture's trace, where CUDA's
    (and a library's GPU-only) mixed precision ran emulated, cast as on the GPU. The baselines run the
    model anew without the script's autocast, in float32; FakeTensor runs a job function's own loss, in
    which CPU autocast works as written and CUDA autocast, with CUDA hidden, turns itself off."""
    used = capture.mixed_precision
    if method == "xmem":
        emulated = [
            "the job's CUDA autocast (mixed precision)"
            if what == CUDA_AUTOCAST
            else f"{what}'s mixed precision, which it runs only on a GPU,"
            for what in used
            if what != CPU_AUTOCAST
        ]
        return tuple(_EMULATED.format(what) for what in emulated)
    if method == "faketensor" and capture.job.loss is not None:
        used = tuple(what for what in used if what != CPU_AUTOCAST)
    return (_LEFT_OUT.format(method, ", ".join(used)),) if used else ()


def data_notes(method: str, capture: Capture) -> tuple[str, ...]:
    """What the estimate makes of the tensors the job put on CUDA before training and holds (a dataset on
    the GPU, `Capture.cuda_data`): xMem counts them for the whole run; the baselines model the network only."""
    held = sum(capture_storages(capture).data.values())
    if not held:
        return ()
    what = f"{size_text(held)} the job put on CUDA before training and holds (its data, say)"
    if method == "xmem":
        return (f"the {what} are counted as on the GPU for the whole run",)
    return (f"{method} leaves out the {what}, which xmem counts",)


def one_model(capture: Capture, method: str) -> None:
    """Refuse, in one line, a job the baselines cannot see whole: they model one network trained by one
    optimizer, and a script may use more (a GAN, a frozen teacher, an average of the model, a model called
    in parts or as `model.forward(x)`, whose children the capture sees instead). xMem has no such limit."""
    model = capture.job.model
    name = type(model).__name__
    inside = {id(p) for p in model.parameters()}
    if capture.extra_optimizers:
        names = ", ".join(type(o).__name__ for o in (capture.job.optimizer, *capture.extra_optimizers))
        reason = f"steps {1 + len(capture.extra_optimizers)} optimizers ({names})"
    elif any(id(p) not in inside for p in optimizer_parameters(capture.job.optimizer)):
        reason = (
            f"trains parameters outside the {name} taken for the model (a model called as model.forward(x), "
            "or in parts, is seen as its children)"
        )
    elif capture.extra_models:
        names = ", ".join(sorted({type(m).__name__ for m in capture.extra_models}))
        reason = f"uses modules with weights of their own besides the {name} it trains ({names})"
    else:
        return
    raise EstimateError(f"{method} estimates one model trained by one optimizer, and this job {reason}: use xmem")


def history_estimate(observed_peak_bytes: int, device: str) -> Estimate:
    """The peak an earlier run of the task was observed at (NVML, context included), as an estimate.

    The daemon supplies it; the breakdown sets the device's context apart and leaves the rest undivided.
    """
    if observed_peak_bytes <= 0:
        raise EstimateError(f"an observed peak must be positive, got {observed_peak_bytes} bytes")
    context = min(get_device(device).context_bytes, observed_peak_bytes)
    breakdown = Breakdown(activations=observed_peak_bytes - context, context=context)
    return Estimate("history", observed_peak_bytes, breakdown, device, 0.0)
