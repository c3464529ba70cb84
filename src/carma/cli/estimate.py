"""`carma estimate`: a training job's peak GPU memory, estimated on the CPU before it runs."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from carma.cli.common import PATH_VALUE, UsageError, absolute, app, choice, err, fail, out
from carma.estimate.base import CAPTURE_TIMEOUT_S, TIMELINE_NOT_WRITTEN, Estimate, EstimateError
from carma.estimate.devices import BUILTIN
from carma.estimate.registry import CPU_METHODS
from carma.units import size_text

if TYPE_CHECKING:
    import click

NEEDS_TORCH = "estimating needs PyTorch: pip install 'carma-gpu[estimate]'"
_SCRIPT = "carma.estimate.script"  # where the group keeps the command given after `--`


class _ScriptGroup(TyperGroup):
    """Everything after `--` is the training command, never a subcommand name."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            split = args.index("--")
            ctx.meta[_SCRIPT] = args[split + 1 :]
            args = args[:split]
        return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and self.get_command(ctx, args[0]) is None:  # `carma estimate python train.py`: no `--`
            ctx.fail(
                f"no subcommand {args[0]!r}: put the training command after --: carma estimate -- {' '.join(args)}"
            )
        return super().resolve_command(ctx, args)


estimate_app = typer.Typer(
    cls=_ScriptGroup,
    invoke_without_command=True,
    no_args_is_help=False,
    subcommand_metavar="[-- TRAINING COMMAND...] | calibrate [OPTIONS]",
)
app.add_typer(estimate_app, name="estimate")


