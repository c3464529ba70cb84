"""A training script's capture: the user's own `python train.py ...`, run unchanged on the CPU.

Global hooks stop the script after N training iterations (N optimizer steps, or N steps of each optimizer
when several step in turn, as a GAN's do) and capture its model (the outermost module called whose
parameters the first optimizer to step holds), that model's training batch (of its last call before the
first step: not a summary's or a warm-up's) and the other modules with weights the script called or holds
(a GAN's other network, a frozen teacher, an average of the model). An optimizer the script holds that
has not stepped by then (a WGAN's generator) is waited for a while.
"""

from __future__ import annotations

import inspect
import os
import re
import runpy
import shutil
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

from carma.estimate import cuda_on_cpu, libraries, offline, replicas
from carma.estimate.base import Capture, EstimateError, Exited, TrainingJob, optimizer_parameters, tensors_in
from carma.estimate.session import (
    CPU_AUTOCAST,
    DEFAULT_STEPS,
    REASON_CHARS,
    HostMemoryShort,
    Session,
    StepLimitReached,
    capturing,
    hide_cuda,
    last_line,
)
from carma.estimate.shapes import InputShapes
from carma.units import cut, pluralize
from carma.userfiles import open_for_reading

HELD_DEPTH = 2  # how far into the script's variables held modules and optimizers are looked for
HELD_ITEMS = 64  # containers larger than this are not looked into
_COMPILE_NOTE = (
    "the script's torch.compile was left eager (on the CPU it would build CPU kernels): the estimate is the "
    "eager peak, and compiled GPU kernels usually keep fewer activations"
)
_CUDA_GRAPHS_NOTE = ", but its CUDA graphs ({}) keep a memory pool of their own, which can hold more than that"
_CUDA_GRAPHS = ("reduce-overhead", "max-autotune", "triton.cudagraphs")  # what records CUDA graphs on the GPU
_LAUNCHERS = {  # modules that start the training in processes of their own: torchrun's, Accelerate's, DeepSpeed's
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "deepspeed",
    "deepspeed.launcher.runner",
}
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?$")


class ScriptFailed(EstimateError):
    """The script crashed, exited or ended before its steps. With the arithmetic skipped, it may have read
    values the capture leaves uncomputed (a step skipped while the gradient norm is not finite, a NaN-loss
    check): the process running the capture tries again computing them."""


class ShortBatchEnded(ScriptFailed):
    """The script ended or crashed before its steps after an epoch's short batch was sampled second: its
    loop may end the epoch at a short batch (`if len(x) < batch_size: break`), or end it early with tensors
    sized for full batches, so that the GPU run never trains it."""


class ScriptExited(ScriptFailed, Exited):
    """The script exited with an error status before its steps (and may have read uncomputed values)."""


class _ModelRecorder:
    """A global module hook, run after the session's: the last call before the first optimizer step of
    every outermost module that has parameters (its training batch, not that of a summary's or warm-up's
    forward pass). When the session stops the job, the modules with parameters the script's frames hold
    are noted too."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.calls: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
        self.held: dict[int, Any] = {}
        self.templates: dict[int, Any] = {}  # layers nn.TransformerEncoder/Decoder were built by copying
        self.inputs = InputShapes()
        session.on_stop.append(self._note_held)
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
        """The global forward hook, and a note of each layer `nn.TransformerEncoder(layer, n)` (or Decoder)
        copies n times: the script holds that template, which stays on the CPU and is never called, and it
        was counted as weights on the GPU (and made the baselines refuse the job as one of several models)."""
        from torch.nn.modules import transformer
        from torch.nn.modules.module import register_module_forward_hook

        clones = transformer._get_clones

        def noting_template(module: Any, n: int) -> Any:
            self.templates[id(module)] = module
            return clones(module, n)

        handle = register_module_forward_hook(self._leave, with_kwargs=True, always_call=True)
        transformer._get_clones = noting_template
        try:
            yield
        finally:
            transformer._get_clones = clones
            handle.remove()

    def _leave(self, module: Any, args: Any, *rest: Any) -> None:
        """Runs after the session's own forward hook, which has closed this call's window."""
        if self.session.in_module_call or next(module.parameters(), None) is None:
            return
        kwargs = rest[0] if len(rest) == 2 and isinstance(rest[0], dict) else {}
        if not self.session.order:
            self.calls[id(module)] = (module, tuple(args), dict(kwargs))
        self.inputs.record(len(self.session.order), module, tuple(args), kwargs)

    def inputs_held(self) -> set[int]:
        """The ids of the tensors the recorded calls were given: alive at the stop because they are recorded
        (a GAN's noise, made before the loop's first model call), they are a module's batch, not data the
        job keeps on the GPU."""
        return {id(t) for _, args, kwargs in self.calls.values() for t in tensors_in((args, kwargs))}

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
        held = {key: module for key, module in self.held.items() if key not in self.templates}
        modules = {**held, **{id(module): module for module, _, _ in self.calls.values()}}
        return tuple(
            module
            for module in modules.values()
            if module is not model and any(id(p) not in inside for p in module.parameters())
        )


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


def parse_argv(argv: list[str], cwd: str | Path | None = None) -> tuple[str, str, list[str]]:
    """("path", script, args), ("module", name, args) or ("code", source, args) from a command line such as
    `python train.py` (a relative script path is looked up in `cwd`, by default the current directory)."""
    args = list(argv)
    interpreted = bool(args) and is_python(args[0])
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
            if args[1] in _LAUNCHERS:  # its workers, other processes, would train out of the capture's sight
                raise EstimateError(
                    f"python -m {args[1]} is a launcher: give `python script.py ...` (the script it starts, "
                    "with its arguments)"
                )
            return "module", args[1], args[2:]
    if not args:
        raise EstimateError("no training script given")
    path = Path(cwd or ".") / args[0]
    if path.is_dir():  # `python app` runs app/__main__.py with app first on sys.path, as `python app/__main__.py` does
        main = os.path.join(args[0], "__main__.py")
        if (path / "__main__.py").is_file():
            raise EstimateError(f"{args[0]} is a folder: give the script Python runs in it, `python {main} ...`")
        raise EstimateError(f"{args[0]} is a folder, and has no __main__.py for Python to run")
    if not path.is_file():
        if not interpreted and shutil.which(args[0]):  # `torchrun train.py`, `accelerate launch ...`
            raise EstimateError(
                f"{args[0]} is a program, not a Python script: give `python script.py ...` (for a launcher such "
                "as torchrun, the script it starts, with its arguments)"
            )
        raise EstimateError(f"training script {args[0]} does not exist (give `python script.py ...`)")
    program = shebang_program(path) if not interpreted else None
    if program and not is_python(program):  # `./run.sh`
        raise EstimateError(
            f"{args[0]} is a {os.path.basename(program)} script, not a Python one: give `python script.py ...` "
            "(the training script it starts, with its arguments)"
        )
    return "path", args[0], args[1:]


def is_python(program: str) -> bool:
    """Whether a command's program is a Python interpreter (`python`, `/opt/venv/bin/python3.11`)."""
    return bool(_PYTHON.search(os.path.basename(program)))


