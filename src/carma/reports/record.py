"""One run as every chart and `carma report` see it, whether it came from the twin or from a daemon.

A `RunRecord` is plain data with no twin or server objects in it, so `carma simulate --save` can keep runs
as JSON and `carma report` can put them beside a live daemon's window. Times are in the source's clock
(trace seconds, or the daemon's clock); charts draw them relative to `start_s`. A value that was not
measured is None, never 0.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carma.metrics.run import mean_p95
from carma.textfiles import NotText, read_text
from carma.units import pluralize

if TYPE_CHECKING:
    from carma.core.types import Attempt
    from carma.metrics.timeline import Segment
    from carma.server.client import Client
    from carma.sim.experiment import RunResult

VERSION = 1
RESTARTED = "restarted"  # an attempt's outcome: stopped early on a predicted growth, and relaunched
SERIES_COLUMNS = ("t", "used_mib", "smact", "power_w")

Figures = dict[str, float | int | None]
Series = dict[str, list[float | None]]  # SERIES_COLUMNS -> values, one per step (each holds until the next)


class RecordError(ValueError):
    """A report file or a source that cannot give a record, said in one line."""


@dataclass(frozen=True)
class GpuRef:
    index: int
    name: str
    total_mib: int | None


@dataclass(frozen=True)
class AttemptRecord:
    gpus: tuple[int, ...]
    start_s: float
    end_s: float | None  # None while it runs
    outcome: str | None  # success, oom, error, killed, restarted (early, before an OOM crash); None while it runs


@dataclass(frozen=True)
class TaskRecord:
    id: int
    name: str
    submit_s: float
    end_s: float | None
    state: str
    attempts: tuple[AttemptRecord, ...]

    @property
    def jct_s(self) -> float | None:
        """Submission to completion, for a completed task."""
        return self.end_s - self.submit_s if self.state == "completed" and self.end_s is not None else None

    @property
    def wait_s(self) -> float | None:
        """Time queued, recovery queueing included (JCT minus execution time, as docs/metrics.md defines it);
        for a task that never crashed, first start minus submission."""
        jct = self.jct_s
        return None if jct is None else jct - sum(a.end_s - a.start_s for a in self.attempts if a.end_s is not None)


@dataclass(frozen=True)
class OomEvent:
    t: float
    gpus: tuple[int, ...]
    task_id: int


@dataclass(frozen=True)
class RunRecord:
    label: str  # the configuration, e.g. "MAGM recovery only" or "server (magm), last 6 h"
    source: str
    start_s: float  # where the charts' time axis starts: the first submission, or the daemon's window
    end_s: float
    gpus: tuple[GpuRef, ...]
    figures: Figures
    tasks: tuple[TaskRecord, ...]
    series: dict[int, Series]  # per GPU index
    ooms: tuple[OomEvent, ...]

    def task(self, task_id: int) -> TaskRecord | None:
        return next((t for t in self.tasks if t.id == task_id), None)


def task_figures(tasks: Sequence[TaskRecord]) -> Figures:
    """Completion and waiting figures of completed tasks (None where no task completed), final states."""
    figures: Figures = {}
    for name, values in (("jct", [t.jct_s for t in tasks]), ("wait", [t.wait_s for t in tasks])):
        mean, p95 = mean_p95([v for v in values if v is not None])
        figures |= {f"{name}_mean_s": mean, f"{name}_p95_s": p95}
    for state in ("completed", "failed", "cancelled"):
        figures[f"tasks_{state}"] = sum(t.state == state for t in tasks)
    return figures


def _outcome(a: Attempt) -> str | None:
    """How an attempt ended, in the report's words: an early restart is relaunched as after an OOM crash, but
    was stopped before one, and is no crash."""
    return RESTARTED if a.restarted_early else a.outcome.value if a.outcome else None


def _served_outcome(a: dict[str, Any]) -> str | None:
    """`_outcome` of an attempt as the daemon's API gives it."""
    return RESTARTED if a.get("restarted_early") else a["outcome"]


def _ooms(tasks: Iterable[TaskRecord], since_s: float = -math.inf) -> tuple[OomEvent, ...]:
    events = [
        OomEvent(a.end_s, a.gpus, t.id)
        for t in tasks
        for a in t.attempts
        if a.outcome == "oom" and a.end_s is not None and a.end_s >= since_s
    ]
    return tuple(sorted(events, key=lambda e: e.t))


# --- from the twin ------------------------------------------------------------------------------------


def _segment_series(segments: Sequence[Segment], start_s: float, end_s: float) -> Series:
    """Step series of a twin timeline from start to end: a row where a charted value changes (the step in
    force at the start begins there: a trace of real timestamps starts far from 0), and one at the end."""
    series: Series = {c: [] for c in SERIES_COLUMNS}
    last: tuple[float, ...] | None = None
    for seg in segments:
        if seg.t > end_s:
            break
        values = (seg.used_mib, round(seg.smact, 4), round(seg.power_w, 1))
        if values != last:
            t = round(max(seg.t, start_s), 1)
            if series["t"] and series["t"][-1] == t:  # a step before the start, replaced by the next
                for column in SERIES_COLUMNS:
                    series[column].pop()
            for column, value in zip(SERIES_COLUMNS, (t, *values), strict=True):
                series[column].append(value)
            last = values
    if last is not None:
        for column, value in zip(SERIES_COLUMNS, (round(end_s, 1), *last), strict=True):
            series[column].append(value)
    return series


