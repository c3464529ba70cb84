"""FakeTensor baseline: run training steps on fake tensors and track the bytes of live tensor storages.

PyTorch's `FakeTensorMode` (torch._subclasses.fake_tensor; "Fake Tensor Mode", the PyTorch docs CARMA
cites) runs every operator on tensors that have shapes, dtypes and storages but no data, so a whole training
step costs almost nothing. CARMA's artifact ran only a forward pass this way; here the captured model and
batch are converted to fake tensors and two full steps run (zero_grad with set_to_none, forward, backward,
`optimizer.step()`: the second step's backward has optimizer state, gradients and activations alive at once,
the usual peak). The captured model is deep-copied with its parameters replaced by fake ones, so the
capture stays usable by other estimators.

Peak tracking (`_PeakTracker`, a TorchDispatchMode inside the fake mode) counts each storage once, however
many tensors view it: a storage is live from the first operator output that uses it until the last tensor
object using it is garbage-collected (weakref finalizers; PyTorch keeps a tensor subclass's Python object
alive while C++, e.g. autograd's saved tensors, still holds it). The live bytes at their maximum are the
peak; a snapshot of the live storages at that moment gives the breakdown. There is no allocator model:
no rounding, caching or fragmentation (the `allocator` part stays 0), and the device context is added.

The fake tensors stay on the CPU (a CPU-only PyTorch cannot make fake CUDA tensors), so operators pick
their CPU kernels; optimizers left to choose get `foreach=True`, their default on CUDA
(`kernels.take_cuda_foreach`, as in the capture), so the step's temporaries are those of a GPU run.

Script mode has no loss function (the script computed its own): the surrogate loss is the output's `.loss`
(a transformers model given labels), else the sum of its floating-point tensors, so backward reaches every
parameter the output depends on; a loss computed outside the model is missing from the peak.
"""

from __future__ import annotations

import copy
import inspect
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from carma.estimate.base import Breakdown, Estimate, EstimateError, TrainingJob
from carma.estimate.kernels import take_cuda_foreach

STEPS = 2  # the second step is the first with optimizer state, gradients and activations together


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a value: a tensor, or mappings (model outputs included) and sequences of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors(item)


