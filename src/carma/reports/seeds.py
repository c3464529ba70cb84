"""Figures over jittered copies of a trace (`carma simulate --jitter S --seeds N`): each configuration's mean,
standard deviation, least and most over the seeds, so that a comparison is not read off one arrival pattern."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rich.table import Table

from carma.metrics.run import NOT_MEASURED
from carma.sim.experiment import RunResult
from carma.units import time_format, time_unit

# (run row key, column header, scale, format) of the figures summed up over the seeds; the makespan's unit is
# the runs' own (`seed_table`)
SPREAD = (
    ("makespan_s", "makespan", None, None),
    ("oom_crashes", "OOMs", 1.0, "{:.2f}"),  # counts: "0.25", "1.5", "2" (`_cell`)
    ("tasks_failed", "failed", 1.0, "{:.2f}"),
    ("energy_mj", "energy MJ", 1.0, "{:.2f}"),
    ("jct_p95_s", "p95 JCT min", 1 / 60, "{:.0f}"),
)
COUNTS = ("oom_crashes", "tasks_failed")
STATS = ("mean", "sd", "min", "max")


def _stats(values: Sequence[object]) -> dict[str, float | None]:
    """Mean, sample standard deviation (None for one seed), least and most; all None where a run measured
    nothing (no task completed)."""
    if any(v is None for v in values):
        return dict.fromkeys(STATS)
    numbers = [float(v) for v in values]  # type: ignore[arg-type]
    sd = statistics.stdev(numbers) if len(numbers) > 1 else None
    return {"mean": statistics.fmean(numbers), "sd": sd, "min": min(numbers), "max": max(numbers)}


def seed_rows(per_seed: Sequence[Sequence[RunResult]]) -> list[dict[str, object]]:
    """One row per configuration (each seed's runs in the same order): `<figure>_<stat>` for each figure of
    SPREAD and each of STATS."""
    rows: list[dict[str, object]] = []
    for runs in zip(*per_seed, strict=True):
        figures = [r.row() for r in runs]
        row = {key: figures[0][key] for key in ("config", "policy", "memory", "risk_filter")}
        for key, *_ in SPREAD:
            for stat, value in _stats([f[key] for f in figures]).items():
                row[f"{key}_{stat}"] = None if value is None else round(value, 4)
        rows.append(row)
    return rows


def _number(row: dict[str, object], key: str) -> float | None:
    value = row[key]
    return None if value is None else float(value)  # type: ignore[arg-type]


def _cell(row: dict[str, object], key: str, scale: float, fmt: str) -> str:
    """`mean (least-most)`, or the mean alone where every seed gave the same."""
    low, mean, high = (_number(row, f"{key}_{stat}") for stat in ("min", "mean", "max"))
    if low is None or mean is None or high is None:
        return NOT_MEASURED
    texts = [fmt.format(v * scale) for v in (low, mean, high)]
    if key in COUNTS:  # no trailing zeros: "2 (1-3)", not "2.00 (1.00-3.00)"
        texts = [t.rstrip("0").rstrip(".") for t in texts]
    return texts[1] if texts[0] == texts[2] else f"{texts[1]} ({texts[0]}-{texts[2]})"


def seed_table(rows: Sequence[dict[str, object]], title: str) -> Table:
    scale, unit = time_unit(max(_number(r, "makespan_s_max") or 0.0 for r in rows))
    in_unit = "{:" + time_format(unit) + "}"
    columns = [
        (key, f"{header} {unit}", 1 / scale, in_unit)
        if key == "makespan_s"
        else (key, header, factor or 1.0, fmt or "")
        for key, header, factor, fmt in SPREAD
    ]
    table = Table(title=title, title_justify="left")
    table.add_column("configuration", no_wrap=True)
    for _, header, _, _ in columns:
        table.add_column(header, justify="right")
    table.add_column(f"makespan sd {unit}", justify="right")
    for row in rows:
        sd = _number(row, "makespan_s_sd")
        cells = [_cell(row, key, factor, fmt) for key, _, factor, fmt in columns]
        table.add_row(str(row["config"]), *cells, NOT_MEASURED if sd is None else in_unit.format(sd / scale))
    return table
