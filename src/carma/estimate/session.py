"""The capture session: the profiler and the hooks that mark a training job's module calls and optimizer
steps in the trace and stop the job after its first iterations, for both ways in (`carma.estimate.job`,
`carma.estimate.script`).

Profiling starts at the first call of a module with parameters (or at the first step given a closure,
which calls the model inside the step), so imports and setup stay out of the trace (their only lasting
GPU memory, the weights, is read from the modules). The CPU runs CUDA's operators meanwhile
(`carma.estimate.kernels`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import sysconfig
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NoReturn

from carma.estimate.base import optimizer_parameters
from carma.estimate.epochs import EPOCH_END_BATCHES, captured_epochs
from carma.estimate.kernels import cuda_autocast, cuda_like_operators, take_cuda_foreach, value_free_arithmetic
from carma.units import cut, size_text

DEFAULT_STEPS = 3
REASON_CHARS = 500  # the most of one line of the job's output an error shows
WAIT_FACTOR = 10  # an optimizer that has not stepped is waited for up to this many times the iterations asked
# Backward passes before any optimizer step after which the job is taken to update its weights by hand (more
# than any gradient accumulation takes to its first step) and stopped, not trained until the timeout
BACKWARDS_WITHOUT_STEP = 256
STEP_MARK = "carma: step of optimizer #"  # the trace window of each captured optimizer step
CLOSURE_MARK = "carma: closure"  # the trace window of a closure an optimizer step calls
MODULE_MARK = "carma: call of "  # the trace window of each module call, see `module_window`

_TRACE_CATEGORIES = {"cpu_instant_event", "cpu_op", "user_annotation"}
CUDA_AUTOCAST = "CUDA autocast"  # the job's mixed precision, as `Session.mixed_precision` names it
CPU_AUTOCAST = "CPU autocast"


class HostMemoryShort(BaseException):
    """The model's training state cannot fit in the host's memory: raised at its first call, before the
    capture, rather than left to the kernel's out-of-memory killer. A `BaseException`, which a script's
    `except Exception:` around a model check lets through."""


# The host memory a captured model's training state takes, in parameter-sized copies: its weights, their
# gradients and Adam's two moments (the most common optimizer's state; SGD without momentum keeps none).
TRAINING_COPIES = 4


def check_host_memory(module: Any) -> None:
    """Refuse a model whose weights, gradients and optimizer state would not fit in the host's available
    memory (the weights are already there): a capture holds the job's tensors in host memory, and GPT-2 XL
    was killed by the kernel after 84 s, taking other work's memory first."""
    available = host_memory("MemAvailable")
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    if available is None or (TRAINING_COPIES - 1) * weights <= available:
        return
    raise HostMemoryShort(
        f"the model's {size_text(weights)} of weights need about {size_text(TRAINING_COPIES * weights)} of host "
        f"memory to capture its training (weights, gradients and Adam's state, before its activations), and "
        f"this host has {size_text(available)} available beside its weights: estimate on a host with more memory"
    )


def host_memory(field: str) -> int | None:
    """A field of /proc/meminfo (`MemAvailable`, `MemTotal`), in bytes (None where there is none)."""
    return proc_kib("/proc/meminfo", field)


