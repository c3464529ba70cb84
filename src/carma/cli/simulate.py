"""`carma simulate`: traces through the digital twin."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from carma.cli.common import PATH_VALUE, UsageError, app, check_writable, choice, err, fail, naming, out
from carma.sim.models import SHARING_MODES
from carma.traces.catalog import ESTIMATOR_COLUMNS, HISTORY, LONGEST_S, MEMORY_SOURCES, OVER_LONGEST
from carma.traces.loaders import BUILTIN_TRACES
from carma.units import pluralize

if TYPE_CHECKING:
    from rich.table import Table

    from carma.core.types import Task
    from carma.sim.experiment import RunConfig, RunResult, TwinConfig
    from carma.traces.loaders import Trace


def _twin_config(config_path: Path | None, gpus: str | None, sharing: str | None) -> TwinConfig:
    from carma.config import load_config
    from carma.sim.gpus import parse_gpus

    settings = load_config(config_path)
    if ignored := [f"[{name}]" for name in ("server", "estimate", "mig") if name in settings.tables]:
        err.print(
            f"warning: {config_path}: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} for carma server; "
            "carma simulate reads [scheduler] and [twin] (MIG runs: --mig, --scheme, --layout, --no-predict)"
        )
    twin = settings.twin
    if gpus is not None:
        twin = replace(twin, gpus=parse_gpus(gpus))
    if sharing is not None:
        twin = replace(twin, sharing=choice(sharing, SHARING_MODES, "--sharing"))
    return twin


@app.command("simulate")
def simulate_cmd(
    trace: Annotated[
        str, typer.Option(help=f"Built-in trace ({', '.join(BUILTIN_TRACES)}) or a trace file path.")
    ] = "carma-t1",
    policy: Annotated[
        str | None, typer.Option(help="exclusive, rr, magm, lug, ff, bf or pair (default: magm, or the config's).")
    ] = None,
    memory: Annotated[str, typer.Option(help=f"Memory-need source: {', '.join(MEMORY_SOURCES)}.")] = "none",
    no_risk_filter: Annotated[bool, typer.Option("--no-risk-filter", help="Switch the risk filter off.")] = False,
    gpus: Annotated[
        str | None, typer.Option(help="Simulated GPUs, e.g. 4xH100-80GB (default: 3xA100-40GB, or the config's).")
    ] = None,
    sharing: Annotated[
        str | None, typer.Option(help="GPU sharing mode: mps or timeslice (default: mps, or the config's).")
    ] = None,
    sweep_all: Annotated[
        bool, typer.Option("--sweep", help="Run CARMA's whole configuration list and compare with Exclusive.")
    ] = False,
    csv_path: Annotated[
        Path | None,
        typer.Option("--csv", help="Also write the results as CSV (-: print them instead of the table).", **PATH_VALUE),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write PNG charts of a sweep into this directory.", **PATH_VALUE)
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(help="Also write the run(s) as a report file (JSON) for `carma report`.", **PATH_VALUE),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    skip_unknown: Annotated[
        bool, typer.Option("--skip-unknown", help="Leave out trace entries of unknown tasks.")
    ] = False,
    limit: Annotated[
        int | None, typer.Option(help="Only the trace's first N tasks (those `carma replay --limit N` submits).", min=1)
    ] = None,
    show_bounds: Annotated[
        bool,
        typer.Option("--bounds", help="Also print what no policy can beat, and each run's share of that gain."),
    ] = False,
    jobs: Annotated[
        int, typer.Option(help="Processes for a sweep or jittered copies (worth it for long traces).", min=1)
    ] = 1,
    jitter: Annotated[
        float | None,
        typer.Option(
            help="Run seeded copies of the trace, each arrival moved by up to this many seconds either way, and "
            "report each figure's mean and spread over them.",
            min=0,
        ),
    ] = None,
    seeds: Annotated[
        int | None, typer.Option(help="With --jitter: how many copies, seeds 0 to N-1 (default 4).", min=1)
    ] = None,
    mig: Annotated[
        str,
        typer.Option(
            help="off; dynamic: carma partitions every GPU into MIG instances per task; static: each keeps --layout."
        ),
    ] = "off",
    layout: Annotated[
        str | None,
        typer.Option(
            help="With --mig static: the MIG instances, e.g. 4g.20gb@0,3g.20gb@4, for every GPU (or each GPU's, by ;)."
        ),
    ] = None,
    scheme: Annotated[
        str | None, typer.Option(help="With --mig dynamic: a groups the queue by size (bounded), b is FIFO (default).")
    ] = None,
    no_predict: Annotated[
        bool,
        typer.Option(
            "--no-predict",
            help=(
                "No memory-growth prediction: no early restart of a task predicted to outgrow its MIG instance "
                "or its GPU beside others, no growth held against new tasks on a shared GPU."
            ),
        ),
    ] = False,
    config: Annotated[Path | None, typer.Option(help="TOML configuration file.", **PATH_VALUE)] = None,
) -> None:
    """Run a trace through the digital twin of a GPU server."""
    from carma.config import ConfigError
    from carma.core.mig.scheduling import SCHEMES
    from carma.core.policies import POLICY_NAMES
    from carma.pyplot import PlotsUnavailable, pyplot
    from carma.reports.plots import plot_sweep
    from carma.reports.record import from_run_result, write_records
    from carma.reports.seeds import seed_rows, seed_table
    from carma.reports.tables import run_table, sweep_rows, sweep_table, write_csv
    from carma.sim.experiment import MIG_MODES, RunConfig, paper_sweep
    from carma.sim.migtwin import parse_layout
    from carma.sim.twin import SimulationStalled
    from carma.traces.catalog import load_catalog
    from carma.traces.loaders import TraceError, load_trace

    csv_out = csv_path == Path("-")  # the CSV on stdout, in the table's place
    try:
        if csv_out and as_json:
            raise UsageError("--csv - and --json both print the results: choose one")
        if save == Path("-"):  # `--csv -` prints; a report file is for `carma report` to read
            raise UsageError(
                "--save - : the report file is written to a file; give its name (--json prints the figures)"
            )
        seed_list = _seeds(jitter, seeds, bounds=show_bounds, plot=plot, save=save)
        if plot:
            pyplot()  # missing matplotlib, or a folder that cannot be made, is said before the simulation
            if plot.exists() and not plot.is_dir():
                raise UsageError(f"--plot {plot} is a file; give a folder")
            plot.mkdir(parents=True, exist_ok=True)
        files = {option: path for option, path in (("--csv", None if csv_out else csv_path), ("--save", save)) if path}
        if len(files) == 2 and files["--csv"].resolve() == files["--save"].resolve():
            raise UsageError(f"--csv and --save both name {save}: the CSV would replace the report file")
        for option, path in files.items():
            if Path(trace).exists() and path.resolve() == Path(trace).resolve():
                raise UsageError(f"{option} {path} is the trace: the results would replace it")
        for option, path in files.items():  # said before the simulation too, not after its minutes
            check_writable(option, path)
        twin = _twin_config(config, gpus, sharing)
        if trace in BUILTIN_TRACES and Path(trace).exists():
            err.print(f"note: {trace} is the built-in trace; the file of that name here is --trace ./{trace}")
        loaded = load_trace(trace, load_catalog(), skip_unknown=skip_unknown)
        loaded = replace(loaded, entries=loaded.entries[:limit])
        if loaded.skipped:
            err.print(loaded.skipped_note())
        if sweep_all:
            if mig != "off":
                raise UsageError("--sweep runs the paper's configurations on whole GPUs; drop --mig")
            if policy is not None or memory != "none" or no_risk_filter:
                raise UsageError("--sweep runs the paper's configuration list; drop --policy/--memory/--no-risk-filter")
            runs = paper_sweep(twin.scheduler.risk.enabled)
        else:
            chosen = choice(policy, POLICY_NAMES, "--policy") if policy is not None else None
            mode = choice(mig, MIG_MODES, "--mig")
            if (mode == "static") != (layout is not None):
                raise UsageError("--mig static takes a --layout (e.g. 4g.20gb@0,3g.20gb@4), and only it does")
            if scheme is not None and mode != "dynamic":
                raise UsageError("--scheme applies to --mig dynamic only")
            if chosen is not None and mode != "off":  # the JSON said "policy": "rr" of a run that used none
                raise UsageError(
                    f"--mig {mode} places each task by its need's MIG profile, not by a policy: drop --policy"
                )
            risk_filter = twin.scheduler.risk.enabled and not no_risk_filter
            run = RunConfig(
                chosen or twin.scheduler.policy,
                choice(memory, MEMORY_SOURCES, "--memory"),
                risk_filter,
                mig=mode,
                scheme=choice(scheme or "b", SCHEMES, "--scheme"),
                predict=not no_predict,
                layout=tuple(parse_layout(gpu) for gpu in layout.split(";")) if layout else (),
            )
            runs = (run,)
        per_seed = _simulated(loaded, runs, twin, jobs, as_json or csv_out, jitter or 0.0, seed_list)
        _note_missing_estimates(loaded, dict.fromkeys(run.memory for run in runs))
        results = [result for copy in per_seed for result in copy]
        rows_of = sweep_rows if sweep_all else lambda copy: [r.row() for r in copy]
        rows = rows_of(results) if seed_list is None else seed_rows(per_seed)
        bounds, bounds_shown = _bounds(loaded, twin, results, rows) if show_bounds else (None, None)
        if bounds_shown is None and show_bounds:
            err.print("note: no bounds: no task of the trace fits a GPU of this server (each fails under every policy)")
        if csv_out:
            write_csv(rows, sys.stdout)
        elif csv_path:
            with naming("--csv", csv_path), open(csv_path, "w", newline="") as f:
                write_csv(rows, f)
        charts = plot_sweep(results, plot) if plot else []
        if save:
            source = f"carma simulate, trace {loaded.name} on {server_name(results[0], twin)}"
            with naming("--save", save):
                write_records([from_run_result(r, source) for r in results], save)
    except (UsageError, ConfigError, TraceError, PlotsUnavailable, SimulationStalled, ValueError, OSError) as e:
        raise fail(e) from None
    if as_json or csv_out:
        if as_json:
            document = {"trace": loaded.name, "gpus": list(results[0].gpus), "sharing": twin.sharing, "runs": rows}
            if seed_list is not None:  # and each seed's runs, as a run without --jitter gives them
                copies = [{"seed": seed, "runs": rows_of(copy)} for seed, copy in zip(seed_list, per_seed, strict=True)]
                document |= {"jitter_s": jitter, "seeds": seed_list, "seed_runs": copies}
            print(json.dumps(document | ({"bounds": bounds} if bounds else {})))
        for path in [*charts, save]:
            if path:
                err.print(f"wrote {path}")
        _note_failures(results)
        return
    title = f"trace {loaded.name}: {pluralize(len(loaded.entries), 'task')} on {server_name(results[0], twin)}"
    if seed_list is not None:
        spread = f"arrivals moved by up to ±{jitter:g} s, seeds {_listed(seed_list)}"
        out.print(seed_table(rows, f"{title}; {spread}: each figure's mean (least-most) over the seeds"))
    elif sweep_all:
        out.print(sweep_table(results, f"{title}; each figure with its change against Exclusive"))
    else:
        out.print(run_table(results[0], f"{title}, {results[0].label}"))
    if bounds_shown:
        out.print(bounds_shown)
    for path in [csv_path, *charts, save]:
        if path:
            out.print(f"wrote {path}")
    _note_failures(results)


def _bounds(
    trace: Trace, twin: TwinConfig, results: Sequence[RunResult], rows: list[dict[str, object]]
) -> tuple[dict[str, object] | None, Table | None]:
    """The makespan bounds and the energy bound as JSON's `bounds` and as a table, each row given its share of
    the gain (against the run's Exclusive, simulated for it when not among the runs); none when no task fits
    (there is nothing to bound). The energy bound is for whole GPUs: None when a run is on MIG instances,
    whose speeds follow another model."""
    from carma.reports.tables import add_gain_shares, baseline_of, bounds_table
    from carma.sim.bounds import makespan_bounds
    from carma.sim.energybound import energy_bound
    from carma.sim.experiment import RunConfig, simulate

    limits = makespan_bounds(trace, twin.gpus, twin.interference, twin.sharing)
    if limits.unplaceable == len(trace.entries):
        return None, None
    exclusive = baseline_of(results) or simulate(trace, RunConfig("exclusive"), twin)
    whole_gpus = all(r.config.mig == "off" for r in results)
    energy = (
        energy_bound(trace, twin.gpus, twin.interference, twin.power, twin.sharing, limits.combined_s)
        if whole_gpus
        else None
    )
    add_gain_shares(rows, limits, exclusive.metrics.makespan_s)
    title = f"makespan{'' if energy is None else ' and energy'} bounds under the twin's models (docs/bounds.md)"
    figures = limits.as_dict() | {
        "exclusive_s": round(exclusive.metrics.makespan_s, 1),
        "energy_j": None if energy is None else round(energy.energy_j),
        "exclusive_energy_j": round(exclusive.metrics.energy_mj * 1e6),
    }
    return figures, bounds_table(limits, energy, exclusive.metrics, rows, title)


def _note_missing_estimates(trace: Trace, sources: Iterable[str]) -> None:
    """Say how many tasks an estimator run places on a whole GPU for want of a recorded estimate (a trace's
    own tasks have one only where it gives `<estimator>_mib`), so the run is not read as the estimator's; with
    history, unless an earlier run of the same task completed."""
    for history in (False, True):
        lacking = [
            f"{source} {missing} of {len(trace.entries)}"
            for source in sources
            if source.endswith(HISTORY) == history
            and (estimator := source.removesuffix(HISTORY)) in ESTIMATOR_COLUMNS
            and (missing := sum(e.workload.estimates.get(estimator) is None for e in trace.entries))
        ]
        if lacking:
            unless = " unless a run of the same task completed before" if history else ""
            err.print(f"note: tasks without a recorded estimate run on a whole GPU{unless}: {', '.join(lacking)}")


def _note_failures(results: Sequence[RunResult], limit: int = 5) -> None:
    """Name the failed tasks and why, which the figures only count (a task needing more memory than every
    simulated GPU has fails even alone). A task is its id and name: a jittered copy of the trace numbers its
    tasks in their new order."""
    from carma.core.types import TaskState

    failed: dict[tuple[int, str], list[tuple[RunResult, Task]]] = {}
    for result in results:
        for task in result.tasks:
            if task.state is TaskState.FAILED:
                failed.setdefault((task.id, task.spec.name), []).append((result, task))
    for shown, runs in enumerate(failed.values()):
        if shown == limit:
            err.print(f"note: {pluralize(len(failed) - limit, 'more task')} failed")
            break
        result, task = runs[0]
        where = "" if len(results) == 1 else f" in {len(runs)} of {len(results)} runs, e.g. {result.label}"
        err.print(f"note: task {task.id} ({task.spec.name}) failed{where}: {task.reason}")


def server_name(result: RunResult, twin: TwinConfig) -> str:
    """The simulated server as titles and report sources name it, e.g. "3xA100-40GB (MPS)"."""
    counts: dict[str, int] = {}
    for name in result.gpus:
        counts[name] = counts.get(name, 0) + 1
    sharing = "MPS" if twin.sharing == "mps" else "time-slicing"
    return ", ".join(f"{n}x{name}" for name, n in counts.items()) + f" ({sharing})"


def _seeds(jitter: float | None, seeds: int | None, **one_run: object) -> list[int] | None:
    """The seeds of the trace's jittered copies (None: the trace as it is); `one_run`, the options given that
    take a single run of a single trace, refused with --jitter."""
    if jitter is None:
        if seeds is not None:
            raise UsageError("--seeds takes --jitter (the seconds each arrival may move)")
        return None
    if not math.isfinite(jitter):
        raise UsageError(f"--jitter must be a finite number of seconds; got {jitter:g}")
    if jitter > LONGEST_S:  # a trace's times stop there too
        raise UsageError(f"--jitter {jitter:g} s {OVER_LONGEST}")
    taken = next((f"--{option}" for option, value in one_run.items() if value), None)
    if taken:
        raise UsageError(
            f"{taken} takes the runs of the trace itself, not of jittered copies: drop {taken} or --jitter"
        )
    return list(range(4 if seeds is None else seeds))


def _listed(seeds: Sequence[int]) -> str:
    return str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"


def _simulated(
    trace: Trace,
    runs: Sequence[RunConfig],
    twin: TwinConfig,
    jobs: int,
    quiet: bool,
    jitter_s: float,
    seeds: list[int] | None,
) -> list[list[RunResult]]:
    """The runs on the trace, or on each seed's jittered copy of it: one list of results per copy (one copy without
    seeds), with a progress bar on a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from carma.sim.experiment import seeded_sweep, sweep

    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=quiet or not sys.stderr.isatty()) as bar:
        task = bar.add_task("sweep", total=len(runs) * len(seeds or [None]))
        advance = lambda _: bar.advance(task)  # noqa: E731
        if seeds is None:
            return [sweep(trace, runs, twin, jobs, progress=advance)]
        return seeded_sweep(trace, runs, jitter_s, seeds, twin, jobs, progress=advance)
