"""What every `carma` command shares: the Typer app, the consoles, and one-line errors."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from carma import __version__

app = typer.Typer(
    help="carma: a collocation-aware GPU resource manager for deep-learning training.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


class _Console(Console):
    """A rich console whose print is never cut by Ctrl-C. Rich empties its buffer only after writing it, so a
    KeyboardInterrupt landing between the two printed the last line again with the next message (a replay
    said `t=0s submitted task 1` twice above `error: interrupted`). A SIGINT during a print (in the main
    thread, where Python runs signal handlers) is raised again once the print has returned."""

    def print(self, *objects: object, **kwargs: object) -> None:  # type: ignore[override]
        # Not in another thread (no handler can be set there), nor over a handler set outside Python
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
            super().print(*objects, **kwargs)  # type: ignore[arg-type]
            return
        interrupted: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
        try:
            super().print(*objects, **kwargs)  # type: ignore[arg-type]
        finally:
            signal.signal(signal.SIGINT, previous)
        if interrupted:
            signal.raise_signal(signal.SIGINT)  # to the handler there was: KeyboardInterrupt by default


# No markup: what carma prints holds file, task and config names, and "[b]" or "[scheduler.risk]" in one
# must print as written
_PIPED = not sys.stdout.isatty()
out = _Console(width=200 if _PIPED else None, markup=False, soft_wrap=_PIPED)  # pipes and CI logs: whole rows, lines
err = _Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # whole lines, as logs need


def _given_path(value: str | Path) -> Path:
    """A path option's value. An empty one (an unset shell variable) is refused: Path("") is the current
    directory, and `--report ""` wrote there or said `. is a directory`."""
    if isinstance(value, Path):  # a default
        return value
    if not value:
        raise typer.BadParameter("is empty: give a path")
    return Path(value)


_given_path.__name__ = "path"  # the type Typer's help shows beside an argument (an option's is its metavar)
PATH_VALUE = {"parser": _given_path, "metavar": "PATH"}
"""typer.Option/Argument settings of every path a command takes."""


class UsageError(Exception):
    """A user mistake, reported as one line."""


def error_line(message: str) -> None:
    """Print an error as one plain line (never wrapped, never read as markup)."""
    err.print(Text("error: ", style="bold red") + Text(" ".join(message.split())))


def fail(problem: str | Exception, code: int = 2) -> typer.Exit:
    """Report a user mistake as one line; the exit to raise (status 2 unless said otherwise). An OSError
    reads "PATH: reason", not "[Errno 21] Is a directory: 'PATH'"."""
    if isinstance(problem, OSError) and problem.strerror:
        where = problem.filename
        problem = problem.strerror if where is None else f"{os.fsdecode(where)}: {problem.strerror}"
    error_line(str(problem))
    return typer.Exit(code)


def columns(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned columns (the last one free-width): instant for thousands of rows, unlike a rich Table.
    Padded by terminal cells, not characters: a CJK character or an emoji in a name takes two."""
    from rich.cells import cell_len

    widths = [max(map(cell_len, [h, *(r[i] for r in rows)])) for i, h in enumerate(headers)]
    lines = [
        "  ".join(cell + " " * (w - cell_len(cell)) for cell, w in zip(row[:-1], widths, strict=False)) + "  " + row[-1]
        for row in [list(headers), *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


NAME_CELLS = 32
"""How wide a task's name may make `carma queue` and `carma history` (as squeue cuts its NAME column); `carma
show` and `--json` give it whole."""


def clipped(text: str, cells: int = NAME_CELLS) -> str:
    """`text` cut to `cells` terminal cells, its end marked with an ellipsis: one 200-character name widened
    every line of a listing past the terminal."""
    from rich.cells import cell_len, set_cell_size

    return text if cell_len(text) <= cells else set_cell_size(text, cells - 1).rstrip(" ") + "…"


def choice(value: str, choices: list[str] | tuple[str, ...], option: str) -> str:
    """One of `choices`, in any case (`--policy MAGM`, as the papers write it, is `magm`)."""
    found = next((c for c in choices if c.lower() == value.lower()), None)
    if found is None:
        raise UsageError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
    return found


def positive(value: float, option: str) -> float:
    """A number option that must be positive and finite (a float option also takes inf and nan)."""
    if not 0 < value < math.inf:
        raise UsageError(f"{option} must be a {'finite' if value == math.inf else 'positive'} number; got {value:g}")
    return value


def check_writable(option: str, path: Path) -> None:
    """A results file's folder, made before the work that fills it (a simulation, a validation): a file in
    its way, or a folder that takes no files, is said then, not after the minutes of work."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name")
    nearest = next((folder for folder in path.parents if folder.exists()), Path("."))
    if not nearest.is_dir():
        raise UsageError(f"{option} {path}: {nearest} is not a directory")
    with naming(option, path):
        path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise UsageError(f"{option} {path}: not writable")


@contextmanager
def naming(option: str, path: Path) -> Iterator[None]:
    """An error writing a results file, named by its option (`No space left on device` alone named none)."""
    try:
        yield
    except OSError as e:
        raise UsageError(f"{option} {path}: {e.strerror or e}") from None


def absolute(path: Path | None = None) -> Path:
    """`path` (by default the working directory) absolute and resolved; one error line where that needs a
    working directory deleted under the shell (os.getcwd fails: it was a traceback)."""
    try:
        return (path or Path()).resolve()
    except FileNotFoundError:
        raise fail("the current directory no longer exists: cd into one, or give an absolute path") from None


def unwrap_help(command: Any) -> None:
    """Each paragraph of every command's help as one line, for the terminal to wrap at its width: Typer keeps a
    docstring's line breaks after its first paragraph, which cut `--help` lines mid-phrase."""
    if command.help:
        paragraphs = command.help.split("\n\n")
        command.help = "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)
    for sub in getattr(command, "commands", {}).values():
        unwrap_help(sub)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"carma {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    """carma: a collocation-aware GPU resource manager for deep-learning training."""
