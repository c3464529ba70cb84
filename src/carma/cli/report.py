"""`carma report`: an HTML report with charts from saved simulations and/or the daemon's recent history."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from carma.cli.common import PATH_VALUE, UsageError, app, fail, out
from carma.units import pluralize

if TYPE_CHECKING:
    from carma.reports.record import RunRecord

MAX_HOURS = 24 * 90  # how far back the daemon's API looks
DEFAULT_HOURS = 6.0


@app.command("report")
def report_cmd(
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            show_default=False,
            help="Report files written by `carma simulate --save`.",
            **{**PATH_VALUE, "metavar": "FILES"},
        ),
    ] = None,
    server: Annotated[bool, typer.Option("--server", help="Add the running daemon's recent history.")] = False,
    hours: Annotated[
        float | None,
        typer.Option(
            help=f"With --server: the window, in hours back from now. \\[default: {DEFAULT_HOURS:g}]",
            show_default=False,
        ),
    ] = None,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Directory for report.html and its charts.", **PATH_VALUE)
    ] = Path("results/report"),
) -> None:
    """Write an HTML report with charts of simulated runs or the server's history.

    Makespan and energy per configuration, completion and waiting time CDFs, per-GPU memory and SMACT over
    time with out-of-memory crashes marked."""
    from carma.pyplot import PlotsUnavailable
    from carma.reports.page import write_report
    from carma.reports.record import RecordError, from_server, read_records
    from carma.server.client import Client, ClientError

    try:
        if not files and not server:
            raise UsageError("nothing to report: give report files (from `carma simulate --save`) and/or --server")
        if out_dir.exists() and not out_dir.is_dir():
            raise UsageError(f"--out {out_dir} is a file; give a directory")
        if hours is not None and not server:
            raise UsageError("--hours is the window of --server's history: give --server too, or leave it out")
        hours = DEFAULT_HOURS if hours is None else hours
        if server and not 0 < hours <= MAX_HOURS:
            raise UsageError(f"--hours must be more than 0 and at most {MAX_HOURS}; got {hours:g}")
        runs: list[tuple[str, RunRecord]] = []  # (where from, record)
        sources: list[str] = []
        for path in files or []:
            loaded = read_records(path)
            runs += [(str(path), r) for r in loaded]
            sources.append(f"{path}: {pluralize(len(loaded), 'run')}, {loaded[0].source}")
        if server:
            record = from_server(Client(), hours)
            runs.append(("server", record))
            sources.append(f"{record.source}, the last {hours:g} h")
        page = write_report(_distinct(runs), out_dir, sources)
    except (UsageError, RecordError, ClientError, PlotsUnavailable, OSError) as e:
        raise fail(e) from None
    out.print(f"wrote {page}")


def _distinct(runs: list[tuple[str, RunRecord]]) -> list[RunRecord]:
    """The records; a label that several sources share gets, in brackets, where each came from, and one that
    is still shared (a file given twice) its number among them."""
    labels = [r.label for _, r in runs]
    named = [f"{r.label} [{where}]" if labels.count(r.label) > 1 else r.label for where, r in runs]
    numbered = [
        f"{name} #{named[:i].count(name) + 1}" if named.count(name) > 1 else name for i, name in enumerate(named)
    ]
    return [replace(r, label=label) for (_, r), label in zip(runs, numbered, strict=True)]
