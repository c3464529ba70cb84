"""`carma replay`: submit a trace to a running server at its arrival times, as fake training jobs."""

from __future__ import annotations

import json
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from carma.cli.common import UsageError, absolute, app, choice, err, fail, out, positive
from carma.traces.catalog import Workload
from carma.traces.loaders import BUILTIN_TRACES
from carma.units import in_unit, pluralize, time_unit

if TYPE_CHECKING:
    from carma.sim.experiment import RunResult
    from carma.traces.loaders import Trace

PROGRESS_LINES = 10  # off a terminal, a line each time another tenth of the tasks has ended


def fakejob_command(w: Workload) -> list[str]:
    """A `carma.fakejob` command line that behaves like the workload on fake GPUs."""
    return [
        sys.executable, "-m", "carma.fakejob",
        "--mem", f"{w.mem_mib}MiB", "--mem-first", f"{w.mem_first_mib}MiB",
        "--seconds", f"{w.solo_s:g}", "--ttfk", f"{w.ttfk_s:g}", "--warmup", f"{w.warmup_s:g}",
        "--gract", f"{w.gract:g}", "--smact", f"{w.smact:g}", "--smocc", f"{w.smocc:g}", "--drama", f"{w.drama:g}",
    ]  # fmt: skip


@app.command("replay")
def replay_cmd(
    trace: Annotated[str, typer.Argument(help=f"Built-in trace ({', '.join(BUILTIN_TRACES)}) or a trace file.")],
    time_scale: Annotated[
        float | None,
        typer.Option(
            help="Trace seconds per wall second between submissions (default: the server's --time-scale, at which"
            " its fake GPUs run the tasks)."
        ),
    ] = None,
    memory: Annotated[str, typer.Option(help="none (recovery only) or oracle (submit the measured need).")] = "none",
    duration: Annotated[
        str,
        typer.Option(
            help="none (the server's history of earlier runs) or oracle (declare each task's solo run time, as the"
            " twin knows it)."
        ),
    ] = "none",
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks.", min=1)] = None,
    skip_unknown: Annotated[bool, typer.Option("--skip-unknown", help="Leave out unknown tasks.")] = False,
    wait: Annotated[
        bool,
        typer.Option(
            help="Wait for every task to end (progress on stderr), print the run's figures beside the twin's for"
            " the same tasks; exit 1 unless all completed."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the submitted ids (and figures) as JSON.")] = False,
) -> None:
    """Replay a trace against a running server (fake GPUs): each task is a carma.fakejob with its profile."""
    from carma.server.client import Client, ClientError, run_figures
    from carma.traces.catalog import load_catalog
    from carma.traces.loaders import Trace, TraceError, load_trace

    try:
        memory = choice(memory, ("none", "oracle"), "--memory")
        declared = _Declared(memory == "oracle", choice(duration, ("none", "oracle"), "--duration") == "oracle")
        if time_scale is not None:
            positive(time_scale, "--time-scale")
        loaded = load_trace(trace, load_catalog(), skip_unknown=skip_unknown)
    except (UsageError, TraceError, ValueError) as e:
        raise fail(e) from None
    if loaded.skipped:
        err.print(loaded.skipped_note())
    client = Client()
    entries = loaded.entries[:limit]
    ids: list[int] = []
    try:
        status = client.status()
        server_scale = status["time_scale"]
        if time_scale is not None and time_scale != server_scale:
            err.print(
                f"note: submitting at {time_scale:g}x while the server's GPUs run tasks at {server_scale:g}x: "
                "the trace's arrivals and run times are not kept on one clock"
            )
        _check_all(client, entries, declared)
        with _Progress(len(entries), quiet=as_json) if wait else nullcontext() as progress:
            ended = _Ended(client, ids, progress)  # read whole as they end: a server's retention may forget them
            on_wait = ended.look if wait else None
            _submit_all(client, entries, time_scale or server_scale, declared, as_json, ids, on_wait)
            figures = run_figures(ended.all()) if wait else None
        gpus = [g["name"] for g in client.gpus()] if wait else []
    except ClientError as e:
        raise fail(f"{e} ({_submitted(ids, len(entries))})") from None
    except KeyboardInterrupt:
        raise fail(f"interrupted ({_submitted(ids, len(entries))})", code=130) from None
    twin = _twin_run(Trace(loaded.name, entries), status, gpus, declared) if figures else None
    if as_json:
        extra = {"figures": figures, **({"twin": _twin_figures(twin)} if twin else {})} if figures else {}
        print(json.dumps({"trace": loaded.name, "ids": ids, **extra}))
    elif figures:
        out.print(_summary(figures, twin), highlight=False)
    if figures and figures["completed"] < len(ids):  # as `carma wait`: a script sees that some did not complete
        raise typer.Exit(1)


class _Twin(NamedTuple):
    """The twin's run of the replayed tasks, and its configuration in words."""

    result: RunResult
    label: str


def _twin_run(trace: Trace, status: dict[str, Any], gpus: list[str], declared: _Declared) -> _Twin | None:
    """The twin's run of the replayed tasks on the server's GPUs with its policy, risk filter and carma's own
    decisions, and its name; None (said on stderr) where the twin does not model the server's GPUs or policy."""
    from carma.cli.simulate import server_name
    from carma.core.config import OWN_DECISIONS, SchedulerConfig
    from carma.core.policies import POLICY_NAMES
    from carma.sim.experiment import RunConfig, TwinConfig, simulate
    from carma.sim.gpus import GPU_TYPES

    kinds = [GPU_TYPES.get(name.lower()) for name in gpus]
    if not gpus or None in kinds or status["policy"] not in POLICY_NAMES:
        what = f"policy {status['policy']}" if all(kinds) else f"GPUs ({', '.join(sorted(set(gpus)))})"
        err.print(f"note: no twin figure to compare with: the twin does not model the server's {what}")
        return None
    decisions = status.get("decisions") or {}  # a server of an earlier release: none of them
    memory = "oracle" if declared.memory else "none"
    switches = {name: decisions[name] for name in ("hold_known_needs", *OWN_DECISIONS) if name in decisions}
    # the server learns a command's activity (warmup_risk's, and pair's load) from its runs alone; the twin as it does
    learnt = "history" if switches.get("warmup_risk") or status["policy"] == "pair" else "profile"
    run = RunConfig(
        status["policy"],
        memory,
        status["risk"]["enabled"],
        predict=decisions.get("predict_growth", False),
        activity=learnt,
    )
    try:
        config = TwinConfig(gpus=tuple(k for k in kinds if k), scheduler=replace(SchedulerConfig(), **switches))
    except ValueError as e:  # a server of an earlier release ran switches this one refuses together
        err.print(f"note: no twin figure to compare with: the server's decisions are not the twin's ({e})")
        return None
    if switches.get("backfill") and not declared.duration:
        err.print(
            "note: the twin backfills knowing every task's run time, the server only its command's earlier runs "
            "(--duration oracle declares them)"
        )
    result = simulate(trace, run, config)
    return _Twin(result, f"{result.label} on {server_name(result, config)}")


def _twin_figures(twin: _Twin) -> dict[str, Any]:
    m = twin.result.metrics
    return {"config": twin.label, "makespan_s": round(m.makespan_s, 1), "oom_crashes": m.oom_crashes}


def _summary(figures: dict[str, Any], twin: _Twin | None) -> str:
    """The run in words, makespan in hours (minutes for a short one), beside the twin's for the same tasks."""
    unit = time_unit(max(figures["makespan_s"], twin.result.metrics.makespan_s if twin else 0.0))
    tasks = sum(figures[k] for k in ("completed", "failed", "cancelled"))
    lines = [
        f"{pluralize(tasks, 'task')}: {figures['completed']} completed, {figures['failed']} failed, "
        f"{figures['cancelled']} cancelled; {pluralize(figures['collocated_attempts'], 'attempt')} collocated",
        f"makespan {in_unit(figures['makespan_s'], unit)} {unit[1]}, "
        f"{pluralize(figures['oom_crashes'], 'out-of-memory crash', 'out-of-memory crashes')}",
    ]
    if twin:
        m = twin.result.metrics
        change = (figures["makespan_s"] / m.makespan_s - 1) * 100 if m.makespan_s else 0.0
        lines[-1] += (
            f"; the twin, same tasks ({twin.label}): {in_unit(m.makespan_s, unit)} {unit[1]} "
            f"({change:+.1f}% here), {pluralize(m.oom_crashes, 'out-of-memory crash', 'out-of-memory crashes')}"
        )
    return "\n".join(lines)


def _submitted(ids: list[int], total: int) -> str:
    """What a replay that stopped had submitted, so that it can be finished or cancelled by hand."""
    return f"submitted {len(ids)} of {pluralize(total, 'task')}" + (f": {' '.join(map(str, ids))}" if ids else "")


class _Progress(AbstractContextManager["_Progress"]):
    """Tasks ended out of the replay's total, on stderr: a bar on a terminal, else a line at each tenth (a
    replay was silent for minutes after its last submission)."""

    def __init__(self, total: int, quiet: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._total, self._quiet, self._shown = total, quiet, 0
        columns = (TextColumn("tasks ended"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._bar = Progress(*columns, console=err, transient=True) if err.is_terminal else None
        self._task = self._bar.add_task("ended", total=total) if self._bar else None

    def __enter__(self) -> _Progress:
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar:
            self._bar.stop()

    def ended(self, n: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=n)
        elif not self._quiet and (tenth := n * PROGRESS_LINES // self._total) > self._shown:
            self._shown = tenth
            err.print(f"{n} of {pluralize(self._total, 'task')} ended", highlight=False)


class _Ended:
    """The replay's tasks that ended, each read whole (with its attempts) once it is seen to end: a server
    whose retention is shorter than the replay forgets the first ones before the last end."""

    def __init__(self, client, ids: list[int], progress: _Progress | None = None) -> None:  # type: ignore[no-untyped-def]
        self._client, self._ids, self._progress = client, ids, progress
        self._ended: dict[int, dict[str, Any]] = {}

    def look(self) -> None:
        from carma.server.client import ENDED, ServerDown

        try:
            seen = self._client.states(self._pending(), whole=True)
        except ServerDown:  # restarting, say: the submissions and the last wait deal with it
            return
        self._ended.update((t["id"], t) for t in seen if t["state"] in ENDED)
        self._show(len(self._ended))

    def all(self) -> list[dict[str, Any]]:
        """Every task, whole, once all have ended."""
        from carma.server.client import ENDED

        def polled(tasks: list[dict[str, Any]]) -> None:
            self._show(len(self._ended) + sum(t["state"] in ENDED for t in tasks))

        rest = self._client.wait(self._pending(), whole=True, on_poll=polled)
        self._show(len(self._ended) + len(rest))
        return [*self._ended.values(), *rest]

    def _show(self, n: int) -> None:
        if self._progress is not None:
            self._progress.ended(n)

    def _pending(self) -> list[int]:
        return [i for i in self._ids if i not in self._ended]


class _Declared(NamedTuple):
    """What each replayed task declares: its measured memory need, its solo run time."""

    memory: bool
    duration: bool


def _spec(w: Workload, declared: _Declared) -> dict[str, Any]:
    spec: dict[str, Any] = {"command": fakejob_command(w), "workdir": str(absolute()), "gpus": w.gpus, "name": w.name}
    if declared.memory:
        spec["mem"] = w.mem_mib
    else:
        spec["estimate"] = "none"  # recovery only, as the twin's run it is compared with, not the server's default
    if declared.duration:
        spec["duration"] = w.solo_s
    return spec


def _check_all(client, entries, declared: _Declared) -> None:  # type: ignore[no-untyped-def]
    """Ask the server, before the first submission, about every entry's GPU count and memory (a dry run), so
    that a task it can never run stops the replay with nothing submitted rather than hours into it. Without
    --memory oracle a task larger than every GPU is still replayed, as a job that will run out of memory: a
    warning says so."""
    from carma.server.client import Refused

    seen: set[tuple[int, int]] = set()
    for entry in entries:
        w = entry.workload
        if (w.gpus, w.mem_mib) in seen:  # the server's checks read nothing else of a replayed task
            continue
        seen.add((w.gpus, w.mem_mib))
        try:
            client.check(_spec(w, declared))
        except Refused as e:  # a task this server cannot take: the trace's line says which
            raise Refused(f"{entry.where}: {e}", e.status) from None
        if declared.memory:
            continue
        try:
            client.check(_spec(w, declared._replace(memory=True)))
        except Refused as e:
            err.print(f"warning: {entry.where}: {e}: replayed without its need, it will run out of memory")


def _submit_all(client, entries, scale: float, declared: _Declared, quiet: bool, ids: list[int], on_wait=None) -> None:  # type: ignore[no-untyped-def]
    """Submit each entry at its arrival time, appending each id to `ids` as soon as it is known; `on_wait` is
    called every second of a wait between two submissions. A server that is not answering (restarting) is
    waited for, as `carma wait` does; one that closed the connection during a submission may have taken the
    task, so the replay stops there rather than risk submitting it twice."""
    from carma.server.client import NotAnswering, Refused, through_restarts

    start = time.monotonic()
    first = entries[0].submit_s
    for entry in entries:
        while (delay := start + (entry.submit_s - first) / scale - time.monotonic()) > 0:
            time.sleep(min(delay, 1.0))
            if on_wait is not None:
                on_wait()
        w = entry.workload
        try:
            submit = partial(client.submit, _spec(w, declared))
            task = through_restarts(submit, f"going on with the replay at {entry.where}", err.print, NotAnswering)
        except Refused as e:  # the server changed since the check (restarted with fewer GPUs, say)
            raise Refused(f"{entry.where}: {e}", e.status) from None
        ids.append(task["id"])
        if not quiet:
            err.print(f"t={entry.submit_s:g}s submitted task {task['id']} ({w.name})", highlight=False)
