"""A job that names CUDA, captured on the CPU all the same.

The capture hides CUDA, so a script that falls back to the CPU when CUDA is absent runs unchanged. Many
do not: they call `model.cuda()`, `batch.to("cuda")` or `torch.zeros(n, device="cuda")`, synchronise,
or load a checkpoint saved on a GPU. While a job is captured those requests are kept on the CPU, where
a falling-back script would have put the same tensors (`.cuda()` and `.to("cuda")` of a CPU tensor hand it
back, as `.to("cpu")` does), so the trace and the estimate are those of the CPU fallback. What is not a
tensor's placement (device properties, CUDA events and streams, free memory) is not imitated: it still
fails, with the capture's hint to fall back to the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

NOTE = (
    "the job asks for CUDA ({}): the capture ran it on the CPU, where a script that falls back to the CPU "
    "keeps its tensors"
)

HINT = (
    "the capture runs the job on the CPU with CUDA hidden; it keeps tensors sent to CUDA on the CPU, but not "
    'other CUDA calls: let the job fall back to the CPU, e.g. device = "cuda" if torch.cuda.is_available() '
    'else "cpu"'
)


def explained(failure: str) -> str:
    """A failure of the job, with the hint when it is about CUDA."""
    return f"{failure} ({HINT})" if "CUDA" in failure else failure


def notes(asked: list[str]) -> list[str]:
    """The note for an estimate whose job asked for CUDA (`asked`, as `cuda_on_cpu` yields it)."""
    return [NOTE.format(", ".join(asked))] if asked else []


def _is_cuda(device: Any) -> bool:
    """A device argument naming CUDA: "cuda", "cuda:1", torch.device("cuda"), or an index (`.to(0)`)."""
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, int):
        return not isinstance(device, bool)
    return getattr(device, "type", None) == "cuda"  # a torch.device


@contextmanager
def cuda_on_cpu() -> Iterator[list[str]]:
    """Keep the job's CUDA tensors on the CPU; yields what it asked of CUDA (for the note), in order."""
    import torch
    import torch.utils._device as default_device
    from torch.overrides import TorchFunctionMode

    used: list[str] = []
    constructors = default_device._device_constructors()

    def note(what: str) -> None:
        if what not in used:
            used.append(what)

    class CudaOnCpu(TorchFunctionMode):
        """Tensor placement on CUDA becomes placement on the CPU. A default device set to CUDA is
        PyTorch's own mode (`torch.utils._device.DeviceContext`), below this one: a factory call that
        names no device is given the CPU before it gets there."""

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                note(".cuda()")
                kwargs.pop("device", None)
                return args[0].to("cpu", **kwargs)
            if func is torch.Tensor.pin_memory:
                note(".pin_memory()")
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                note('.to("cuda")')
                args = (args[0], "cpu", *args[2:])
            if _is_cuda(kwargs.get("device")):
                note('device="cuda"')
                kwargs["device"] = "cpu"
            elif _is_cuda(getattr(default_device, "CURRENT_DEVICE", None)) and func in constructors:
                note('torch.set_default_device("cuda")')
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    def keep_on_cpu(name: str, result: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            note(f"torch.cuda.{name}()")
            return result

        return call

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

    housekeeping = {
        "synchronize": keep_on_cpu("synchronize"),  # the CPU's operators have finished when they return
        "set_device": keep_on_cpu("set_device"),
        "current_device": keep_on_cpu("current_device", 0),
        "reset_peak_memory_stats": keep_on_cpu("reset_peak_memory_stats"),
    }
    originals = {name: getattr(torch.cuda, name) for name in housekeeping}
    for name, replacement in housekeeping.items():
        setattr(torch.cuda, name, replacement)
    torch.load = load_on_cpu
    try:
        with CudaOnCpu():
            yield used
    finally:
        torch.load = load
        for name, original in originals.items():
            setattr(torch.cuda, name, original)