def call_model(model: Any, batch: Any) -> Any:
    """Call the model the way a script does with this batch: keywords for a mapping, positions for a sequence."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def training_loss(job: TrainingJob, model: Any, batch: Any) -> torch.Tensor:
    """The job's loss, or in script mode (no loss function) the surrogate described in the module docstring."""
    if job.loss is not None:
        return job.loss(model, batch)
    output = call_model(model, batch)
    if getattr(output, "loss", None) is not None:
        return output.loss
    parts = [t.float().sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise EstimateError("the model's output has no tensor that depends on its parameters: nothing to backprop")
    return torch.stack(parts).sum()


def fake_copy(job: TrainingJob, mode: FakeTensorMode) -> tuple[Any, Any, dict[int, Any]]:
    """(model, batch) of the job on fake tensors and the fake of each parameter by id; call inside `mode`.

    The model is deep-copied with its parameters and buffers replaced, so the job is left untouched. The
    optimizer must train the model's parameters only (the registry's `one_model` makes sure).
    """
    memo: dict[int, Any] = {}
    for p in job.model.parameters():
        memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in job.model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    fakes = dict(memo)  # deepcopy adds its own entries to the memo
    model = copy.deepcopy(job.model, memo)
    return model, tree_map_only(torch.Tensor, mode.from_tensor, job.batch), fakes


def fake_optimizer(optimizer: Any, fakes: dict[int, Any]) -> Any:
    """A new optimizer of the same type and hyperparameters over the fake parameters (no state yet)."""
    groups = []
    for group in optimizer.param_groups:
        fake = {**group, "params": [fakes[id(p)] for p in group["params"]]}
        take_cuda_foreach(fake)
        groups.append(fake)
    try:
        return type(optimizer)(groups)
    except TypeError as e:
        raise EstimateError(f"cannot rebuild the optimizer {type(optimizer).__name__} on fake tensors: {e}") from None


def train_step(job: TrainingJob, model: Any, batch: Any, optimizer: Any) -> None:
    """zero_grad, forward, backward and the update; an optimizer whose step needs a closure (L-BFGS
    evaluates the loss again while it searches) is given one doing the first three."""

    def gradients() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = training_loss(job, model, batch)
        loss.backward()
        return loss

    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        optimizer.step(gradients)
    else:
        gradients()
        optimizer.step()


@contextmanager
def values_needed(method: str) -> Iterator[None]:
    """One line for a job that fake tensors cannot run: it reads a tensor's values (`.item()`, a Python
    condition on a tensor, as L-BFGS's step does) or makes a tensor whose shape depends on them."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise EstimateError(
            f"{method} runs the job on fake tensors, which have no values, and this job needs them "
            f"({exc.func}: .item(), a Python condition on a tensor or a shape set by its values); use xmem"
        ) from None


class _PeakTracker(TorchDispatchMode):
    """Live bytes of fake-tensor storages, their peak, and which storages were live at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # serial -> bytes, one serial per storage while it lives
        self.peak_live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._serials: dict[int, int] = {}  # storage address -> serial (addresses are reused, serials not)
        self._users: dict[int, int] = {}  # serial -> tensor objects using the storage
        self._next = 0
        self._at_peak = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tensors(out):
            self.add(t)
        return out

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, FakeTensor) or hasattr(t, "_carma_serial"):
            return
        storage = t.untyped_storage()
        address = storage._cdata
        serial = self._serials.get(address)
        if serial is None:
            serial = self._serials[address] = self._next
            self._next += 1
            self.live[serial] = storage.nbytes()
            self._users[serial] = 0
            self.current += storage.nbytes()
            if self.current > self.peak:
                self.peak, self._at_peak = self.current, True
        t._carma_serial = serial  # type: ignore[attr-defined]
        self._users[serial] += 1
        weakref.finalize(t, self._release, serial, address)

    def serial(self, t: torch.Tensor) -> int | None:
        return getattr(t, "_carma_serial", None)

    def _release(self, serial: int, address: int) -> None:
        self._users[serial] -= 1
        if self._users[serial]:
            return
        if self._at_peak:  # leaving the peak: remember what was live there
            self.peak_live, self._at_peak = dict(self.live), False
        del self._users[serial], self._serials[address]
        self.current -= self.live.pop(serial)

    def live_at_peak(self) -> dict[int, int]:
        return dict(self.live) if self._at_peak else self.peak_live


def estimate_faketensor(capture: Any, context_bytes: int, device: str) -> Estimate:
    """Peak of two training steps of the captured job on fake tensors, plus the device context."""
    start = time.perf_counter()
    job: TrainingJob = capture.job
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # constants the loss closes over become fake
        model, batch, fakes = fake_copy(job, mode)
        optimizer = fake_optimizer(job.optimizer, fakes)
        tracker = _PeakTracker()
        with tracker:
            for t in [*model.parameters(), *model.buffers()]:
                tracker.add(t)
            model_state = {tracker.serial(t) for t in [*model.parameters(), *model.buffers()]}
            for t in tensors(batch):
                tracker.add(t)
            grads: set[int | None] = set()
            with values_needed("faketensor"):
                for _ in range(STEPS):
                    train_step(job, model, batch, optimizer)
                    grads |= {tracker.serial(p.grad) for p in model.parameters() if p.grad is not None}
            state = {tracker.serial(t) for s in optimizer.state.values() for t in tensors(dict(s))}
        at_peak = tracker.live_at_peak()

    def live(serials: set[int | None]) -> int:
        return sum(n for s, n in at_peak.items() if s in serials)

    breakdown = Breakdown(
        parameters=live(model_state),
        gradients=live(grads),
        optimizer_state=live(state),
        activations=sum(n for s, n in at_peak.items() if s not in model_state | grads | state),
        context=context_bytes,
    )
    return Estimate("faketensor", breakdown.total, breakdown, device, time.perf_counter() - start)