def interpreter(argv: Sequence[str], cwd: str | Path, path: str) -> str | None:
    """The Python a command runs: its `python` looked up on `path` (a PATH), or the one an executable
    script's `#!` line names, so that the capture uses that environment's packages; None (carma's own)
    when the command names no interpreter, or names one that is not there."""
    first = argv[0]
    if not is_python(first):
        first = shebang_program(Path(cwd, first)) or ""
        if not is_python(first):
            return None
    if "/" in first:
        return str(Path(cwd, first))
    return shutil.which(first, path=path)  # as an exec looks it up: None if it is not there


def shebang_program(path: Path) -> str | None:
    """The program an executable script's first line runs it with: `/usr/bin/python3` for
    `#!/usr/bin/python3`, `bash` for `#!/usr/bin/env bash` (looked up on the PATH); None without one. Only a
    regular file is read (the server reads a user's command as root, on its event loop: a FIFO named as the
    program would block it, a device be opened)."""
    try:
        with open_for_reading(Path(os.path.realpath(path)), single_link=False) as f:
            line = f.readline(256)
    except OSError:
        return None
    words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    return words[0] if words else None


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


def capture_script(
    argv: list[str],
    steps: int = DEFAULT_STEPS,
    *,
    exact: bool = False,
    short_second: bool = True,
    gpus: int = 1,
    on_caught: Callable[[Callable[[], Capture]], NoReturn] | None = None,
) -> Capture:
    """Run the script in THIS process until `steps` optimizer steps are done, and capture it; `short_second`:
    sample each epoch's short batch second (`carma.estimate.epochs`); `gpus`: the GPUs the job runs on, for
    a model under DataParallel (`carma.estimate.replicas`). A script that catches the stop and
    goes on (`Session.went_on`) is, given `on_caught`, not waited for: at its next model call `on_caught`
    gets what makes the capture (undoing the capture's hooks first), and must end the process there.

    It takes over the process (sys.argv, global hooks, whatever the script leaves behind): call it in a
    process of its own, as `carma.estimate.runner.estimate_script` does.
    """
    kind, target, args = parse_argv(argv)
    hide_cuda()
    started = time.perf_counter()
    with ExitStack() as running:
        session = running.enter_context(capturing(steps, exact, short_second))
        recorder = _ModelRecorder(session)
        running.enter_context(recorder.hooks())
        compiled = running.enter_context(_compile_calls())
        mixed_precision = running.enter_context(libraries.mixed_precision_without_gpu())
        cuda = running.enter_context(cuda_on_cpu.cuda_on_cpu(before_training=lambda: session.profiler is None))
        downloads = running.enter_context(offline.watching_downloads())
        parallel = running.enter_context(replicas.data_parallel(gpus))
        session.on_stop.append(cuda.hold)
        # The script's warnings are recorded and dropped: the parent reads stderr only when the child dies.
        running.enter_context(warnings.catch_warnings(record=True))

        def captured() -> Capture:
            """The capture, once the capture's hooks and patches are undone (already, after this block)."""
            running.close()
            seconds = time.perf_counter() - started
            notes = [replicas.NOTE.format(gpus=max(parallel))] if parallel else []
            return _captured(session, recorder, compiled, mixed_precision, cuda, seconds, notes)

        if on_caught is not None:
            session.on_caught = lambda: on_caught(captured)
        try:
            sys.argv = ["-c" if kind == "code" else target, *args]
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "code":  # as `python -c` runs it: in __main__, the current directory on sys.path
                sys.path.insert(0, "")
                exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.path.insert(0, str(Path(target).resolve().parent))
                runpy.run_path(target, run_name="__main__")
        except StepLimitReached:
            pass
        except HostMemoryShort as exc:
            raise EstimateError(str(exc)) from None
        except SystemExit as exc:
            if isinstance(exc.code, str):  # sys.exit("usage: ..."): the message is the reason
                exited = f"the script exited after {_steps_taken(session)}: {cut(exc.code, REASON_CHARS)}"
                asked = _stopped_without_cuda(session, cuda)
                raise ScriptFailed(cuda_on_cpu.explained(exited, exc.code, asked)) from None
            if exc.code not in (None, 0):
                exited = f"the script exited with status {exc.code} after {_steps_taken(session)}"
                raise ScriptExited(exited, _stopped_without_cuda(session, cuda)) from None
            if not session.order:  # `train.py --help`, say
                raise ScriptFailed(
                    f"the script exited (status {exc.code or 0}) before its first optimizer step; the capture needs "
                    f"{steps} training steps"
                ) from None
        except Exception as exc:
            crash = f"the script crashed after {_steps_taken(session)}: {last_line(exc)}"
            if isinstance(exc, EOFError):  # input(): its prompt went unseen, with the rest of its output
                crash += " (the capture gives the script no input: let it run without asking)"
            crash = offline.explained(crash, exc, downloads)
            explained = cuda_on_cpu.explained(crash, last_line(exc, where=False), _stopped_without_cuda(session, cuda))
            raise (ShortBatchEnded if session.short_moved else ScriptFailed)(explained) from None
        if not session.order and session.unprofiled_steps:
            raise EstimateError(
                f"the script took {session.unprofiled_steps} optimizer steps without calling a torch.nn.Module with "
                "parameters: the capture finds the model, its batch and where training begins by the module calls "
                "(hold the trained tensors as parameters of a module the loop calls)"
            )
        if not session.order:
            ran = f"ran {session.backwards} backward passes without" if session.stopped else "never reached"
            raise ScriptFailed(
                f"the script {ran} an optimizer step; the capture needs {steps} training steps, each a "
                "torch.optim optimizer's step() (weights updated by hand are not found; a script that trains in "
                "processes it starts, with torch.multiprocessing.spawn say, is captured from a job function: --job)"
            )
        session.script_ended()
        if not session.stopped and session.finished(ended=True) < steps:
            each = f" of each of its {len(session.optimizers)} optimizers" if len(session.optimizers) > 1 else ""
            raise (ShortBatchEnded if session.short_moved else ScriptFailed)(
                f"the script ended after {_steps_taken(session)}; the capture needs {steps}{each} (let it train "
                f"longer, or capture fewer steps with --steps {max(1, len(session.order))})"
            )
    return captured()


