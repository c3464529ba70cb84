"""A job that names CUDA, captured on the CPU all the same.

The capture hides CUDA, so a script that falls back to the CPU when CUDA is absent runs unchanged. Many
do not: they call `model.cuda()`, `batch.to("cuda")` or `torch.zeros(n, device="cuda")`, synchronise,
or load a checkpoint saved on a GPU. While a job is captured those requests are kept on the CPU, where
a falling-back script would have put the same tensors (`.cuda()` and `.to("cuda")` of a CPU tensor hand it
back, as `.to("cpu")` does), so the trace and the estimate are those of the CPU fallback. Streams and
events (a data prefetcher's side stream, CUDA-event timing) run as the CPU's one stream, whose operators
have finished when they return: waiting is done at once, and an event's time is the CPU's. A random
generator made for CUDA (`torch.Generator(device="cuda")`, seeding a sampler or noise) is the CPU's. What the
GPU itself would answer (device properties, free memory) is not imitated: it still fails, with the
capture's hint to fall back to the CPU.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from carma.estimate.base import tensors_in

NOTE = (
    "the job asks for CUDA ({}): the capture ran it on the CPU, where a script that falls back to the CPU "
    "keeps its tensors"
)

HINT = (
    "the capture runs the job on the CPU with CUDA hidden; it keeps tensors sent to CUDA on the CPU and runs "
    "CUDA streams and events as the CPU's, but not other CUDA calls: let the job fall back to the CPU, e.g. "
    'device = "cuda" if torch.cuda.is_available() else "cpu"'
)


HIDDEN = (
    "the script asked torch.cuda.is_available(), which is False in the capture: it runs the job on the CPU "
    "with CUDA hidden, and a script that stops without CUDA cannot be captured; let it fall back to the CPU, e.g. "
    'device = "cuda" if torch.cuda.is_available() else "cpu"'
)


# A job's own reason for stopping that reads as the lack of a GPU: it speaks of one, or there is none at all
# (`assert torch.cuda.is_available()`, a script that prints "no GPU" on stdout and exits 1).
NO_GPU_REASON = re.compile(r"gpu|cuda|device|accelerat|nvidia|^(AssertionError)?$", re.IGNORECASE)


def explained(failure: str, why: str = "", asked_if_available: bool = False) -> str:
    """A failure of the job (`why`: its own reason within it, the message or last line of stderr), with the
    hint when it is about CUDA (`CUDA`, `cuda:0`, `torch._C._cuda_...`), or when the job had asked whether
    CUDA is available and gives a reason that reads as the lack of a GPU. A missing data file or a usage
    error after that question gets no hint: the script already falls back, or stopped before it mattered."""
    if "cuda" in failure.lower():
        return f"{failure} ({HINT})"
    return f"{failure} ({HIDDEN})" if asked_if_available and NO_GPU_REASON.search(why.strip()) else failure


class Requests:
    """What a job asked of CUDA: the calls, for the note, and the tensors it put there before its training
    began (`before_training`), which the profiler's trace does not show: a dataset loaded onto the GPU whole
    sits there for the run. Those still alive when `hold` is called are kept, for the estimate."""

    def __init__(self, before_training: Callable[[], bool]) -> None:
        self.asked: list[str] = []
        self.asked_if_available = False  # torch.cuda.is_available() was called (it answers False)
        self.before_training = before_training
        self._placed: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.held: dict[int, Any] = {}

    def note(self, what: str) -> None:
        if what not in self.asked:
            self.asked.append(what)

    def placed(self, result: Any) -> Any:
        """The result of a call that put tensors on CUDA, noted if training has not begun."""
        if self.before_training():
            for tensor in tensors_in(result):
                self._placed[id(tensor)] = tensor
        return result

    def hold(self) -> None:
        """Keep the tensors put on CUDA before training that are alive now (called when the capture stops)."""
        self.held.update(self._placed.items())


def notes(asked: list[str]) -> list[str]:
    """The note for an estimate whose job asked for CUDA (`asked`, as `Requests.asked` holds it)."""
    return [NOTE.format(", ".join(asked))] if asked else []


def _is_cuda(device: Any) -> bool:
    """A device argument naming CUDA: "cuda", "cuda:1", torch.device("cuda"), or an index (`.to(0)`)."""
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, int):
        return not isinstance(device, bool)
    return getattr(device, "type", None) == "cuda"  # a torch.device


class _Event:
    """A CUDA event on the CPU: recorded when `record` is called, complete at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._recorded_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_s = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        """Milliseconds from this event to `end`, as the CPU ran them."""
        if self._recorded_s is None or end._recorded_s is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._recorded_s - self._recorded_s) * 1000.0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _Stream:
    """A CUDA stream on the CPU: the CPU's one stream, on which every operator has finished when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _generator(note: Callable[[str], None]) -> type:
    """`torch.Generator`, whose instances made for CUDA are the CPU's (a class still: PyTorch and samplers
    check `isinstance(g, torch.Generator)`)."""
    import torch

    base = torch.Generator

    class Generator(base):  # type: ignore[misc,valid-type]
        def __new__(cls, device: Any = "cpu") -> Any:
            if _is_cuda(device):
                note('torch.Generator(device="cuda")')
                device = "cpu"
            return base.__new__(cls, device)

        def __init__(self, device: Any = "cpu") -> None:  # base's __new__ has taken the device
            pass

    return Generator


class _Device:
    """`with torch.cuda.device(i):` on the CPU, where there is one device."""

    def __init__(self, device: Any) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


@contextmanager
def cuda_on_cpu(before_training: Callable[[], bool] = lambda: True) -> Iterator[Requests]:
    """Keep the job's CUDA tensors on the CPU; yields what it asked of CUDA, and placed there before
    `before_training()` turned false (`Requests`)."""
    import torch
    import torch.utils._device as default_device
    from torch.overrides import TorchFunctionMode

    requests = Requests(before_training)
    note = requests.note
    constructors = default_device._device_constructors()

    class CudaOnCpu(TorchFunctionMode):
        """Tensor placement on CUDA becomes placement on the CPU. A default device set to CUDA is
        PyTorch's own mode (`torch.utils._device.DeviceContext`), below this one: a factory call that
        names no device is given the CPU before it gets there."""

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                note(".cuda()")
                kwargs.pop("device", None)
                return requests.placed(args[0].to("cpu", **kwargs))
            if func is torch.Tensor.pin_memory:
                note(".pin_memory()")
                return args[0]
            on_cuda = func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1])
            if on_cuda:
                note('.to("cuda")')
                args = (args[0], "cpu", *args[2:])
            if _is_cuda(kwargs.get("device")):
                note('device="cuda"')
                kwargs["device"], on_cuda = "cpu", True
            elif _is_cuda(getattr(default_device, "CURRENT_DEVICE", None)) and func in constructors:
                note('torch.set_default_device("cuda")')
                kwargs["device"], on_cuda = "cpu", True
            result = func(*args, **kwargs)
            return requests.placed(result) if on_cuda else result

    def keep_on_cpu(name: str, result: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            note(f"torch.cuda.{name}()")
            return result(*args, **kwargs) if callable(result) else result

        return call

    def noted(name: str, cls: type) -> type:
        """`cls` as torch.cuda's class `name`, noting each instance; a class still, for the annotations
        (`torch.cuda.Stream | None`) some libraries evaluate when imported."""

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            note(f"torch.cuda.{name}()")
            cls.__init__(self, *args, **kwargs)  # type: ignore[misc]

        return type(name, (cls,), {"__init__": init})

    load = torch.load

    def load_on_cpu(*args: Any, **kwargs: Any) -> Any:
        """A checkpoint saved on a GPU, without a map_location or with a CUDA one, loads to the CPU."""
        positional = dict(zip(("map_location", "pickle_module"), args[1:], strict=False))  # load(f, location, pickle)
        args, kwargs = args[:1], {**positional, **kwargs}
        location = kwargs.get("map_location")
        if _is_cuda(location):
            note('torch.load(map_location="cuda")')
        if location is None or _is_cuda(location):
            kwargs["map_location"] = "cpu"
        return load(*args, **kwargs)

    def asked_if_available() -> bool:
        """No: the capture hides CUDA (PyTorch's own answer can be True beside a device count given to the
        job, `carma.estimate.replicas`, under `PYTORCH_NVML_BASED_CUDA_CHECK`)."""
        requests.asked_if_available = True
        return False

    imitated = {
        "is_available": asked_if_available,
        "synchronize": keep_on_cpu("synchronize"),  # the CPU's operators have finished when they return
        "set_device": keep_on_cpu("set_device"),
        "current_device": keep_on_cpu("current_device", 0),
        # A script's memory logging: the statistics read 0 without CUDA, their resets and summary fail.
        "reset_peak_memory_stats": keep_on_cpu("reset_peak_memory_stats"),
        "reset_max_memory_allocated": keep_on_cpu("reset_max_memory_allocated"),
        "reset_max_memory_cached": keep_on_cpu("reset_max_memory_cached"),
        "reset_accumulated_memory_stats": keep_on_cpu("reset_accumulated_memory_stats"),
        "memory_summary": keep_on_cpu("memory_summary", "(no CUDA memory: carma's capture runs the job on the CPU)"),
        "memory_snapshot": keep_on_cpu("memory_snapshot", list),
        "set_per_process_memory_fraction": keep_on_cpu("set_per_process_memory_fraction"),  # a cap on no GPU
        "device": noted("device", _Device),
        "Stream": noted("Stream", _Stream),
        "stream": keep_on_cpu("stream", _Stream),  # `with torch.cuda.stream(s):` enters the CPU's stream
        "current_stream": keep_on_cpu("current_stream", _Stream),
        "default_stream": keep_on_cpu("default_stream", _Stream),
        "Event": noted("Event", _Event),
    }
    # Debugging a job's memory: the allocator's history and snapshots, recorded by names only the memory
    # module has, hold nothing without CUDA (recording failed, "torch._C has no attribute ...").
    in_memory_module = {
        "_record_memory_history": keep_on_cpu("memory._record_memory_history"),
        "_dump_snapshot": keep_on_cpu("memory._dump_snapshot"),
        "_snapshot": keep_on_cpu("memory._snapshot", lambda *args, **kwargs: {"segments": [], "device_traces": []}),
    }
    memory = torch.cuda.memory
    replaced = [(torch.cuda, name, replacement) for name, replacement in imitated.items()]
    replaced += [  # torch.cuda's memory functions are the memory module's, called by either name
        (memory, name, replacement)
        for name, replacement in imitated.items()
        if getattr(memory, name, None) is getattr(torch.cuda, name)
    ]
    replaced += [(memory, name, replacement) for name, replacement in in_memory_module.items()]
    originals = [(namespace, name, getattr(namespace, name)) for namespace, name, _ in replaced]
    for namespace, name, replacement in replaced:
        setattr(namespace, name, replacement)
    torch.load = load_on_cpu
    generator = torch.Generator
    torch.Generator = _generator(note)  # type: ignore[misc]

    def record_stream(tensor: Any, stream: Any) -> None:
        """The CPU's one stream needs no note of another using the tensor (a method PyTorch checks the
        argument of before any mode sees the call, hence patched on the class)."""
        note(".record_stream()")

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    try:
        with CudaOnCpu():
            yield requests
    finally:
        del torch.Tensor.record_stream  # the method of torch._C.TensorBase again
        torch.load, torch.Generator = load, generator  # type: ignore[misc]
        for namespace, name, original in originals:
            setattr(namespace, name, original)