def from_run_result(result: RunResult, source: str = "digital twin") -> RunRecord:
    """A twin run: its metrics as figures, its tasks, its per-GPU timelines as step series."""
    from carma.sim.gpus import GPU_TYPES
    from carma.sim.twin import target_index

    start = min(t.submit_s for t in result.tasks)
    end = start + result.metrics.makespan_s
    tasks = tuple(
        TaskRecord(
            t.id,
            t.spec.name,
            t.submit_s,
            t.ended_s,
            t.state.value,
            tuple(
                AttemptRecord(tuple(map(target_index, a.gpus)), a.dispatched_s, a.ended_s, _outcome(a))
                for a in t.attempts
            ),
        )
        for t in result.tasks
    )
    kinds = [GPU_TYPES.get(name.lower()) for name in result.gpus]
    return RunRecord(
        label=result.label,
        source=source,
        start_s=start,
        end_s=end,
        gpus=tuple(
            GpuRef(i, name, kind.total_mib if kind else None)
            for i, (name, kind) in enumerate(zip(result.gpus, kinds, strict=True))
        ),
        figures=asdict(result.metrics),
        tasks=tasks,
        series={i: _segment_series(segments, start, end) for i, segments in enumerate(result.timelines)},
        ooms=_ooms(tasks),
    )


# --- from a running daemon ----------------------------------------------------------------------------


def _window_tasks(client: Client, since_s: float, attempts: list[dict[str, Any]]) -> tuple[TaskRecord, ...]:
    """Tasks submitted in the window or that ran in it, with every attempt (the timeline holds only the
    window's; a task that also ran before it is asked for whole)."""
    from carma.server.client import Refused

    in_window: dict[int, list[AttemptRecord]] = {}
    for a in attempts:
        record = AttemptRecord(tuple(a["gpus"]), a["start_s"], a["end_s"], _served_outcome(a))
        in_window.setdefault(a["task_id"], []).append(record)
    tasks = []
    for s in client.tasks(all=True):
        seen = in_window.get(s["id"], [])
        if s["submit_s"] < since_s and not seen:
            continue
        if len(seen) != s["attempts"]:
            try:
                whole = client.task(s["id"])
            except Refused as e:
                if e.status != 404:
                    raise
                continue  # forgotten since the listing (the server's retention): not in the report
            seen = [
                AttemptRecord(tuple(a["gpus"]), a["dispatched_s"], a["ended_s"], _served_outcome(a))
                for a in whole["attempt_list"]
            ]
        tasks.append(TaskRecord(s["id"], s["name"], s["submit_s"], s["ended_s"], s["state"], tuple(seen)))
    return tuple(tasks)


def _energy_mj(columns: Sequence[Series], start_s: float, end_s: float) -> float | None:
    """Energy from start to end, summed over the GPUs' cumulative counters; None if one has none. A counter
    that went down was reset (a daemon restart for fake GPUs, a driver reload for real ones) and counts from
    zero again, as Prometheus's increase() reads one."""
    if not columns:
        return None
    total = 0.0
    for series in columns:
        readings = [
            e for t, e in zip(series["t"], series["energy_j"], strict=True) if e is not None and start_s <= t <= end_s
        ]
        if not readings:
            return None
        total += sum(b - a if b >= a else b for a, b in pairwise(readings))
    return total / 1e6


def _clip(series: Series, start_s: float, end_s: float) -> Series:
    """The series' steps from start to end: the step in force at the start begins there."""
    t = series["t"]
    keep = [i for i in range(len(t)) if t[i] <= end_s and (i + 1 == len(t) or t[i + 1] > start_s)]
    clipped = {c: [series[c][i] for i in keep] for c in SERIES_COLUMNS}
    clipped["t"] = [max(v, start_s) for v in clipped["t"]]
    return clipped


