"""The `carma` command."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from carma import __version__
from carma.config import ConfigError, load_config
from carma.core.config import Policy
from carma.core.scheduler import SpecError
from carma.metrics.plots import PlotsUnavailable, plot_sweep
from carma.metrics.report import run_table, sweep_rows, sweep_table, write_csv
from carma.sim.experiment import MEMORY_MODES, PAPER_SWEEP, RunConfig, RunResult, TwinConfig, simulate, sweep
from carma.sim.gpus import parse_gpus
from carma.sim.models import SHARING_MODES
from carma.traces.catalog import load_catalog
from carma.traces.loaders import BUILTIN_TRACES, TraceError, load_trace

app = typer.Typer(
    help="carma: a collocation-aware GPU resource manager for deep-learning training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 200)  # pipes and CI logs get whole rows
err = Console(stderr=True, highlight=False)


class UsageError(Exception):
    """A user mistake, reported as one line."""


def _fail(message: str) -> typer.Exit:
    """Report a user mistake as one plain line (never wrapped, never read as markup)."""
    err.print(Text("error: ", style="bold red") + Text(" ".join(message.split())), soft_wrap=True)
    return typer.Exit(2)


def _choice(value: str, choices: list[str] | tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _twin_config(config_path: Path | None, gpus: str | None, sharing: str | None) -> TwinConfig:
    twin = load_config(config_path).twin
    if gpus is not None:
        twin = replace(twin, gpus=parse_gpus(gpus))
    if sharing is not None:
        twin = replace(twin, sharing=_choice(sharing, SHARING_MODES, "--sharing"))
    return twin


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


@app.command("simulate")
def simulate_cmd(
    trace: Annotated[
        str, typer.Option(help=f"Built-in trace ({', '.join(BUILTIN_TRACES)}) or a trace file path.")
    ] = "carma-t1",
    policy: Annotated[
        str | None, typer.Option(help="exclusive, rr, magm, lug, ff or bf (default: magm, or the config's).")
    ] = None,
    memory: Annotated[str, typer.Option(help=f"Memory-need source: {', '.join(MEMORY_MODES)}.")] = "none",
    no_risk_filter: Annotated[bool, typer.Option("--no-risk-filter", help="Switch the risk filter off.")] = False,
    gpus: Annotated[str | None, typer.Option(help="Simulated GPUs, e.g. 3xA100-40GB.")] = None,
    sharing: Annotated[str | None, typer.Option(help="GPU sharing mode: mps or timeslice.")] = None,
    sweep_all: Annotated[
        bool, typer.Option("--sweep", help="Run CARMA's whole configuration list and compare with Exclusive.")
    ] = False,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Also write the results as CSV.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write PNG charts of a sweep into this directory.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    skip_unknown: Annotated[
        bool, typer.Option("--skip-unknown", help="Leave out trace entries of unknown tasks.")
    ] = False,
    jobs: Annotated[int, typer.Option(help="Processes for a sweep (worth it for long traces).", min=1)] = 1,
    config: Annotated[Path | None, typer.Option(help="TOML configuration file.")] = None,
) -> None:
    """Run a trace through the digital twin of a GPU server."""
    try:
        twin = _twin_config(config, gpus, sharing)
        loaded = load_trace(trace, load_catalog(), skip_unknown=skip_unknown)
        if loaded.skipped:
            err.print(f"skipped {len(loaded.skipped)} entries of unknown tasks: {loaded.skipped_summary()}")
        if sweep_all:
            if policy or memory != "none" or no_risk_filter:
                raise UsageError("--sweep runs the paper's configuration list; drop --policy/--memory/--no-risk-filter")
            results = _run_sweep(loaded, twin, jobs, quiet=as_json)
        else:
            chosen = Policy(_choice(policy, [p.value for p in Policy], "--policy")) if policy else None
            risk_filter = twin.scheduler.risk.enabled and not no_risk_filter
            run = RunConfig(chosen or twin.scheduler.policy, _choice(memory, MEMORY_MODES, "--memory"), risk_filter)
            results = [simulate(loaded, run, twin)]
        rows = sweep_rows(results) if sweep_all else [r.row() for r in results]
        if csv_path:
            write_csv(rows, csv_path)
        charts = plot_sweep(results, plot) if plot else []
    except (UsageError, ConfigError, TraceError, SpecError, PlotsUnavailable, ValueError) as e:
        raise _fail(str(e)) from None
    if as_json:
        print(json.dumps({"trace": loaded.name, "gpus": list(results[0].gpus), "runs": rows}))
        return
    title = f"trace {loaded.name}: {len(loaded.entries)} tasks on {_server_name(results[0])}"
    if sweep_all:
        out.print(sweep_table(results, f"{title}; each figure with its change against Exclusive"))
    else:
        out.print(run_table(results[0], f"{title}, {results[0].config.label}"))
    for path in [csv_path, *charts]:
        if path:
            out.print(f"wrote {path}")


def _server_name(result: RunResult) -> str:
    counts: dict[str, int] = {}
    for name in result.gpus:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n}x{name}" for name, n in counts.items())


def _run_sweep(trace, twin: TwinConfig, jobs: int, quiet: bool) -> list[RunResult]:
    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=quiet or not sys.stderr.isatty()) as bar:
        task = bar.add_task("sweep", total=len(PAPER_SWEEP))
        return sweep(trace, PAPER_SWEEP, twin, jobs, progress=lambda _: bar.advance(task))


twin_app = typer.Typer(help="Calibrate the digital twin on measurements and report its fidelity.", no_args_is_help=True)
app.add_typer(twin_app, name="twin")
DataOption = Annotated[
    Path | None, typer.Option("--data", help="Public datasets folder (lucid/, gpumemnet/); found beside the checkout.")
]


@twin_app.command("calibrate")
def twin_calibrate(data: DataOption = None) -> None:
    """Fit the twin's models and profiles on the measurements and write the files carma ships."""
    try:
        from carma.calibration.calibrate import calibrate, shipped_paths, write
        from carma.calibration.sources import find_datasets

        calibration = calibrate(find_datasets(data))
        paths = shipped_paths()
        write(calibration, *paths)
    except (FileNotFoundError, ImportError, ValueError) as e:
        raise _fail(str(e)) from None
    a, p, q = calibration.timeslice
    out.print(
        f"time-slicing: a={a:.3f} p={p:.2f} q={q:.2f}; MPS share {calibration.mps_share:.3f}; "
        f"power exponent {calibration.power_exponent:.3f}; {len(calibration.profiles)} task profiles"
    )
    for path in paths:
        out.print(f"wrote {path}")