@estimate_app.callback()
def estimate_cmd(
    ctx: typer.Context,
    job: Annotated[
        str | None, typer.Option(help="A job function, module:function, returning a carma TrainingJob.")
    ] = None,
    method: Annotated[str, typer.Option(help=f"{', '.join(CPU_METHODS)}.")] = "xmem",
    device: Annotated[
        str,
        typer.Option(
            help=f"The GPU to estimate for (its context constant): {', '.join(BUILTIN)}, or a name that"
            " `carma estimate calibrate` stored."
        ),
    ] = "a100-40gb",
    stack: Annotated[
        str | None,
        typer.Option(
            help="The software stack the job runs on, which sets the context: cuda12-torch2, cuda13-torch2, "
            "cuda11-torch2-eager (default: the device's own, or devices.toml's `stack`)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Training iterations (optimizer steps) to run on the CPU.", min=1)] = 3,
    gpus: Annotated[
        int,
        typer.Option(
            help="The GPUs the job runs on: a model under torch.nn.DataParallel is estimated for the first of "
            "them, which holds the most (as `carma submit --gpus`).",
            min=1,
        ),
    ] = 1,
    timeout: Annotated[
        float, typer.Option(help="Seconds the capture may take to reach its steps (a large model's may need more).")
    ] = CAPTURE_TIMEOUT_S,
    timeline: Annotated[
        Path | None, typer.Option(help="xmem only: write the tensors-vs-segments plot to this PNG.", **PATH_VALUE)
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
) -> None:
    """Estimate a training job's peak GPU memory on the CPU, before it runs.

    `carma estimate -- python train.py ...` runs the script's first steps with CUDA hidden; `carma estimate
    --job module:function` runs a job function."""
    if ctx.invoked_subcommand:
        _estimate_options_unused(ctx)
        return
    script = ctx.meta.get(_SCRIPT)
    try:
        if method.lower() == "history":
            raise UsageError(
                "history is the server's estimate (the peak an earlier run of the same command was seen at): "
                "carma submit --estimate history -- ..."
            )
        method = choice(method, CPU_METHODS, "--method")
        if bool(job) == bool(script):
            raise UsageError(
                "give a training command after -- or a job function with --job (one, not both), e.g. "
                "carma estimate -- python train.py --batch-size 64"
            )
        if gpus > 1 and job:
            raise UsageError("--gpus is for a training command: a job function gives one GPU's model and batch")
        if timeline and method != "xmem":
            raise UsageError("--timeline needs --method xmem")
        if not (math.isfinite(timeout) and timeout > 0):
            raise UsageError(f"--timeout must be a positive number of seconds, not {timeout:g}")
        if timeline:
            _check_timeline(timeline)
    except UsageError as e:
        raise fail(e) from None
    python = _interpreter(script) if script else None
    if python is None:  # carma's own Python captures: every method needs PyTorch, say so before starting
        try:
            import torch  # noqa: F401
        except ImportError:
            raise fail(NEEDS_TORCH) from None
    from carma.estimate.devices import STACK_SEPARATOR, get_device

    try:
        if stack:
            named, _, other = device.lower().partition(STACK_SEPARATOR)
            if other and other != stack.lower():
                raise fail(f"--device {device} names stack {other}, --stack {stack}: give the stack once")
            device = f"{named}{STACK_SEPARATOR}{stack}"
        get_device(device)
        from carma.estimate.runner import estimate_job, estimate_script

        what = " ".join(script) if script else job
        with _status(f"capturing {what} on the CPU ({steps} optimizer steps)"), _unwound_by_signals():
            if script:
                options = {"timeline": timeline, "timeout_s": timeout, "python": python, "gpus": gpus}
                estimate = estimate_script(script, method, device, steps, **options)
            else:
                estimate = estimate_job(job, method, device, steps, timeline=timeline, timeout_s=timeout)
    except EstimateError as e:
        raise fail(e) from None
    written = timeline and not any(note.startswith(TIMELINE_NOT_WRITTEN) for note in estimate.notes)
    if as_json:  # with the table's last line: whether it fits the device
        total = _device_bytes(estimate)
        print(json.dumps({**estimate.to_json(), "device_bytes": total, "fits": estimate.peak_bytes <= total}))
        if written:  # beside the JSON, as `carma simulate --json` says what it wrote
            err.print(f"wrote {timeline}")
    else:
        _print_table(estimate)
        for note in estimate.notes:
            out.print(f"note: {note}", markup=False)
        if written:  # it said so also when a note said it was not
            out.print(f"wrote {timeline}")


def _estimate_options_unused(ctx: typer.Context) -> None:
    """Refuse an estimate's options, or a training command, given to `calibrate`, which reads neither:
    `carma estimate --device h100-80gb calibrate` stored the value under the GPU's own name."""
    given = [  # by the source's name: Typer brings a click of its own, whose enum is not click's
        param.opts[0]
        for param in ctx.command.params
        if param.name and getattr(ctx.get_parameter_source(param.name), "name", None) == "COMMANDLINE"
    ]
    if ctx.meta.get(_SCRIPT) is not None:
        given.append("a training command after --")
    if given:
        raise fail(
            f"carma estimate {ctx.invoked_subcommand} takes none of the estimate's options ({', '.join(given)}); "
            f"its own come after it: carma estimate {ctx.invoked_subcommand} --help"
        )


def _interpreter(command: list[str]) -> str | None:
    """The Python the command names (`python` on the PATH, a path, or a script's `#!` line), which runs the
    capture with its environment's packages, as the server's does; None: this one."""
    from carma.estimate.script import interpreter, is_python

    python = interpreter(command, absolute(), os.environ.get("PATH", os.defpath))
    if python is None and is_python(command[0]):
        raise fail(  # it said "the command could not run either", which left the user to guess
            f"{command[0]} is not on the PATH: activate the environment that has it, or give its path"
        )
    return python


def _check_timeline(path: Path) -> None:
    """The timeline is drawn after the capture: say before it what would stop it being written."""
    from carma.pyplot import PlotsUnavailable, pyplot

    if path.suffix.lower() != ".png":
        raise UsageError(f"--timeline writes a PNG: give a file name ending in .png, not {str(path)!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--timeline: cannot make the folder {str(path.parent)!r}: {e.strerror}") from None
    if path.is_dir():
        raise UsageError(f"--timeline: {str(path)!r} is a folder: give a file name ending in .png")
    existed = path.exists()
    try:  # a folder it may not write in, found now rather than after a capture of minutes
        path.open("ab").close()
    except OSError as e:
        raise UsageError(f"--timeline: cannot write {str(path)!r}: {e.strerror}") from None
    if not existed:
        path.unlink()
    try:
        pyplot()
    except PlotsUnavailable as e:
        raise UsageError(f"--timeline: {e}") from None


@contextmanager
def _unwound_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (a closed terminal, a batch system's stop) end the command as Ctrl-C does, through
    its cleanup: their default action killed it at once, leaving the capture's temporary folder behind."""

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _status(message: str) -> AbstractContextManager[object]:
    """A spinner on a terminal's stderr while the capture runs (seconds to minutes); nothing elsewhere."""
    return err.status(message, spinner="dots") if err.is_terminal else nullcontext()


def _device_bytes(estimate: Estimate) -> int:
    from carma.estimate.devices import get_device

    return get_device(estimate.device).total_bytes


def _print_table(estimate: Estimate) -> None:
    from dataclasses import asdict

    from rich.table import Table

    total = _device_bytes(estimate)
    table = Table(title=f"{estimate.method} estimate for {estimate.device}", title_justify="left")
    table.add_column("part")
    table.add_column("size", justify="right")
    table.add_column("MiB", justify="right")
    parts = asdict(estimate.breakdown)
    whole = _whole_mib(list(parts.values())) if estimate.breakdown.total == estimate.peak_bytes else None
    for k, (part, n) in enumerate(parts.items()):
        table.add_row(part.replace("_", " "), size_text(n), f"{whole[k] if whole else round(n / 2**20):,}")
    table.add_row("peak", size_text(estimate.peak_bytes), f"{round(estimate.peak_bytes / 2**20):,}", style="bold")
    out.print(table)
    fits = "fits" if estimate.peak_bytes <= total else "does NOT fit"
    out.print(f"{fits} in the {size_text(total)} of {estimate.device}; estimated in {estimate.seconds:.1f} s")


def _whole_mib(parts: list[int]) -> list[int]:
    """Byte counts in whole MiB that add up to their sum rounded, as a reader adds them up (each rounded
    alone, a 1455 MiB peak had parts of 1456): the largest fractions are rounded up, the rest down."""
    mib = [n / 2**20 for n in parts]
    whole = [math.floor(m) for m in mib]
    up = sorted(range(len(mib)), key=lambda i: mib[i] - whole[i], reverse=True)[: round(sum(mib)) - sum(whole)]
    return [w + (i in up) for i, w in enumerate(whole)]


@estimate_app.command("calibrate")
def calibrate_cmd(
    device: Annotated[
        str | None, typer.Option(help="Name to store the value under (default: the GPU's, e.g. a100-40gb).")
    ] = None,
    gpu: Annotated[int, typer.Option(help="Index of the local GPU to measure.", min=0)] = 0,
) -> None:
    """Measure an empty PyTorch process's GPU memory on a local GPU, for estimates on that device.

    The CUDA context and library workspaces, stored in $CARMA_HOME or the XDG config dir."""
    from carma.estimate.devices import calibrate

    try:
        measured, path = calibrate(device, gpu)
    except EstimateError as e:
        raise fail(e) from None
    out.print(f"{measured.name}: context {size_text(measured.context_bytes)} ({measured.source}); wrote {path}")
