"""Training libraries that refuse mixed precision without a GPU, made to run it in the capture.

The capture hides CUDA, and some libraries then turn mixed precision off or refuse it, although the job
will run it on the GPU: a Hugging Face `Trainer` with `bf16=True` stops at its argument check ("Your setup
doesn't support bf16/gpu"), and Accelerate (under `Trainer` with `fp16=True`, or used directly) drops
float16 autocast on the CPU and trains in float32. While a script is captured, those checks are patched
as the modules are imported: the job runs CPU autocast in the dtype it asked for, which the capture
casts as CUDA does (`kernels.cuda_autocast`), and the estimate carries a note saying so
(`registry.precision_notes`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any


@contextmanager
def mixed_precision_without_gpu() -> Iterator[list[str]]:
    """Patch the known checks in the modules imported from now on (and in those already imported); yields
    the libraries whose mixed precision the patches let through, for the capture's `mixed_precision`."""
    used: list[str] = []
    patches: dict[str, Callable[[ModuleType], Callable[[], None]]] = {
        "transformers.training_args": lambda module: _allow_bf16_without_gpu(module, used),
        "accelerate.accelerator": lambda module: _fp16_autocast_on_cpu(module, used),
    }
    undo: list[Callable[[], None]] = []
    finder = _AfterImport(patches, undo)
    for name in patches:
        if name in sys.modules:
            undo.append(patches[name](sys.modules[name]))
    sys.meta_path.insert(0, finder)
    try:
        yield used
    finally:
        sys.meta_path.remove(finder)
        for restore in reversed(undo):
            restore()


def _allow_bf16_without_gpu(module: ModuleType, used: list[str]) -> Callable[[], None]:
    """`TrainingArguments(bf16=True)` checks for a GPU that supports bfloat16; in the capture, the GPU is the
    one the job will run on."""
    original = module.is_torch_bf16_gpu_available

    def supported() -> bool:
        used.append("Hugging Face Trainer")
        return True

    module.is_torch_bf16_gpu_available = supported  # type: ignore[attr-defined]
    return lambda: setattr(module, "is_torch_bf16_gpu_available", original)


def _fp16_autocast_on_cpu(module: ModuleType, used: list[str]) -> Callable[[], None]:
    """An `Accelerator(mixed_precision="fp16")` on the CPU trains in float32 (no native AMP there); in the
    capture it autocasts to float16 with a gradient scaler, as it would on the GPU."""
    import torch

    accelerator = module.Accelerator
    original = accelerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16" and self.device.type == "cpu" and not self.native_amp:
            self.native_amp = True
            self.scaler = torch.amp.GradScaler("cpu")
            used.append("Accelerate")

    accelerator.__init__ = init
    return lambda: setattr(accelerator, "__init__", original)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders and patches each once it has run."""

    def __init__(
        self, patches: dict[str, Callable[[ModuleType], Callable[[], None]]], undo: list[Callable[[], None]]
    ) -> None:
        self.patches = patches
        self.undo = undo

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._patch_after_run(spec.loader, self.patches[name])
                return spec
        return None

    def _patch_after_run(self, loader: Any, patch: Callable[[ModuleType], Callable[[], None]]) -> None:
        """Wrap this module's loader (each module has its own): run the module, then patch it."""
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.undo.append(patch(module))

        loader.exec_module = exec_module