def _steps_taken(session: Session) -> str:
    return pluralize(len(session.order), "optimizer step")


def _stopped_without_cuda(session: Session, cuda: cuda_on_cpu.Requests) -> bool:
    """The script stopped before training after asking whether CUDA is available: likely because it is not."""
    return cuda.asked_if_available and not session.order


def _captured(
    session: Session,
    recorder: _ModelRecorder,
    compiled: list[str],
    mixed_precision: list[str],
    cuda: cuda_on_cpu.Requests,
    seconds: float,
    notes: list[str],
) -> Capture:
    """The capture of a script whose capture session has ended; `notes`: the script's own beside the session's."""
    first, *others = session.optimizers
    model, batch = recorder.model_of(first)
    job = TrainingJob(model=model, batch=batch, loss=None, optimizer=first)
    extra_models = recorder.besides(model)
    notes = [*session.notes, *notes]
    notes += cuda_on_cpu.notes(cuda.asked)
    notes += recorder.inputs.note(session.order, session.short_batch)
    if compiled:
        notes.append(_compile_note(compiled))
    # A library's GPU-only mixed precision ran as CPU autocast: that autocast is the library's.
    precision = [*dict.fromkeys(mixed_precision)]
    precision += [used for used in session.mixed_precision if not (precision and used == CPU_AUTOCAST)]
    inputs = recorder.inputs_held()
    return Capture(
        job,
        session.trace,
        session.steps,
        seconds,
        extra_models,
        tuple(others),
        tuple(notes),
        mixed_precision=tuple(precision),
        cuda_data=tuple(t for t in cuda.held.values() if id(t) not in inputs),
    )
