"""Run the first iterations of a training job on the CPU, with CUDA hidden, under the PyTorch profiler.

Two ways in, each run in a child process with `CUDA_VISIBLE_DEVICES=""`, TorchDynamo off (a model passed
to `torch.compile` runs eagerly) and heap settings that suit the capture; the child estimates and sends
the `Estimate` back:
- a job function (`module:function` or `path/file.py:function` returning a `TrainingJob`), by
  `estimate_job` (`capture_job` captures it in this process);
- the user's own training script (`python train.py ...`, `python -m pkg.train ...`, `python -c CODE`), by
  `estimate_script`, so a script that falls back to the CPU when CUDA is absent runs unchanged.
  Global hooks stop the script after N training iterations (N optimizer steps, or N steps of each
  optimizer when several step in turn, as a GAN's do) and capture its model (the outermost module called
  whose parameters the first optimizer to step holds), that model's training batch (of its last call
  before the first step: not a summary's or a warm-up's) and the other modules with weights the script
  called or holds (a GAN's other network, a frozen teacher, an average of the model). An optimizer the
  script holds that has not stepped by then (a WGAN's generator) is waited for a while. Profiling starts
  at the first call of a module with parameters (or at the first step given a closure, which calls the
  model inside the step), so imports and setup stay out of the trace (their only lasting GPU memory, the
  weights, is read from the modules). The captured model cannot cross the process boundary, so the
  child also runs the estimator and sends back the `Estimate` as JSON (in a file, as the script owns
  stdout).

While capturing, three CPU operators are swapped for the ones CUDA would run, because their memory
differs (the estimate is for the GPU): optimizers use their `foreach` implementation (the CUDA default,
whose step allocates a parameter-sized list of temporaries), dropout uses `native_dropout` (the fused
CUDA kernel, saving a 1-byte mask where the CPU saves a float one) and attention is computed without
dropout so the CPU takes its flash kernel (the CUDA flash/efficient kernels apply dropout inside and,
like it, never materialise the attention matrix). Unless `exact`, the arithmetic of matrix products,
convolutions, attention, dropout, activations, normalisations and softmax is skipped: their outputs are
allocated with the shapes the operator's meta kernel gives, but not computed. Memory depends on shapes,
not values, so the trace keeps the allocations the GPU makes and the run takes a fraction of the time
(for BERT-base about seven times less). It also drops temporaries that only the CPU kernels allocate
(the CPU batch-norm backward allocates an input-sized one; the CUDA kernels, only their outputs). Mixed
precision's GradScaler, the one common reader of those values, is told its gradients did not overflow,
so its steps run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

from carma.estimate.base import Breakdown, Capture, Estimate, EstimateError, TrainingJob, optimizer_parameters

DEFAULT_STEPS = 3
HELD_DEPTH = 2  # how far into the script's variables held modules and optimizers are looked for
HELD_ITEMS = 64  # containers larger than this are not looked into
WAIT_FACTOR = 10  # an optimizer that has not stepped is waited for up to this many times the iterations asked
DEFAULT_TIMEOUT_S = 900.0
REGISTRY = "carma.estimate.registry:estimate_captured"
STEP_MARK = "carma: step of optimizer #"  # the trace window of each captured optimizer step
CLOSURE_MARK = "carma: closure"  # the trace window of a closure an optimizer step calls
MODULE_MARK = "carma: call of "  # the trace window of each module call, see `module_window`
META_MARK = "carma: meta kernel"  # the trace window of a skipped operator's shape computation
_CUDA_HINT = (
    "the capture runs the script on the CPU with CUDA hidden: let it fall back to the CPU, "
    'e.g. device = "cuda" if torch.cuda.is_available() else "cpu"'
)
_AUTOCAST_OFF = "Disabling autocast"  # what torch.autocast("cuda") warns without CUDA
_AUTOCAST_NOTE = (
    "the script's CUDA autocast (mixed precision) was off on the CPU: the estimate is for float32 "
    "activations, usually above the mixed-precision peak"
)
_COMPILE_NOTE = (
    "the script's torch.compile was left eager (on the CPU it would build CPU kernels): the estimate is the "
    "eager peak, and compiled GPU kernels usually keep fewer activations"
)
_CUDA_GRAPHS_NOTE = ", but its CUDA graphs ({}) keep a memory pool of their own, which can hold more than that"
_CUDA_GRAPHS = ("reduce-overhead", "max-autotune", "triton.cudagraphs")  # what records CUDA graphs on the GPU
_TRACE_CATEGORIES = {"cpu_instant_event", "cpu_op", "user_annotation"}
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?$")
# The child may run under another interpreter (the task's own, with its packages): it loads this very carma
# package from its folder, without putting the folder's neighbours (another environment's packages) on its path.
_CHILD = """
import importlib.util, os, sys
init = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("carma", init, submodule_search_locations=[os.path.dirname(init)])
sys.modules["carma"] = carma = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carma)
from carma.estimate.runner import _child_main
_child_main()
"""
# Freed tensors stay in the child's heap for the next step instead of going back to the system and being
# faulted in again: this cuts a BERT-base capture by a fifth (the CPU run is most of an estimate's time).
# Tensors too large for the heap are mapped afresh each step; in transparent huge pages (where the kernel
# offers them on request) they fault in 2 MiB at a time, not 4 KiB: a ResNet-50 estimate took 13 to 16 s
# instead of 19 to 22 s, a BERT-base one 14 to 18 s instead of 16 to 18 s. Older glibc ignores the tunable.
MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
    "MALLOC_TOP_PAD_": str(1 << 30),
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


def capture_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a capture child: `env` (by default this process's) with CUDA hidden, TorchDynamo
    off and the `MALLOC_ENV` heap settings unless `env` sets its own.

    With TorchDynamo off `torch.compile` leaves the model eager: compiling on the CPU would build CPU
    kernels, not the GPU ones the job will run, and can take minutes. The eager peak is the estimate; a
    compiled model's is usually lower (fused kernels save fewer activations)."""
    hidden = {"CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1"}
    return {**MALLOC_ENV, **(os.environ if env is None else env), **hidden}


