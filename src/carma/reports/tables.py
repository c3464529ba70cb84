"""Result tables: one run's figures, and a sweep's figures with their change against Exclusive."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from typing import TextIO

from rich.table import Table

from carma.metrics.run import NOT_MEASURED, RunMetrics
from carma.sim.bounds import Bounds
from carma.sim.energybound import EnergyBound
from carma.sim.experiment import RunResult
from carma.units import in_unit, time_format, time_unit

# (row key, column header, scale, format) for the figures a sweep compares against the baseline, besides
# the makespan, whose unit is the runs' own (`_compared`)
COMPARED = (
    ("energy_mj", "energy MJ", 1.0, "{:.2f}"),
    ("energy_per_task_kj", "kJ/task", 1.0, "{:.0f}"),
    ("jct_p95_s", "p95 JCT min", 1 / 60, "{:.0f}"),
    ("wait_p95_s", "p95 wait min", 1 / 60, "{:.0f}"),
    ("exec_p95_s", "p95 exec min", 1 / 60, "{:.0f}"),
    ("smact_mean", "SMACT", 1.0, "{:.2f}"),
    ("smocc_mean", "SMOCC", 1.0, "{:.2f}"),
    ("mem_used_mean_mib", "mem GiB", 1 / 1024, "{:.1f}"),
)


def change_pct(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline == 0:
        return None
    return 100.0 * (value - baseline) / baseline


def baseline_of(results: Sequence[RunResult]) -> RunResult | None:
    return next((r for r in results if r.config.label == "Exclusive"), None)


def sweep_rows(results: Sequence[RunResult]) -> list[dict[str, object]]:
    """Each run's row, with `<figure>_change_pct` against Exclusive when the sweep has it."""
    base = baseline_of(results)
    rows = []
    for result in results:
        row = result.row()
        if base is not None:
            base_row = base.row()
            for key in ("makespan_s", *(key for key, *_ in COMPARED)):
                change = change_pct(row[key], base_row[key])
                row[f"{key}_change_pct"] = None if change is None else round(change, 1)
        rows.append(row)
    return rows


def _compared(results: Sequence[RunResult]) -> list[tuple[str, str, float, str]]:
    """The makespan, in hours or, when every run is shorter than two hours, minutes (as the charts), then
    COMPARED."""
    scale, name = time_unit(max(r.metrics.makespan_s for r in results))
    return [("makespan_s", f"makespan {name}", 1 / scale, "{:" + time_format(name) + "}"), *COMPARED]


def _cell(row: dict[str, object], key: str, scale: float, fmt: str) -> str:
    if row[key] is None:
        return NOT_MEASURED
    text = fmt.format(float(row[key]) * scale)
    change = row.get(f"{key}_change_pct")
    return text if change is None else f"{text} {round(change):+d}%"  # round: a change of -0.3% is "+0%"


