"""`carma report`'s page: one self-contained HTML file with its PNG charts beside it.

No external CSS or JavaScript (the machines may be offline), and every string that came from a user or a
file (task names, labels, sources) goes through `html.escape`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from carma import __version__
from carma.metrics.run import NOT_MEASURED
from carma.reports.plots import label_list, plot_cdfs, plot_makespan_energy, plot_timelines
from carma.reports.record import RunRecord
from carma.units import in_unit, time_unit

TIMELINE_RUNS = 3  # runs per memory/SMACT chart: more lines than that hide each other
OOM_ROWS = 50  # out-of-memory crashes listed per run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1500px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; }
th { background: #f2f2f2; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0 1.5em; }
.note { color: #555; font-size: 0.9em; }
"""


# The figures as the CARMA paper defines them (carma's docs/metrics.md), here in full: the page is read away
# from the checkout, where a link to the docs led nowhere
DEFINITIONS = """<p class="note">Makespan: from the first submission to the last task's end. Energy: each GPU's
energy counter over the makespan, summed over the GPUs, idle ones included (a daemon: over its window). OOM crashes:
attempts that ended out of memory. Completed / failed: the tasks' final states. JCT (job completion time): from
submission to completion. Wait: from submission to the first dispatch, plus any time in the recovery queue. Means
and p95 (by linear interpolation) are over completed tasks; – where none completed (not measured, never 0).</p>"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _number(value: float | int | None, scale: float, fmt: str) -> str:
    return NOT_MEASURED if value is None else fmt.format(value * scale)


def _minutes(record: RunRecord, name: str) -> str:
    """Mean / p95 in minutes, one unit for every row (as `carma simulate` prints them)."""
    return " / ".join(_number(record.figures.get(f"{name}_{s}_s"), 1 / 60, "{:.1f}") for s in ("mean", "p95"))


def _figures_row(record: RunRecord, unit: tuple[float, str]) -> str:
    f = record.figures
    done = f"{f.get('tasks_completed', NOT_MEASURED)} / {f.get('tasks_failed', NOT_MEASURED)}"
    aside = [f"{f[key]} {what}" for key, what in (("tasks_cancelled", "cancelled"), ("tasks_unfinished", "not ended"))
             if f.get(key)]  # fmt: skip
    if aside:  # else a window of cancelled tasks reads "0 / 0", as if nothing ran in it
        done += f" ({', '.join(aside)})"
    cells = [
        NOT_MEASURED if f.get("makespan_s") is None else in_unit(f["makespan_s"], unit),
        _number(f.get("energy_mj"), 1, "{:.2f}"),
        f.get("oom_crashes", NOT_MEASURED),
        done,
        _minutes(record, "jct"),
        _minutes(record, "wait"),
    ]
    numbers = "".join(f'<td class="n">{_e(c)}</td>' for c in cells)
    return f"<tr><td>{_e(record.label)}</td>{numbers}</tr>"


def _figures_table(records: Sequence[RunRecord]) -> str:
    unit = time_unit(max((r.figures.get("makespan_s") or 0.0 for r in records), default=0.0))  # as the bar chart
    headers = ("configuration", f"makespan ({unit[1]})", "energy (MJ)", "OOM crashes", "completed / failed")
    headers += ("JCT mean / p95 (min)", "wait mean / p95 (min)")
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{''.join(_figures_row(r, unit) for r in records)}</table>"


def _oom_table(record: RunRecord) -> str:
    rows = []
    unit = time_unit(record.end_s - record.start_s)  # as the charts' time axes
    for event in record.ooms[:OOM_ROWS]:
        task = record.task(event.task_id)
        cells = (
            in_unit(event.t - record.start_s, unit),
            ", ".join(map(str, event.gpus)),
            event.task_id,
            task.name if task else "",
        )
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    more = len(record.ooms) - OOM_ROWS
    tail = f'<p class="note">and {more} more.</p>' if more > 0 else ""
    head = f"<tr><th>time since the run's start ({unit[1]})</th><th>GPUs</th><th>task</th><th>name</th></tr>"
    return f"<h3>{_e(record.label)}</h3><table>{head}{''.join(rows)}</table>{tail}"


def _groups(records: Sequence[RunRecord]) -> list[list[RunRecord]]:
    """Runs per memory/SMACT chart: all of them if few, otherwise the first (the baseline) with each next few."""
    if len(records) <= TIMELINE_RUNS:
        return [list(records)]
    step = TIMELINE_RUNS - 1
    return [[records[0], *records[i : i + step]] for i in range(1, len(records), step)]


def _image(path: Path, alt: str) -> str:
    return f'<img src="{_e(path.name)}" alt="{_e(alt)}">'


def write_report(records: Sequence[RunRecord], out_dir: Path, sources: Sequence[str]) -> Path:
    """Write `out_dir/report.html` and its charts; the path of the page."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("timelines-*.png"):  # a previous report's, maybe more groups than now
        stale.unlink()
    bars = plot_makespan_energy(records, out_dir / "makespan_energy.png")
    cdfs = plot_cdfs(records, out_dir / "jct_wait_cdf.png")
    timelines = [
        (plot_timelines(group, out_dir / f"timelines-{n}.png"), label_list([r.label for r in group]))
        for n, group in enumerate(_groups(records), 1)
    ]
    generated = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    crashed = [r for r in records if r.ooms]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>carma report</title>',
        f"<style>{STYLE}</style></head><body>",
        "<h1>carma report</h1>",
        f'<p class="note">Generated {_e(generated)} by carma {_e(__version__)}.</p>',
        "<h2>Sources</h2><ul>" + "".join(f"<li>{_e(s)}</li>" for s in sources) + "</ul>",
        "<h2>Figures per configuration</h2>",
        _figures_table(records),
        DEFINITIONS,
        "<h2>Makespan and energy</h2>",
        _image(bars, "makespan and energy per configuration"),
        "<h2>Completion and waiting time</h2>",
        _image(cdfs, "CDFs of job completion time and waiting time"),
        "<h2>GPU memory and SMACT over time</h2>",
        *(f"<p>{_e(labels)}</p>{_image(path, 'memory and SMACT over time: ' + labels)}" for path, labels in timelines),
        "<h2>Out-of-memory crashes</h2>",
        *(_oom_table(r) for r in crashed),
        "" if crashed else "<p>None.</p>",
        "</body></html>",
    ]
    page = out_dir / "report.html"
    page.write_text("\n".join(parts) + "\n")
    return page