def take_cuda_foreach(group: dict[str, Any]) -> None:
    """An optimizer param group left to choose its implementation takes `foreach`, its default on CUDA
    (whose step allocates a parameter-sized list of temporaries); fused and differentiable ones keep theirs."""
    if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
        group["foreach"] = True


class _StepLimitReached(BaseException):
    """Raised by the optimizer hook once the captured steps are done; BaseException so that a script's
    `except Exception` does not swallow it."""


# ---------------------------------------------------------------- capture, shared by both modes


def module_window(module: Any) -> str:
    """The name of the trace window of a call of `module`: its class and identity, so that two networks of
    one class (a GAN's two `nn.Sequential`) are told apart."""
    return f"{MODULE_MARK}{type(module).__name__} {id(module):#x}"


class _Session:
    """Profiles from `start()` on, puts each module call in a trace window of its own (`module_window`)
    and each optimizer step in one (`STEP_MARK` and the optimizer's index, in the order optimizers first
    step), ends a profiler step with each step, and stops the job once it has run `steps` training
    iterations (`split_iterations`). An optimizer the script holds whose parameters no optimizer has
    updated by then (a WGAN's generator's, stepping once every five critic steps) is waited for, up to
    `WAIT_FACTOR` times as many iterations, and then one iteration more is run, so that its state and
    gradients are in the trace.

    The module windows are the runner's, not the profiler's Python tracer's (`with_stack`): that one
    records every Python call, four times as many events as the operators make, and exporting them took
    a fifth of a BERT-base estimate."""

    def __init__(self, steps: int, exact: bool) -> None:
        self.steps = steps
        self.exact = exact
        self.optimizers: list[Any] = []  # by first step while profiling
        self.order: list[int] = []  # the optimizer (its index) of each step taken while profiling
        self.stopped = False
        self._open: list[Any] = []  # the trace windows of the steps running (an optimizer may call another's)
        self._threads = threading.local()  # each thread's stack of module calls running
        self.on_stop: Callable[[], None] | None = None  # called in the hook that stops the job
        # The optimizers the script holds whose parameters none has updated yet: the capture waits a while.
        self.awaits: Callable[[], list[Any]] | None = None
        self._until = 0  # iterations to run at least: one more after a late optimizer's first step
        self.notes: list[str] = []  # for the user: where the capture differs from the GPU run
        self.profiler: Any = None
        self.trace: list[dict[str, Any]] = []
        self._running = ExitStack()

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.profiler is not None:
            return
        self.profiler = profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,  # no shapes or stacks: the analysis reads neither, and they cost time
            schedule=_record_every_step,
        )
        with _native_stderr_muted():
            self._running.enter_context(self.profiler)
        if not self.exact:
            self._running.enter_context(_value_free_arithmetic())

    def stop(self, export: bool) -> None:
        with _native_stderr_muted():
            self._running.close()
        if export and self.profiler is not None:
            self.trace = _chrome_trace(self.profiler)

    def finished(self, ended: bool = False) -> int:
        """Training iterations run to their end; `ended`: the script ended, so its last iteration did too."""
        sizes, complete = split_iterations(self.order)
        return len(sizes) if complete or ended else len(sizes) - 1

    def enough(self, finished: int) -> bool:
        """Whether `finished` training iterations are all the capture needs; when it gives up waiting for an
        optimizer, a note says so."""
        if finished < max(self.steps, self._until):
            return False
        waiting = self.awaits() if self.awaits is not None else []
        if waiting and finished >= WAIT_FACTOR * self.steps:
            self.notes.append(
                f"the script holds {_names(waiting)} that never stepped in {finished} iterations: its "
                "gradients and state are left out (a larger --steps waits longer)"
            )
            return True
        return not waiting

    @property
    def _calls(self) -> list[Any]:
        """This thread's trace windows of the module calls running (None: not profiled): a module called in
        another thread (a prefetching thread's transform) is no part of the training loop's calls."""
        calls = getattr(self._threads, "calls", None)
        if calls is None:
            calls = self._threads.calls = []
        return calls

    def enter_module(self, module: Any, args: Any) -> None:
        """Global forward pre-hook: a call of a module with parameters outside any other call starts the
        profiling (the training loop begins: imports and setup before it go unprofiled)."""
        from torch.profiler import record_function

        if not self._calls and next(module.parameters(), None) is not None:
            self.start()
        window = None
        if self.profiler is not None:
            window = record_function(module_window(module))
            window.__enter__()
        self._calls.append(window)

    def leave_module(self, module: Any, args: Any, output: Any) -> None:
        """Global forward hook, called even when the forward raises."""
        window = self._calls.pop()
        if window is not None:
            window.__exit__(None, None, None)

    @property
    def in_module_call(self) -> bool:
        """Whether a module's forward is running in this thread (after `leave_module` of the outermost
        call: no longer)."""
        return bool(self._calls)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        from torch.profiler import record_function

        if self.stopped:  # the script caught our stop and went on
            raise _StepLimitReached
        closure = _closure(args, kwargs)
        if closure is not None:  # it runs the forward and backward inside the step: training has begun
            self.start()
        if self.profiler is not None:
            index = self._index(optimizer)
            # A step that begins a new iteration may end the capture before it runs: with one step asked
            # for, the first iteration is known to be over only here.
            sizes, _ = split_iterations([*self.order, index])
            if self.enough(len(sizes) - 1):
                self._stop()
            window = record_function(f"{STEP_MARK}{index}")
            window.__enter__()
            self._open.append(window)
        for group in optimizer.param_groups:
            take_cuda_foreach(group)
        return None if closure is None else _with_closure(args, kwargs, closure)

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._open:  # began before the model was ever called: not a training step
            return
        self._open.pop().__exit__(None, None, None)
        index = self._index(optimizer)
        self.order.append(index)
        finished = self.finished()
        if index == len(self.optimizers):
            self.optimizers.append(optimizer)
            if finished >= self.steps:  # it stepped late: run its iteration and one more
                self._until = finished + 2
        if self.enough(finished):
            self._stop()
        self.profiler.step()

    def _index(self, optimizer: Any) -> int:
        return next((i for i, known in enumerate(self.optimizers) if known is optimizer), len(self.optimizers))

    def _stop(self) -> None:
        self.stopped = True
        if self.on_stop is not None:
            self.on_stop()
        raise _StepLimitReached


