"""PNG charts of runs (`RunRecord`s), for `carma simulate --plot` and `carma report` alike.

matplotlib is an optional extra (`pip install 'carma-gpu[plot]'`); it draws with the Agg backend, so charts
render on machines without a display. The first run of a chart is the baseline: dashed in every chart.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from carma.pyplot import pyplot
from carma.reports.record import RunRecord, from_run_result
from carma.units import time_unit

if TYPE_CHECKING:
    from carma.sim.experiment import RunResult

DPI = 110
CDF_TIMES = ("jct_s", "wait_s")  # the task times the CDF chart draws
OOM_MARK = {"marker": "v", "markersize": 7, "linestyle": "none", "markeredgecolor": "black", "markeredgewidth": 0.5}


def _styles(n: int) -> list[dict[str, Any]]:
    """One line style per run: the first (the baseline) black and dashed when there is more than one."""
    cmap = pyplot().get_cmap("tab20")
    order = [*range(0, 20, 2), *range(1, 20, 2)]  # its dark colours first, then the light ones
    styles = [{"color": cmap(order[i % 20]), "linestyle": "-"} for i in range(n)]
    if n > 1:
        styles = [{"color": "black", "linestyle": "--"}, *styles[:-1]]
    return styles


def label_list(labels: Sequence[str]) -> str:
    """Run labels in one caption or legend entry, each quoted: a label may hold a comma ("MAGM oracle, no risk
    filter"), which made a plain comma-separated list ambiguous."""
    return ", ".join(f"“{label}”" for label in labels) if len(labels) > 1 else "".join(labels)


def _legend(fig: Any, handles: Sequence[Any], labels: Sequence[str]) -> None:
    """A legend right of the panels, outside them (constrained layout makes room), centred on their height: at
    their top it shared the figure's first line with the title, which long labels ran into."""
    fig.legend(handles, labels, loc="outside right center", fontsize=8, frameon=False)


def _values(values: Sequence[float | None]) -> np.ndarray:
    """None (not measured) becomes NaN, which matplotlib leaves as a gap instead of drawing a zero."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path


def plot_makespan_energy(records: Sequence[RunRecord], path: Path) -> Path:
    """Makespan and energy per configuration, the first configuration dashed as the baseline."""
    plt = pyplot()
    makespans = [r.figures.get("makespan_s") for r in records]
    scale, unit = time_unit(max((m for m in makespans if m is not None), default=0.0))
    panels = (
        ([None if m is None else m / scale for m in makespans], f"makespan ({unit})", "#4477aa"),
        ([r.figures.get("energy_mj") for r in records], "GPU energy (MJ)", "#ee6677"),
    )
    positions = np.arange(len(records))  # positions, not labels: two runs may share a label
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(records) + 1.6), sharey=True, layout="constrained")
    for ax, (values, xlabel, color) in zip(axes, panels, strict=True):
        known = [(p, v) for p, v in zip(positions, values, strict=True) if v is not None]
        if known:
            bars = ax.barh([p for p, _ in known], [v for _, v in known], color=color)
            ax.bar_label(bars, fmt="%.3g", padding=3, fontsize=8)
        for p, v in zip(positions, values, strict=True):
            if v is None:
                ax.text(0, p, " n/a", va="center", fontsize=8, color="grey")
        if values[0] is not None:
            ax.axvline(values[0], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.margins(x=0.12)
    axes[0].set_yticks(positions, [r.label for r in records])
    axes[0].invert_yaxis()
    fig.suptitle("Makespan and energy per configuration (dashed: the first configuration)")
    return _save(fig, path)


def _cdf(values: Sequence[float | None]) -> tuple[np.ndarray, np.ndarray]:
    xs = np.sort([v for v in values if v is not None])
    return xs, np.arange(1, len(xs) + 1) / max(len(xs), 1)


def _same_cdfs(records: Sequence[RunRecord]) -> list[list[RunRecord]]:
    """The runs grouped by the lines the CDF chart draws of them, in order of first appearance: a sweep's runs
    that placed alike draw the same line, and 15 lines, many identical, hid one another and the legend."""
    groups: dict[tuple[tuple[float, ...], ...], list[RunRecord]] = {}
    for record in records:
        key = tuple(tuple(sorted(v for t in record.tasks if (v := getattr(t, a)) is not None)) for a in CDF_TIMES)
        groups.setdefault(key, []).append(record)
    return list(groups.values())


TIMELINE_GPUS = 32  # rows of the timeline chart at most


def plot_cdfs(records: Sequence[RunRecord], path: Path) -> Path:
    """Distributions of job completion time and waiting time over completed tasks, one line per group of runs
    with the same times (the legend names them all); a run without a completed task has no line, and its
    legend entry says so."""
    plt = pyplot()
    metrics = zip(CDF_TIMES, ("job completion time", "waiting time"), strict=True)
    scale, unit = time_unit(max((t.jct_s or 0.0 for r in records for t in r.tasks), default=0.0))
    groups = _same_cdfs(records)
    styles = _styles(len(groups))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True, layout="constrained")
    for ax, (attribute, name) in zip(axes, metrics, strict=True):
        for group, style in zip(groups, styles, strict=True):
            xs, ys = _cdf([getattr(t, attribute) for t in group[0].tasks])
            if not len(xs):
                continue
            ax.step(np.concatenate(([0.0], xs / scale)), np.concatenate(([0.0], ys)), where="post", **style)
        ax.set_xlabel(f"{name} ({unit})")
        if not ax.lines:
            ax.text(0.5, 0.5, "no completed task", transform=ax.transAxes, ha="center", color="grey")
        ax.set_xlim(left=-0.01 * ax.get_xlim()[1])  # off the spine: a step at 0 (no task waited) stays in sight
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of completed tasks")
    axes[0].set_ylim(0, 1.02)
    labels = [
        label_list([r.label for r in group])
        + ("" if any(t.jct_s is not None for t in group[0].tasks) else " (no completed task)")
        for group in groups
    ]
    _legend(fig, [plt.Line2D([], [], **s) for s in styles], labels)
    fig.suptitle("CDF of job completion time and waiting time (queued, recovery queue included), completed tasks")
    return _save(fig, path)


def plot_timelines(records: Sequence[RunRecord], path: Path) -> Path:
    """GPU memory used and SMACT over time, one row of panels per GPU, one line per run (CARMA figure 5);
    out-of-memory crashes as triangles on the memory panel and dotted lines on both. Only GPUs that ran a task
    in some run, at most `TIMELINE_GPUS` of them (the title says what is left out): a server of hundreds of
    GPUs drew a row for each, most of them idle, in minutes."""
    plt = pyplot()
    every = sorted({g.index for r in records for g in r.gpus} | {g for r in records for g in r.series})
    ran = {g for r in records for t in r.tasks for a in t.attempts for g in a.gpus}  # a GPU gone: by its id
    used = [g for g in every if g in ran]
    indices = (used or every[:1])[:TIMELINE_GPUS]
    capacity = [{g.index: g.total_mib for g in r.gpus if g.total_mib} for r in records]  # runs may differ
    scale, unit = time_unit(max(r.end_s - r.start_s for r in records))
    styles = _styles(len(records))
    height = 2.3 * len(indices) + 1.6
    fig, axes = plt.subplots(len(indices), 2, figsize=(14, height), sharex=True, squeeze=False, layout="constrained")
    for row, gpu in zip(axes, indices, strict=True):
        mem_ax, smact_ax = row
        lines = {caps[gpu] for caps in capacity if gpu in caps}
        for record, style, caps in zip(records, styles, capacity, strict=True):
            if gpu in caps:  # grey when every run's GPU has the same memory, else in the run's colour
                color = "grey" if len(lines) == 1 else style["color"]
                mem_ax.axhline(caps[gpu] / 1024, color=color, linestyle="--", linewidth=0.8)
            series = record.series.get(gpu)
            if not series or not series["t"]:
                continue
            xs = (_values(series["t"]) - record.start_s) / scale
            mem_ax.step(xs, _values(series["used_mib"]) / 1024, where="post", linewidth=1, **style)
            smact_ax.step(xs, _values(series["smact"]), where="post", linewidth=1, **style)
            for oom in (e for e in record.ooms if gpu in e.gpus):
                x = (oom.t - record.start_s) / scale
                for ax in row:
                    ax.axvline(x, color=style["color"], linestyle=":", linewidth=1)
                mem_ax.plot([x], [(caps.get(gpu) or 0) / 1024], color=style["color"], **OOM_MARK)
        mem_ax.set_ylabel(f"GPU {gpu} memory (GiB)")
        mem_ax.set_ylim(bottom=0)
        smact_ax.set_ylabel(f"GPU {gpu} SMACT")
        smact_ax.set_ylim(0, 1.05)
    for ax in axes[-1]:
        ax.set_xlabel(f"time since the run's start ({unit})")
        ax.set_xlim(left=0)
    handles = [plt.Line2D([], [], **s) for s in styles]
    handles += [plt.Line2D([], [], color="grey", linestyle="--"), plt.Line2D([], [], color="grey", **OOM_MARK)]
    _legend(fig, handles, [*(r.label for r in records), "memory capacity", "out-of-memory crash"])
    left_out = len(every) - len(indices)
    shown = f" ({len(indices)} GPUs shown; {left_out} left out: " if left_out else ""
    if left_out:
        shown += (
            "idle in every run)" if len(used) <= TIMELINE_GPUS else f"only the first {TIMELINE_GPUS} that ran tasks)"
        )
    fig.suptitle(f"GPU memory used and SMACT over time{shown}")
    return _save(fig, path)


def plot_sweep(results: Sequence[RunResult], directory: Path) -> list[Path]:
    """The sweep's charts: makespan/energy per configuration; MAGM against Exclusive over time."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [from_run_result(r) for r in results]
    written = [plot_makespan_energy(records, directory / "makespan_energy.png")]
    # by policy, not label: with the risk filter off the recovery-only MAGM run is labelled so
    first: dict[tuple[str, str], RunRecord] = {}
    for result, record in zip(results, records, strict=True):
        first.setdefault((result.config.policy, result.config.memory), record)
    pair = [first.get(("exclusive", "none")), first.get(("magm", "none"))]
    if all(pair):
        written.append(plot_timelines(pair, directory / "timeline_magm_vs_exclusive.png"))
    return written