@twin_app.command("validate")
def twin_validate(
    data: DataOption = None,
    report: Annotated[Path, typer.Option(help="Where to write the fidelity report.")] = Path("docs/fidelity.md"),
    jobs: Annotated[int, typer.Option(help="Processes for the trace-1 sweep.", min=1)] = 1,
) -> None:
    """Cross-validate the models, check them against the thesis, run trace 1, and write the fidelity report."""
    try:
        from carma.calibration.calibrate import calibrate
        from carma.calibration.fidelity import evaluate, findings, write_report
        from carma.calibration.sources import find_datasets

        root = find_datasets(data)
        fidelity = evaluate(calibrate(root), root, jobs)
        path = write_report(fidelity, report, "carma twin validate")
    except (FileNotFoundError, ImportError, ValueError) as e:
        raise _fail(str(e)) from None
    v = fidelity.validation
    out.print(
        f"interference: held-out MAE {v.model_mae:.4f} (baselines: "
        + ", ".join(f"{name} {mae:.4f}" for name, mae in v.baseline_mae.items())
        + ")"
    )
    for finding in findings(fidelity):
        out.print(f"{'yes' if finding.holds else 'NO '}  {finding.claim}: {finding.detail}")
    if not fidelity.shipped_matches_fit:
        err.print("the shipped parameters differ from this fit: run `carma twin calibrate`")
    out.print(f"wrote {path}")


def main() -> None:
    app()