def _closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The closure an optimizer step was given (`optimizer.step(closure)`, as PyTorch Lightning and L-BFGS
    call it), if any; `args` starts with the optimizer."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _with_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Any) -> tuple[Any, dict[str, Any]]:
    """The step's arguments with `closure` run inside a `CLOSURE_MARK` window, so that the forward and
    backward it runs inside the step are told apart from the update."""
    from torch.profiler import record_function

    def marked() -> Any:
        with record_function(CLOSURE_MARK):
            return closure()

    if len(args) > 1:
        return (args[0], marked, *args[2:]), kwargs
    return args, {**kwargs, "closure": marked}


def split_iterations(order: Sequence[int]) -> tuple[list[int], bool]:
    """The training iterations in a run of optimizer steps: how many steps each holds, and whether the
    last is known to be complete.

    `order` gives each step's optimizer (0 for the first to step, 1 for the next new one, ...). An
    iteration ends before a step of an optimizer that already stepped in it, and as soon as it holds a
    step of every optimizer the first iteration had: one optimizer's [0, 0, 0] is three iterations of one
    step, a GAN's [0, 1, 0, 1] two of two (discriminator, then generator). The first iteration is known
    complete only when one of its optimizers steps again.
    """
    sizes: list[int] = []
    first: set[int] | None = None
    current: set[int] = set()
    for index in order:
        if index in current:
            first = current if first is None else first
            sizes.append(len(current))
            current = set()
        current.add(index)
        if first is not None and current >= first:
            sizes.append(len(current))
            current = set()
    if current:
        return [*sizes, len(current)], False
    return sizes, True


@contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Silence file descriptor 2 for a moment: the profiler's native library prints `USDT ...
    profiler_start` and `profiler_stop` lines there, whatever its log level."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _record_every_step(step: int) -> Any:
    from torch.profiler import ProfilerAction

    return ProfilerAction.RECORD  # a schedule makes the profiler mark each step as ProfilerStep#k


@contextmanager
def _capturing(steps: int, exact: bool) -> Iterator[_Session]:
    """Step and module hooks and CUDA-like operators around the body; the session's profiler (and, unless
    `exact`, the value-free arithmetic) starts where the training begins: at the first call of a module
    with parameters, or earlier if the caller starts it. The trace is exported when the body ends without
    an exception. Hooks the body registers later run after the session's, inside its module windows."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    session = _Session(steps, exact)
    handles = [
        register_optimizer_step_pre_hook(session.before_step),
        register_optimizer_step_post_hook(session.after_step),
        register_module_forward_pre_hook(session.enter_module),
        register_module_forward_hook(session.leave_module, always_call=True),
    ]
    try:
        with _cuda_like_operators():
            yield session
    except BaseException:
        session.stop(export=False)
        raise
    else:
        session.stop(export=True)
    finally:
        for handle in handles:
            handle.remove()


def _chrome_trace(prof: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") in _TRACE_CATEGORIES]


@contextmanager
def _cuda_like_operators() -> Iterator[None]:
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


@contextmanager
def _value_free_arithmetic() -> Iterator[None]:
    """Replace the CPU kernels of the costly operators by ones that allocate their outputs, uncomputed.

    Outputs are left uninitialised: nothing downstream depends on their values for its memory. Matrix
    products get their (contiguous) output shape directly; the others take shapes and strides from the
    operator's meta kernel, run in a `META_MARK` window: some meta kernels (Python decompositions) make
    host scalars, which the analysis leaves out. Autograd is untouched (it sits above the CPU
    kernels), and so is every other operator. One operator reads the values: mixed precision's overflow
    check, whose finding makes `GradScaler` skip `optimizer.step()` (uncomputed values often hold infinities
    or NaNs). It works in place, allocating nothing, so it becomes a no-op: its `found_inf` stays at the
    zero GradScaler set, and the steps run, as nearly all of a real run's do.
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

    kernels = {
        "mm": product(lambda a, b: (a.shape[0], b.shape[1])),
        "addmm": product(lambda bias, a, b, *_: (a.shape[0], b.shape[1])),
        "bmm": product(lambda a, b: (a.shape[0], a.shape[1], b.shape[2])),
        "baddbmm": product(lambda bias, a, b, *_: (a.shape[0], a.shape[1], b.shape[2])),
        "convolution": by_meta(aten.convolution.default),
        "convolution_backward": by_meta(aten.convolution_backward.default),
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
    }
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
            for name, kernel in kernels.items():
                library.impl(name, kernel, "CPU")
        yield
    finally:
        library._destroy()  # restores the original kernels


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


def _hide_cuda() -> None:
    """Hide CUDA from this process, unless PyTorch already initialised it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()


# ---------------------------------------------------------------- job mode


def capture_job(target: str, steps: int = DEFAULT_STEPS, *, exact: bool = False) -> Capture:
    """Build the job from `target` ("module:function" or "path/file.py:function") and profile `steps`
    iterations of `zero_grad(); loss(model, batch).backward(); step()` in this process.

    CUDA is hidden from this process first (unless PyTorch already initialised it); the job must be
    built on the CPU. Building it is not profiled: its parameters are read from the model.
    """
    started = time.perf_counter()
    _hide_cuda()
    function = _load_job_function(target)
    try:
        job = _as_job(function(), target)
    except EstimateError:
        raise
    except Exception as exc:
        raise EstimateError(f"the job function {target} failed: {_last_line(exc)}") from None
    with _capturing(steps, exact) as session:
        session.start()
        try:
            for _ in range(steps):
                job.optimizer.zero_grad()
                job.loss(job.model, job.batch).backward()
                job.optimizer.step()
        except _StepLimitReached:
            pass
        except Exception as exc:
            raise EstimateError(f"the training step of {target} failed: {_last_line(exc)}") from None
    return Capture(job, session.trace, steps, time.perf_counter() - started)


def _job_parts(target: str) -> tuple[str, str]:
    """(module or file, function) of a job target."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise EstimateError(f"job {target!r} is not 'module:function' or 'path/to/file.py:function'")
    return where, name


def _load_job_function(target: str) -> Callable[[], Any]:
    where, name = _job_parts(target)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise EstimateError(f"job file {where} does not exist")
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(f"_carma_job_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # as an import would (dataclasses and pickling look it up)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except EstimateError:
        raise
    except Exception as exc:
        raise EstimateError(f"cannot import {where}: {_last_line(exc)}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise EstimateError(f"{where} has no function {name}")
    return function


def _as_job(result: Any, target: str) -> TrainingJob:
    import torch

    if isinstance(result, tuple | list) and len(result) == 4:
        result = TrainingJob(*result)
    if not isinstance(result, TrainingJob):
        raise EstimateError(
            f"{target} returned {type(result).__name__}; expected a TrainingJob or (model, batch, loss, optimizer)"
        )
    if not isinstance(result.model, torch.nn.Module):
        raise EstimateError(f"{target}: the model is a {type(result.model).__name__}, not a torch.nn.Module")
    if not isinstance(result.optimizer, torch.optim.Optimizer):
        raise EstimateError(f"{target}: the optimizer is a {type(result.optimizer).__name__}, not a torch.optim one")
    if not callable(result.loss):
        raise EstimateError(f"{target}: the loss is not callable as loss(model, batch)")
    devices = {p.device.type for p in result.model.parameters()}
    if devices - {"cpu"}:
        raise EstimateError(f"{target} put the model on {', '.join(sorted(devices))}; build the job on the CPU")
    return result


# ---------------------------------------------------------------- script mode


class _ModelRecorder:
    """A global module hook, run after the session's: the last call before the first optimizer step of
    every outermost module that has parameters (its training batch, not that of a summary's or warm-up's
    forward pass). When the session stops the job, the modules with parameters the script's frames hold
    are noted too."""

    def __init__(self, session: _Session) -> None:
        self.session = session
        self.calls: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
        self.held: dict[int, Any] = {}
        session.on_stop = self._note_held
        session.awaits = self._awaits

    def _note_held(self) -> None:
        """The modules with parameters that the script's variables hold (`_held_by_script`: a trainer's
        `self.ema`) while its frames are alive: weights the loop keeps on the GPU without calling them, such
        as an exponential moving average of the model."""
        import torch

        for module in _held_by_script(sys._getframe(1), torch.nn.Module):
            if next(module.parameters(), None) is not None:
                self.held[id(module)] = module

    def _awaits(self) -> list[Any]:
        """The optimizers the script holds with parameters that no optimizer has updated while profiling
        (not one wrapping a stepped one, as Accelerate's `AcceleratedOptimizer` does)."""
        import torch

        updated = {id(p) for optimizer in self.session.optimizers for p in optimizer_parameters(optimizer)}
        held = {id(o): o for o in _held_by_script(sys._getframe(1), torch.optim.Optimizer)}
        return [o for o in held.values() if any(id(p) not in updated for p in optimizer_parameters(o))]

    @contextmanager
    def hooks(self) -> Iterator[None]:
        from torch.nn.modules.module import register_module_forward_hook

        handle = register_module_forward_hook(self._leave, with_kwargs=True, always_call=True)
        try:
            yield
        finally:
            handle.remove()

    def _leave(self, module: Any, args: Any, *rest: Any) -> None:
        """Runs after the session's own forward hook, which has closed this call's window."""
        outermost = not self.session.in_module_call
        if outermost and not self.session.order and next(module.parameters(), None) is not None:
            kwargs = rest[0] if len(rest) == 2 and isinstance(rest[0], dict) else {}
            self.calls[id(module)] = (module, tuple(args), dict(kwargs))

    def model_of(self, optimizer: Any) -> tuple[Any, Any]:
        """The recorded module holding most of the optimizer's parameters, and its training batch."""
        held = {id(p) for p in optimizer_parameters(optimizer)}
        best, overlap = None, 0
        for module, args, kwargs in self.calls.values():
            n = sum(id(p) in held for p in module.parameters())
            if n > overlap:
                best, overlap = (module, args, kwargs), n
        if best is None:
            raise EstimateError("the optimizer's parameters belong to no torch.nn.Module the script called")
        module, args, kwargs = best
        return module, _batch(module, args, kwargs)

    def besides(self, model: Any) -> tuple[Any, ...]:
        """The other modules called or held with parameters outside `model` (a GAN's other network, a frozen
        teacher, an average of the model, the model's other children when it is called as `model.forward(x)`)."""
        inside = {id(p) for p in model.parameters()}
        modules = {**self.held, **{id(module): module for module, _, _ in self.calls.values()}}
        return tuple(
            module
            for module in modules.values()
            if module is not model and any(id(p) not in inside for p in module.parameters())
        )


def _names(optimizers: Sequence[Any]) -> str:
    """`an optimizer (SGD)`, `2 optimizers (SGD, Adam)`."""
    what = "an optimizer" if len(optimizers) == 1 else f"{len(optimizers)} optimizers"
    return f"{what} ({', '.join(type(o).__name__ for o in optimizers)})"


def _held_by_script(frame: Any, kind: type) -> Iterator[Any]:
    """The instances of `kind` that the frames from `frame` up to the capture's hold: in their variables,
    or up to `HELD_DEPTH` steps into them (an attribute, a list's or a dict's item: a trainer's
    `self.ema`, its `self.optimizers["G"]`)."""
    seen: dict[int, int] = {}
    while frame is not None and frame.f_code is not capture_script.__code__:
        for value in list(frame.f_locals.values()):
            yield from _reachable(value, kind, HELD_DEPTH, seen)
        frame = frame.f_back


def _reachable(value: Any, kind: type, depth: int, seen: dict[int, int]) -> Iterator[Any]:
    """`value` if it is a `kind`, else the instances of `kind` up to `depth` steps into it; `seen`: how deep
    each object was already searched."""
    if seen.get(id(value), -1) >= depth:
        return
    seen[id(value)] = depth
    found, inside = False, []
    with suppress(Exception):  # an object that will not show its attributes holds nothing we see
        found = isinstance(value, kind)
        inside = _contents(value) if depth > 0 and not found else []
    if found:
        yield value
    for item in inside:
        yield from _reachable(item, kind, depth - 1, seen)


def _contents(value: Any) -> list[Any]:
    """A container's items (not a large one's: a dataset's samples hold no model) or an object's attributes."""
    if isinstance(value, str | bytes):
        return []
    if isinstance(value, Mapping):
        return list(value.values()) if len(value) <= HELD_ITEMS else []
    if isinstance(value, list | tuple | set | frozenset):
        return list(value) if len(value) <= HELD_ITEMS else []
    return list(vars(value).values()) if _plain_object(value) else []


def _plain_object(value: Any) -> bool:
    """An instance of a class of the script's or a library's (not a module, class or function), whose
    attributes may hold modules."""
    return hasattr(value, "__dict__") and not isinstance(value, type | types.ModuleType | types.FunctionType)


def _batch(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The model's inputs as a TrainingJob batch: a tensor, a tuple (positional) or a dict (keywords)."""
    if not kwargs:
        return args[0] if len(args) == 1 else args
    if not args:
        return kwargs
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    named: dict[str, Any] = {}
    for name, value in bound.items():
        if isinstance(value, Mapping) and name not in kwargs:  # the **kwargs parameter
            named.update(value)
        else:
            named[name] = value
    return named


def _parse_argv(argv: list[str], cwd: str | Path | None = None) -> tuple[str, str, list[str]]:
    """("path", script, args), ("module", name, args) or ("code", source, args) from a command line such as
    `python train.py` (a relative script path is looked up in `cwd`, by default the current directory)."""
    args = list(argv)
    interpreted = bool(args) and bool(_PYTHON.search(os.path.basename(args[0])))
    if interpreted:
        args = args[1:]
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            args = args[2:] if args[0] in ("-W", "-X") else args[1:]
        if args and args[0] == "-c":
            if len(args) < 2:
                raise EstimateError("`python -c` needs the code to run")
            return "code", args[1], args[2:]
        if args and args[0] == "-m":
            if len(args) < 2:
                raise EstimateError("`python -m` needs a module name")
            return "module", args[1], args[2:]
    if not args:
        raise EstimateError("no training script given")
    if not (Path(cwd or ".") / args[0]).is_file():
        if not interpreted and shutil.which(args[0]):  # `torchrun train.py`, `accelerate launch ...`
            raise EstimateError(
                f"{args[0]} is a program, not a Python script: give `python script.py ...` (for a launcher such "
                "as torchrun, the script it starts, with its arguments)"
            )
        raise EstimateError(f"training script {args[0]} does not exist (give `python script.py ...`)")
    return "path", args[0], args[1:]


@contextmanager
def _compile_calls() -> Iterator[list[str]]:
    """The modes of the script's `torch.compile` calls, in order ("triton.cudagraphs" when its options ask
    for CUDA graphs).

    With TorchDynamo off, torch.compile hands the model back unchanged and says nothing, so the capture
    wraps it to know that the GPU run will differ; calls with `disable=True` compile nothing and are left out.
    """
    import torch

    original = torch.compile
    modes: list[str] = []

    def compile(model: Any = None, **options: Any) -> Any:
        if not options.get("disable"):
            graphs = (options.get("options") or {}).get("triton.cudagraphs")
            modes.append("triton.cudagraphs" if graphs else options.get("mode") or "default")
        return original(model, **options)

    torch.compile = compile
    try:
        yield modes
    finally:
        torch.compile = original


def _compile_note(modes: list[str]) -> str:
    graphs = [mode for mode in modes if mode in _CUDA_GRAPHS]
    return _COMPILE_NOTE + (_CUDA_GRAPHS_NOTE.format(graphs[0]) if graphs else "")


def capture_script(argv: list[str], steps: int = DEFAULT_STEPS, *, exact: bool = False) -> Capture:
    """Run the script in THIS process until `steps` optimizer steps are done, and capture it.

    It takes over the process (sys.argv, global hooks, whatever the script leaves behind): call it in a
    process of its own, as `estimate_script` does.
    """
    kind, target, args = _parse_argv(argv)
    _hide_cuda()
    started = time.perf_counter()
    with _capturing(steps, exact) as session:
        recorder = _ModelRecorder(session)
        try:
            # The script's warnings go nowhere (the parent reads stderr only when the child dies): recorded
            # instead, they tell when CUDA autocast was turned off.
            with recorder.hooks(), _compile_calls() as compiled, warnings.catch_warnings(record=True) as caught:
                sys.argv = ["-c" if kind == "code" else target, *args]
                if kind == "module":
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                elif kind == "code":  # as `python -c` runs it: in __main__, the current directory on sys.path
                    sys.path.insert(0, "")
                    exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                else:
                    sys.path.insert(0, str(Path(target).resolve().parent))
                    runpy.run_path(target, run_name="__main__")
        except _StepLimitReached:
            pass
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise EstimateError(
                    f"the script exited with status {exc.code} after {len(session.order)} optimizer steps"
                ) from None
        except Exception as exc:
            crash = f"the script crashed after {len(session.order)} optimizer steps: {_last_line(exc)}"
            if "CUDA" in crash:
                crash += f" ({_CUDA_HINT})"
            raise EstimateError(crash) from None
        if not session.order:
            raise EstimateError(f"the script never reached an optimizer step; xMem needs {steps} training steps")
        if not session.stopped and session.finished(ended=True) < steps:
            each = f" of each of its {len(session.optimizers)} optimizers" if len(session.optimizers) > 1 else ""
            ended = f"the script ended after {len(session.order)} optimizer steps"
            raise EstimateError(f"{ended}; xMem needs {steps}{each}")
    first, *others = session.optimizers
    model, batch = recorder.model_of(first)
    job = TrainingJob(model=model, batch=batch, loss=None, optimizer=first)
    extra_models = recorder.besides(model)
    notes = list(session.notes)
    if any(_AUTOCAST_OFF in str(warning.message) for warning in caught):
        notes.append(_AUTOCAST_NOTE)
    if compiled:
        notes.append(_compile_note(compiled))
    seconds = time.perf_counter() - started
    return Capture(job, session.trace, steps, seconds, extra_models, tuple(others), tuple(notes))


def estimate_script(argv: list[str], method: str, device: str, steps: int = DEFAULT_STEPS, **options: Any) -> Estimate:
    """Capture the script in a child process (CUDA hidden) and estimate there; `options` as `_estimate_in_child`."""
    _parse_argv(argv, options.get("cwd"))  # fail fast, before a process is started
    return _estimate_in_child({"argv": list(argv)}, method, device, steps, **options)


def estimate_job(target: str, method: str, device: str, steps: int = DEFAULT_STEPS, **options: Any) -> Estimate:
    """Capture the job function in a child process (CUDA hidden) and estimate there; `options` as
    `_estimate_in_child`. The child imports `target` from its working directory, as `capture_job` does."""
    _job_parts(target)  # fail fast, before a process is started
    return _estimate_in_child({"job": target}, method, device, steps, **options)


def _estimate_in_child(
    source: dict[str, Any],
    method: str,
    device: str,
    steps: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    exact: bool = False,
    timeline: str | Path | None = None,
    estimator: str = REGISTRY,
    python: str | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    user: int | None = None,
    group: int | None = None,
    extra_groups: Sequence[int] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Estimate:
    """Capture `source` ({"argv": [...]} or {"job": "module:function"}) in a child and estimate there with
    `estimator`.

    `estimator` names a function `(method, capture, device, **options) -> Estimate`; `timeline` (a PNG
    path) is passed on as an option when given. The child runs as the job would: under `python` (by
    default this interpreter), in `cwd`, with `env` (by default this process's), as `user`/`group`/
    `extra_groups` when given (a root daemon estimating a user's task); `on_start` gets its process group.
    """
    what = "the script" if "argv" in source else "the job function"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="carma-estimate-") as tmp:
        result = Path(tmp) / "estimate.json"
        spec = {
            **source,
            "steps": steps,
            "exact": exact,
            "method": method,
            "device": device,
            "estimator": estimator,
            "timeline": str(Path(timeline).resolve()) if timeline else None,
            "result": str(result),
        }
        if user is not None:
            os.chown(tmp, user, group if group is not None else -1)  # the child writes its result there
        package = str(Path(__file__).resolve().parent.parent / "__init__.py")
        try:
            child = subprocess.Popen(
                [python or sys.executable, "-c", _CHILD, package, json.dumps(spec)],
                stdout=subprocess.DEVNULL,  # the script's own output
                stderr=subprocess.PIPE,  # for the last error line when the child dies
                text=True,
                cwd=cwd,
                env=capture_environment(env),
                user=user,
                group=group,
                extra_groups=extra_groups,
                start_new_session=True,  # its own process group, so a timeout ends DataLoader workers too
            )
        except OSError as e:
            raise EstimateError(f"could not start {python or sys.executable} to capture {what}: {e}") from None
        if on_start is not None:
            on_start(child.pid)
        try:
            _, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            child.communicate()
            raise EstimateError(f"{what} did not reach {steps} optimizer steps within {timeout_s:g} s") from None
        _kill_group(child.pid)  # whatever the job left running
        if not result.exists():
            raise EstimateError(_death(child.returncode, err))
        payload = json.loads(result.read_text())
    if "error" in payload:
        raise EstimateError(payload["error"])
    e = payload["estimate"]
    breakdown = Breakdown(**e["breakdown"])
    seconds = time.perf_counter() - started
    return Estimate(e["method"], e["peak_bytes"], breakdown, e["device"], seconds, tuple(e.get("notes", ())))


def _death(returncode: int, err: str) -> str:
    """Why the capture child ended without a result. A SIGKILL nobody sent is most often the kernel's
    out-of-memory killer: the capture holds the model, the batch and the activations in host memory."""
    if returncode == -signal.SIGKILL:
        return (
            "the estimating process was killed (SIGKILL), most likely for lack of host memory: the capture runs "
            "the training steps on the CPU, so the host needs about the memory the job needs on the GPU"
        )
    if returncode < 0:
        return f"the estimating process was killed by {signal.Signals(-returncode).name}"
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no error output"
    return f"the estimating process died (exit status {returncode}): {last}"


def _kill_group(pid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _child_main() -> None:
    """The child of `estimate_script`: capture, estimate, write the JSON, and exit at once (without
    waiting for threads the script may have left)."""
    spec = json.loads(sys.argv[1])
    with suppress(OSError):  # the first the kernel kills if host memory runs out, not a training job or the daemon
        Path("/proc/self/oom_score_adj").write_text("1000")
    try:
        if "job" in spec:
            capture = capture_job(spec["job"], spec["steps"], exact=spec["exact"])
        else:
            capture = capture_script(spec["argv"], spec["steps"], exact=spec["exact"])
        module, _, name = spec["estimator"].partition(":")
        estimate_captured = getattr(importlib.import_module(module), name)
        options = {"timeline": spec["timeline"]} if spec["timeline"] else {}
        estimate = estimate_captured(spec["method"], capture, spec["device"], **options)
        payload: dict[str, Any] = {"estimate": replace(estimate, notes=(*capture.notes, *estimate.notes)).to_json()}
    except EstimateError as exc:
        payload = {"error": str(exc)}
    except Exception as exc:
        traceback.print_exc()
        payload = {"error": f"estimating with {spec['method']} failed: {_last_line(exc)}"}
    Path(spec["result"]).write_text(json.dumps(payload))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
