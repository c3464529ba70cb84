"""What every estimator returns, and the small protocol a job function follows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

CAPTURE_TIMEOUT_S = 900.0  # how long `carma estimate`'s capture may take to reach its steps, by default
MAX_BYTES = 1 << 50  # a PiB, beyond any GPU: a larger figure is no estimate


TIMELINE_NOT_WRITTEN = "the timeline was not written"  # a note's start, which `carma estimate` reads


class EstimateError(Exception):
    """An estimate that could not be made, as one line for the user."""


class Exited(EstimateError):
    """The job exited with an error status where it was to train (`sys.exit(2)`, argparse's usage error); why
    is the last line it wrote to stderr, which the process running the capture reads and explains
    (`cuda_on_cpu.explained`, told whether the job had asked if CUDA is available)."""

    def __init__(self, message: str, asked_if_available: bool = False) -> None:
        super().__init__(message)
        self.asked_if_available = asked_if_available


@dataclass(frozen=True)
class Breakdown:
    """Where the predicted peak goes, in bytes (the parts of the peak moment, summing to the total)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0  # activations and temporaries, the batch included
    allocator: int = 0  # caching allocator rounding, caching and fragmentation
    workspaces: int = 0  # modelled, not captured: cuDNN's convolution workspaces alive at the peak
    context: int = 0  # CUDA context and library workspaces

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


@dataclass(frozen=True)
class Estimate:
    method: str
    peak_bytes: int
    breakdown: Breakdown
    device: str
    seconds: float  # how long estimating took
    notes: tuple[str, ...] = ()  # what the user should know about how the job was captured, one line each

    @classmethod
    def checked(cls, data: object, seconds: float) -> Estimate:
        """An estimate from its `to_json` form written by a process that may say anything (a capture child runs
        the job's own code, as its user; a database row of an earlier release), checked field by field:
        ValueError names the field that is not what an estimate holds."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        method, device, parts, notes = (data.get(k) for k in ("method", "device", "breakdown", "notes"))
        if not isinstance(method, str) or not isinstance(device, str):
            raise ValueError("method and device must be text")
        if not isinstance(parts, dict) or not set(parts) <= set(Breakdown.__dataclass_fields__):
            raise ValueError("breakdown must be an object of the parts of a peak")
        notes = [] if notes is None else notes
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise ValueError("notes must be a list of text")
        breakdown = Breakdown(**{name: _bytes(value, name) for name, value in parts.items()})
        return cls(method, _bytes(data.get("peak_bytes"), "peak_bytes"), breakdown, device, seconds, tuple(notes))

    def to_json(self) -> dict[str, Any]:
        """The `--json` output; `notes` only when there are some."""
        result = {
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "breakdown": asdict(self.breakdown),
            "device": self.device,
            "seconds": round(self.seconds, 3),
        }
        return {**result, "notes": list(self.notes)} if self.notes else result


def _bytes(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{name} must be a whole number of bytes from 0 to 2^50")
    return value


def optimizer_parameters(optimizer: Any) -> list[Any]:
    """The tensors a torch optimizer updates, over all its parameter groups."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def tensors_in(value: Any) -> list[Any]:
    """The torch tensors in `value`: itself, or those its mappings, tuples and lists hold, at any depth."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_in(v)]
    return []


@dataclass
class TrainingJob:
    """What a job function (`carma estimate --job module:function`) returns: one training step's parts.

    `loss(model, batch)` runs the forward pass and returns the scalar loss; the estimator runs backward and
    `optimizer.step()` itself. `batch` is a tensor or a tuple/list/dict of tensors, on the CPU.
    """

    model: Any  # torch.nn.Module
    batch: Any
    loss: Callable[[Any, Any], Any]
    optimizer: Any  # torch.optim.Optimizer over model.parameters()


@dataclass
class Capture:
    """What running the first iterations of a job on the CPU yields, for every estimator to work from.

    `job` holds the captured model, the first batch it was called with and the optimizer (its `loss` is
    None when the job came from a script: the script computed its own); `trace` is the PyTorch profiler's
    trace of `steps` training iterations (events as dicts, chrome-trace format), used by xMem. A script
    may train more than one model or step more than one optimizer (a GAN): `job` holds the first
    optimizer to step and the model it trains, `extra_models` the other modules the script called or
    holds that have parameters outside that model (a generator, a frozen teacher, an average of the
    model: their weights are on the GPU too) and `extra_optimizers` the other optimizers that stepped.
    `notes` say where the capture differs from the GPU run (torch.compile left eager, an optimizer that
    never stepped), for the estimate to pass on; `mixed_precision` names the job's (`CUDA autocast`, `CPU
    autocast`, or a library's GPU-only option such as `Accelerate`), which each method notes in its own way
    (`registry.precision_notes`). `cuda_data` holds the tensors the job put on CUDA before its training
    began and held when it stopped (a dataset loaded onto the GPU whole), which no trace shows
    (`capture_storages` sorts them from what the other parts hold).
    """

    job: TrainingJob
    trace: list[dict[str, Any]]
    steps: int
    seconds: float
    extra_models: tuple[Any, ...] = ()
    extra_optimizers: tuple[Any, ...] = ()
    notes: tuple[str, ...] = ()
    mixed_precision: tuple[str, ...] = ()
    cuda_data: tuple[Any, ...] = ()


def storages(tensors: Iterable[Any]) -> dict[int, int]:
    """Storage address -> bytes of the tensors (views of one storage counted once, empty ones left out)."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


@dataclass(frozen=True)
class Storages:
    """Storage address -> bytes of what a captured job holds, by part: what sits on the GPU before training
    (the parameters and buffers of the model and of the other modules the job called or holds, every
    optimizer's parameters), the first batch, the optimizers' state, and `data`: the rest of
    `Capture.cuda_data`, which the job keeps on the GPU for the whole run."""

    parameters: dict[int, int]
    batch: dict[int, int]
    state: dict[int, int]
    data: dict[int, int]


def capture_storages(capture: Capture) -> Storages:
    """The capture's storages by part; `data` is what no other part holds already."""
    job = capture.job
    resident = [job.model, *capture.extra_models]
    optimizers = (job.optimizer, *capture.extra_optimizers)
    parameters = storages(
        [
            *(t for module in resident for t in (*module.parameters(), *module.buffers())),
            *(t for optimizer in optimizers for t in optimizer_parameters(optimizer)),
        ]
    )
    state = storages(t for optimizer in optimizers for s in optimizer.state.values() for t in tensors_in(s))
    batch = storages(tensors_in(job.batch))
    counted = parameters.keys() | state.keys() | batch.keys()
    data = {addr: size for addr, size in storages(capture.cuda_data).items() if addr not in counted}
    return Storages(parameters, batch, state, data)