def from_server(client: Client, hours: float) -> RunRecord:
    """A daemon's last `hours` (its clock) through its API: the tasks submitted or run in that window, the
    archived GPU series, and figures as the twin's where they can be measured (makespan only once every
    task of the window has ended)."""
    status = client.status()
    timeline = client.request("GET", "/v1/timeline", {"hours": hours})
    since, now = timeline["since_s"], timeline["now_s"]
    tasks = _window_tasks(client, since, timeline["attempts"])
    if not tasks:
        raise RecordError(f"the carma server at {client.where} has no tasks in the last {hours:g} h")
    # a GPU the server no longer has (restarted with others, a MIG instance since remade) is named by its id
    raw = client.request("GET", "/v1/series", {"minutes": hours * 60})["gpus"]
    present = {int(g): s for g, s in raw.items() if g.isdigit()}
    unfinished = sum(t.end_s is None for t in tasks)
    first = min(t.submit_s for t in tasks)
    last = None if unfinished else max(t.end_s for t in tasks if t.end_s is not None)
    # the span a simulation's figures cover: first submission to last end (or now, while a task has not ended)
    start, end = max(since, first), now if last is None else last
    ooms = _ooms(tasks, since)
    scale = status["time_scale"]
    sampled = {g: s for g, s in raw.items() if any(start <= t <= end for t in s["t"])}
    gone = sum(not g.isdigit() for g in sampled)
    return RunRecord(
        label=f"server ({status['policy']}), last {hours:g} h",
        source=f"carma server at {client.where}"
        + (f" (clock sped up {scale:g}x)" if scale != 1 else "")
        + (f"; {pluralize(gone, 'GPU')} it no longer has counted in the energy, not charted" if gone else ""),
        start_s=start,
        end_s=end,
        gpus=tuple(GpuRef(g["index"], g["name"], g["total_mib"]) for g in client.gpus()),
        figures={
            "makespan_s": None if last is None else last - first,
            "energy_mj": _energy_mj(list(sampled.values()), start, end),
            "oom_crashes": len(ooms),
            **task_figures(tasks),
            "tasks_unfinished": unfinished,
        },
        tasks=tasks,
        series={g: _clip(s, start, end) for g, s in sorted(present.items())},
        ooms=ooms,
    )


# --- the report file ----------------------------------------------------------------------------------


def to_json(records: Sequence[RunRecord]) -> str:
    return json.dumps({"carma_report_version": VERSION, "runs": [asdict(r) for r in records]}, separators=(",", ":"))


def _numbers(values: Iterable[Any], what: str) -> None:
    """Refuse a hand-edited value the charts cannot draw, naming where it is."""
    for value in values:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        ):
            raise ValueError(f"{what} holds {value!r}, not a number")


def _series(g: int, s: Series) -> Series:
    columns = {c: s[c] for c in SERIES_COLUMNS if c in s}
    if missing := [c for c in SERIES_COLUMNS if c not in s]:
        raise ValueError(f"GPU {g}'s series has no {', '.join(missing)}")
    for column, values in columns.items():
        if len(values) != len(columns["t"]):
            raise ValueError(f"GPU {g}'s {column} and t differ in length ({len(values)} and {len(columns['t'])})")
        _numbers(values, f"GPU {g}'s {column}")
    return columns


@functools.cache
def _run_adapter() -> Any:
    from pydantic import TypeAdapter  # here: of the commands importing this module, only `carma report` reads

    return TypeAdapter(RunRecord)


def _record(run: Any) -> RunRecord:
    """A run of a report file, every field of the type the charts draw (strictly: "0" is no number), and
    every number finite (JSON may hold NaN and Infinity)."""
    record: RunRecord = _run_adapter().validate_json(json.dumps(run), strict=True)
    for name, value in record.figures.items():  # each by its name, as `figures.makespan_s`
        _numbers((value,), f"figures.{name}")
    _numbers((v for t in record.tasks for v in (t.submit_s, t.end_s)), "a task's submit_s or end_s")
    _numbers(
        (v for t in record.tasks for a in t.attempts for v in (a.start_s, a.end_s)), "an attempt's start_s or end_s"
    )
    _numbers((record.start_s, record.end_s), "the run's start_s or end_s")
    _numbers((e.t for e in record.ooms), "an out-of-memory crash's t")
    return replace(record, series={g: _series(g, s) for g, s in record.series.items()})


def from_json(text: str) -> list[RunRecord]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # nested deeper than Python recurses: no report file either
        raise RecordError("not a carma report file (not JSON)") from None
    if not isinstance(doc, dict) or "carma_report_version" not in doc:
        raise RecordError("not a carma report file (no carma_report_version; write one with `carma simulate --save`)")
    if type(doc["carma_report_version"]) is not int or doc["carma_report_version"] != VERSION:
        raise RecordError(
            f"report format version {doc['carma_report_version']!r} is not supported (this carma reads {VERSION})"
        )
    runs = doc.get("runs")
    if not isinstance(runs, list) or not runs:
        raise RecordError("the report file holds no runs")
    from pydantic import ValidationError

    records = []
    for number, run in enumerate(runs, 1):
        try:
            records.append(_record(run))
        except ValidationError as e:  # the first problem, as one line: where it is, what is wrong
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the run"
            given = "" if isinstance(first["input"], dict | list) else f", got {first['input']!r}"
            problem = f"{where}: {first['msg']}{given}"
            raise RecordError(f"run {number} of the report file is malformed ({problem})") from None
        except ValueError as e:
            raise RecordError(f"run {number} of the report file is malformed ({e})") from None
    return records


def read_records(path: Path) -> list[RunRecord]:
    """The runs of a report file, read as the other files users may edit are (a byte-order mark dropped)."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except OSError as e:
        raise RecordError(f"cannot read {path}: {e}") from None
    except NotText as e:
        raise RecordError(str(e)) from None
    try:
        return from_json(text)
    except RecordError as e:
        raise RecordError(f"{path}: {e}") from None


def write_records(records: Sequence[RunRecord], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(records))
    return path