def proc_kib(path: str, field: str) -> int | None:
    """A `Field: N kB` line of a /proc file (/proc/meminfo, /proc/PID/status), in bytes; None where the file or
    the field is not there (a process gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class StepLimitReached(BaseException):
    """Raised by the optimizer hook once the captured steps are done; BaseException so that a script's
    `except Exception` does not swallow it."""


def module_window(module: Any) -> str:
    """The name of the trace window of a call of `module`: its class and identity, so that two networks of
    one class (a GAN's two `nn.Sequential`) are told apart."""
    return f"{MODULE_MARK}{type(module).__name__} {id(module):#x}"


class Session:
    """Profiles from `start()` on, puts each module call in a trace window of its own (`module_window`)
    and each optimizer step in one (`STEP_MARK` and the optimizer's index, in the order optimizers first
    step), ends a profiler step with each step, and stops the job once it has run `steps` training
    iterations (`split_iterations`). An optimizer the script holds whose parameters no optimizer has
    updated by then (a WGAN's generator's, stepping once every five critic steps) is waited for, up to
    `WAIT_FACTOR` times as many iterations, and then one iteration more is run, so that its state and
    gradients are in the trace.

    The module windows are the session's, not the profiler's Python tracer's (`with_stack`): that one
    records every Python call, four times as many events as the operators make, and exporting them took
    a fifth of a BERT-base estimate."""

    def __init__(self, steps: int, exact: bool) -> None:
        self.steps = steps
        self.exact = exact
        self.optimizers: list[Any] = []  # by first step while profiling
        self.order: list[int] = []  # the optimizer (its index) of each step taken while profiling
        self.stopped = False
        self._stopped_in: int | None = None  # the thread the stop was raised in
        # Given the script's capture once it catches the stop and goes on (`went_on`); must end the process.
        self.on_caught: Callable[[], NoReturn] | None = None
        self.unprofiled_steps = 0  # steps taken before any call of a module with parameters
        self.backwards = 0  # backward passes (and autograd.grad calls) before the first optimizer step
        self.backward_depth = 0  # backward passes running (a checkpointed forward's backward nests one)
        self.short_batch: tuple[int, int] | None = None  # an epoch's short last batch: (its size, the full one)
        self.short_moved = False  # that short batch was sampled second
        self.epochs_open = 0  # a DataLoader's epochs begun and not ended (`carma.estimate.epochs`)
        self.ending = False  # the capture has its iterations: epochs end early (`_after_epoch`: one more or none)
        self.calls_after_ending = 0  # model calls in eval mode since (an epoch's end that runs one: validation)
        self._open: list[Any] = []  # the trace windows of the steps running (an optimizer may call another's)
        self._threads = threading.local()  # each thread's stack of module calls running
        self.on_stop: list[Callable[[], None]] = []  # called in the hook that stops the job, in order
        # The optimizers the script holds whose parameters none has updated yet: the capture waits a while.
        self.awaits: Callable[[], list[Any]] | None = None
        # Iterations to run at least: one more after a late optimizer's first step or a moved short batch.
        self._until = 0
        self.notes: list[str] = []  # for the user: where the capture differs from the GPU run
        self.mixed_precision: list[str] = []  # the autocast the job trained in: CUDA_AUTOCAST, CPU_AUTOCAST
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
            self._running.enter_context(value_free_arithmetic(self.values_computed))

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
                f"the script holds {_optimizer_names(waiting)} that never stepped in {finished} iterations: its "
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

        if self.stopped:
            self.went_on()
        outermost = not self._calls and next(module.parameters(), None) is not None
        if outermost:
            if self.profiler is None:
                check_host_memory(module)
            self.start()
        window = None
        if self.profiler is not None:
            window = record_function(module_window(module))
            window.__enter__()
        self._calls.append(window)
        if outermost and self.ending:
            self._after_epoch(module)

    def _after_epoch(self, module: Any) -> None:
        """A model call after the capture ended an epoch. One in eval mode is the epoch's end (a validation pass):
        the capture goes on to the next epoch's step. A training call with none before it is that step's own:
        the epoch's end did nothing on the GPU, and the capture stops as it would have without ending the
        epoch (its estimate reads the iterations up to the last step)."""
        if not module.training:
            self.calls_after_ending += 1
        elif not self.calls_after_ending:
            self._stop()

    def leave_module(self, module: Any, args: Any, output: Any) -> None:
        """Global forward hook, called even when the forward raises."""
        window = self._calls.pop()
        if window is not None:
            window.__exit__(None, None, None)

    def values_computed(self) -> bool:
        """Whether every value the job's code can read here is computed: outside the model's calls, the
        backward passes and the optimizer steps (in a data loader's collate function, say), no operator's
        arithmetic was skipped to make it, as long as the code does not read the model's outputs."""
        return not self.in_module_call and not self._open and not self.backward_depth

    @property
    def in_module_call(self) -> bool:
        """Whether a module's forward is running in this thread (after `leave_module` of the outermost
        call: no longer)."""
        return bool(self._calls)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        from torch.profiler import record_function

        if self.stopped:
            self.went_on()
            raise StepLimitReached  # another thread's step
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
            self.unprofiled_steps += 1
            if self.unprofiled_steps >= WAIT_FACTOR * self.steps:  # trains tensors no module holds: give up
                self._stop()
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
            if self.epochs_open and not self.ending:
                self._end_epochs(finished)
            else:
                self._stop()
        self.profiler.step()

    def _end_epochs(self, finished: int) -> None:
        """The capture has its iterations inside a DataLoader's epoch: end the epoch there, let the code after it
        run and, when that code called the model in eval mode, take one iteration of the next epoch before
        stopping (`_after_epoch`, `carma.estimate.epochs`)."""
        self.ending = True
        self._until = finished + 1

    def script_ended(self) -> None:
        """The script ended by itself. After an epoch the capture ended, with no step of a next one: what it did
        at the epoch's end ran (a note when it called the model), but xMem reads the iterations up to the last
        step only."""
        if self.ending and not self.stopped and self.calls_after_ending:
            self.notes.append(
                f"the script ended after the epoch the capture ended (after {EPOCH_END_BATCHES} batches or more): "
                "what it does at an epoch's end (a validation pass, say) is not in the estimate (a script that "
                "trains two epochs or more has it captured)"
            )

    def opened(self, change: int) -> None:
        """A DataLoader's epoch began (+1) or ended (-1)."""
        self.epochs_open += change

    def backward_ran(self) -> None:
        """A backward pass (or `torch.autograd.grad`) ended: counted until the first optimizer step, and the
        job stopped at `BACKWARDS_WITHOUT_STEP` of them."""
        if self.order or self.unprofiled_steps or self.stopped:
            return
        self.backwards += 1
        if self.backwards >= BACKWARDS_WITHOUT_STEP:
            self._stop()

    def short_batch_seen(self, short: int, full: int, moved: bool) -> None:
        """An epoch ends with a short batch (`carma.estimate.epochs`). Moved to be trained second, capture one
        iteration more than asked, so that a full batch after a full one is captured as well as one after the
        short."""
        self.short_batch = (short, full)
        if not moved:
            return
        self.short_moved = True
        note = (
            f"each epoch's short last batch ({short} samples, not {full}) was trained second, so that the "
            "step after it, which the GPU run takes at every epoch's end, is captured (one step more)"
        )
        if note not in self.notes:
            self.notes.append(note)
            self._until = max(self._until, self.steps + 1)

    def _index(self, optimizer: Any) -> int:
        return next((i for i, known in enumerate(self.optimizers) if known is optimizer), len(self.optimizers))

    def went_on(self) -> None:
        """A module call or step after the stop. In the thread the stop was raised in, the script caught
        `StepLimitReached` (a bare `except:` around its step, "skip a bad batch") and went on, or calls its
        model while unwinding (a `finally:` that evaluates). The capture is complete: `on_caught` finishes
        it without the script; without one, the stop is raised again, so that the script trains no further
        than its next model call. Another thread's module call (a prefetching thread's transform) goes on."""
        if threading.get_ident() != self._stopped_in:
            return
        if self.on_caught is not None:
            self.on_caught()
        raise StepLimitReached

    def _stop(self) -> None:
        self.stopped = True
        self._stopped_in = threading.get_ident()
        for call in self.on_stop:
            call()
        raise StepLimitReached


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
def capturing(steps: int, exact: bool, short_second: bool = True) -> Iterator[Session]:
    """Step and module hooks, CUDA-like operators, CUDA's autocast (the regions the job entered in
    `Session.mixed_precision`) and, if `short_second`, each epoch's short batch second
    (`carma.estimate.epochs`) around the body; the session's profiler (and, unless `exact`, the
    value-free arithmetic) starts where the training begins: at the first call of a module with
    parameters, or earlier if the caller starts it. The trace is exported when the body ends without an
    exception. Hooks the body registers later run after the session's, inside its module windows."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    session = Session(steps, exact)
    handles = [
        register_optimizer_step_pre_hook(session.before_step),
        register_optimizer_step_post_hook(session.after_step),
        register_module_forward_pre_hook(session.enter_module),
        register_module_forward_hook(session.leave_module, always_call=True),
    ]
    try:
        epochs = captured_epochs(session.short_batch_seen, lambda: session.ending, session.opened, short_second)
        with cuda_like_operators(), cuda_autocast() as regions, epochs, _counting_backwards(session):
            yield session
            named = {"cuda": CUDA_AUTOCAST, "cpu": CPU_AUTOCAST}
            session.mixed_precision = [named[device] for device in dict.fromkeys(regions) if device in named]
            session.notes += _history_notes(session.optimizers)
    except BaseException:
        session.stop(export=False)
        raise
    else:
        session.stop(export=True)
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _counting_backwards(session: Session) -> Iterator[None]:
    """Call `session.backward_ran` after each `torch.autograd.backward` and `torch.autograd.grad`
    (`Tensor.backward` calls the first) that the job makes, and keep `session.backward_depth`. Only
    outermost calls count: under a torch function mode (the capture's `cuda_on_cpu`) `grad` calls itself
    once more, and a checkpointed forward's backward nests one."""
    import torch.autograd

    originals = torch.autograd.backward, torch.autograd.grad

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            session.backward_depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                session.backward_depth -= 1
            if not session.backward_depth:
                session.backward_ran()
            return result

        return call

    torch.autograd.backward, torch.autograd.grad = map(counted, originals)
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = originals


def _chrome_trace(prof: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") in _TRACE_CATEGORIES]


def _history_notes(optimizers: Sequence[Any]) -> list[str]:
    """L-BFGS keeps a pair of parameter-sized vectors per iteration, up to `history_size` pairs: the few steps
    captured (whose values, uncomputed, may also end its iterations early) hold fewer than its later steps."""
    from torch.optim import LBFGS

    notes = []
    for optimizer in optimizers:
        if isinstance(optimizer, LBFGS):
            history = optimizer.defaults["history_size"]
            most = 2 * history * sum(p.numel() * p.element_size() for p in optimizer_parameters(optimizer))
            notes.append(
                f"LBFGS keeps up to {history} pairs of parameter-sized vectors, filled over its first iterations: "
                f"later steps than those captured may hold up to {size_text(most)} more optimizer state"
            )
    return notes


def _optimizer_names(optimizers: Sequence[Any]) -> str:
    """`an optimizer (SGD)`, `2 optimizers (SGD, Adam)`."""
    what = "an optimizer" if len(optimizers) == 1 else f"{len(optimizers)} optimizers"
    return f"{what} ({', '.join(type(o).__name__ for o in optimizers)})"


def hide_cuda() -> None:
    """Hide CUDA from this process, unless PyTorch already initialised it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def last_line(exc: BaseException, where: bool = True) -> str:
    """An exception as one line, with where the job raised it (`where`): a syntax error's file and line, which
    the line leaves out, or the innermost line of the job's own files (not Python's, its packages' or carma's)."""
    text = traceback.format_exception_only(exc)[-1].strip()
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    if worker := _in_a_worker(text):  # a DataLoader worker's: its own traceback, as text in the message
        text, in_worker = worker
        frames += in_worker  # the worker's innermost line of the job's, else where the job took the batch
    line = cut(text, REASON_CHARS)
    if not where:
        return line
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{line} at {_shown(exc.filename)}:{exc.lineno}"
    frames = [(file, number) for file, number in frames if not file.startswith(NOT_THE_JOBS)]
    return f"{line} at {_shown(frames[-1][0])}:{frames[-1][1]}" if frames else line


WORKER = re.compile(
    r"Caught (\w+) in (DataLoader worker process \d+)\.\s*Original Traceback \(most recent call last\):"
)
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


def _in_a_worker(text: str) -> tuple[str, list[tuple[str, int]]] | None:
    """An exception a DataLoader worker raised, which PyTorch raises again in the job with the worker's traceback
    as its message: its own last line, said to come from the worker, and the worker's frames."""
    match = WORKER.search(text)
    if match is None:
        return None
    original = text[match.end() :]
    lines = [line for line in original.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else match.group(1)
    frames = [(file, int(number)) for file, number in FRAME.findall(original)]
    return f"{last} (in {match.group(2)})", frames


# Where code that is not the job's lives: Python's library, installed packages (PyTorch's), carma's own.
NOT_THE_JOBS = (
    *{sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")},
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    "<frozen ",
)


def _shown(path: str) -> str:
    """A file of the job as the user names it: relative to the working directory when it lies within."""
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    return path if relative.startswith(os.pardir) else relative