def sweep_table(results: Sequence[RunResult], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("configuration", no_wrap=True)
    compared = _compared(results)
    for _, header, _, _ in compared:
        table.add_column(header, justify="right")
    table.add_column("OOMs", justify="right")
    table.add_column("done/failed", justify="right")
    for row in sweep_rows(results):
        cells = [_cell(row, key, scale, fmt) for key, _, scale, fmt in compared]
        table.add_row(
            str(row["config"]), *cells, str(row["oom_crashes"]), f"{row['tasks_completed']}/{row['tasks_failed']}"
        )
    return table


def _minutes(mean_s: float | None, p95_s: float | None) -> str:
    if mean_s is None or p95_s is None:
        return NOT_MEASURED
    return f"{mean_s / 60:.1f} / {p95_s / 60:.1f} min"


def run_table(result: RunResult, title: str) -> Table:
    m = result.metrics
    unit = time_unit(m.makespan_s)
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, value in (
        ("makespan", f"{in_unit(m.makespan_s, unit)} {unit[1]}"),
        ("energy", f"{m.energy_mj:.2f} MJ"),
        (
            "energy per completed task",
            NOT_MEASURED if m.energy_per_task_kj is None else f"{m.energy_per_task_kj:.0f} kJ",
        ),
        ("OOM crashes", str(m.oom_crashes)),
        ("tasks completed / failed", f"{m.tasks_completed} / {m.tasks_failed}"),
        ("waiting mean / p95", _minutes(m.wait_mean_s, m.wait_p95_s)),
        ("execution mean / p95", _minutes(m.exec_mean_s, m.exec_p95_s)),
        ("JCT mean / p95", _minutes(m.jct_mean_s, m.jct_p95_s)),
        ("SMACT / SMOCC / DRAMA mean", f"{m.smact_mean:.2f} / {m.smocc_mean:.2f} / {m.drama_mean:.2f}"),
        ("GPU memory used, mean", f"{m.mem_used_mean_mib / 1024:.1f} GiB"),
        ("power, mean per GPU", f"{m.power_mean_w:.0f} W"),
        *_growth_and_mig(result),
    ):
        table.add_row(label, value)
    return table


def _growth_and_mig(result: RunResult) -> list[tuple[str, str]]:
    """The rows only some runs have: restarts on a growth prediction, and a MIG run's layout changes."""
    rows = [("early restarts (predicted growth)", str(result.early_restarts))] if result.early_restarts else []
    if result.config.mig == "static":
        rows.append(("MIG layout (static)", result.config.layout_text))
    elif result.reconfigurations is not None:
        rows.append(("MIG reconfigurations", str(result.reconfigurations)))
    return rows


def add_gain_shares(rows: Sequence[dict[str, object]], bounds: Bounds, exclusive_s: float) -> None:
    """Give each row `gain_share_pct`: the share of the gain Exclusive leaves open that its run took."""
    for row in rows:
        share = bounds.gain_share(exclusive_s, float(row["makespan_s"]))
        row["gain_share_pct"] = None if share is None else round(100 * share, 1)


def bounds_table(
    bounds: Bounds, energy: EnergyBound | None, exclusive: RunMetrics, rows: Sequence[dict[str, object]], title: str
) -> Table:
    """The makespan bounds and the energy bound (None: not shown), then each run's share of the gain between
    Exclusive and the combined makespan bound."""
    unit = time_unit(exclusive.makespan_s)
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, seconds in (
        (f"critical path ({bounds.critical_task})", bounds.critical_path_s),
        ("work with perfect packing", bounds.work_s),
        ("combined: no policy beats it", bounds.combined_s),
        ("Exclusive", exclusive.makespan_s),
    ):
        table.add_row(label, f"{in_unit(seconds, unit)} {unit[1]}")
    if bounds.unplaceable:
        table.add_row("tasks no GPU can hold (left out)", str(bounds.unplaceable))
    if energy is not None:
        table.add_section()
        below = change_pct(energy.energy_j / 1e6, exclusive.energy_mj)
        table.add_row(
            f"energy: no policy spends less (SMACT a GPU carries <= {energy.peak_smact:.2f})",
            f"{energy.energy_j / 1e6:.2f} MJ",
        )
        table.add_row("  of which idle power over the makespan bound", f"{energy.idle_j / 1e6:.2f} MJ")
        table.add_row("Exclusive energy", f"{exclusive.energy_mj:.2f} MJ")
        table.add_row("  the bound against it", NOT_MEASURED if below is None else f"{below:+.1f}%")
    table.add_section()
    table.add_row("share of the gain (Exclusive - run) / (Exclusive - bound)", "")
    for row in rows:
        share = row["gain_share_pct"]
        table.add_row(f"  {row['config']}", NOT_MEASURED if share is None else f"{share:.0f}%")
    return table


def write_csv(rows: Sequence[dict[str, object]], out: TextIO) -> None:
    """The rows as CSV (RFC 4180's line ends) into `out`, a file opened with newline="" or stdout."""
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
