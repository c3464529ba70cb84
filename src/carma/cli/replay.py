"""`carma replay`: submit a trace to a running server at its arrival times, as fake training jobs."""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from typing import Annotated, Any

import typer

from carma.cli.common import UsageError, absolute, app, choice, err, fail, out, positive
from carma.traces.catalog import Workload
from carma.traces.loaders import BUILTIN_TRACES
from carma.units import pluralize


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
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks.", min=1)] = None,
    skip_unknown: Annotated[bool, typer.Option("--skip-unknown", help="Leave out unknown tasks.")] = False,
    wait: Annotated[
        bool,
        typer.Option(help="Wait for every task to end, print the run's figures; exit 1 unless all completed."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the submitted ids (and figures) as JSON.")] = False,
) -> None:
    """Replay a trace against a running server (fake GPUs): each task is a carma.fakejob with its profile."""
    from carma.server.client import Client, ClientError, run_figures
    from carma.traces.catalog import load_catalog
    from carma.traces.loaders import TraceError, load_trace

    try:
        memory = choice(memory, ("none", "oracle"), "--memory")
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
        server_scale = client.status()["time_scale"]
        if time_scale is not None and time_scale != server_scale:
            err.print(
                f"note: submitting at {time_scale:g}x while the server's GPUs run tasks at {server_scale:g}x: "
                "the trace's arrivals and run times are not kept on one clock"
            )
        ended = _Ended(client, ids)  # read whole as they end: a server's retention may forget the first ones
        on_wait = ended.look if wait else None
        _check_all(client, entries, memory == "oracle")
        _submit_all(client, entries, time_scale or server_scale, memory == "oracle", as_json, ids, on_wait)
        figures = run_figures(ended.all()) if wait else None
    except ClientError as e:
        raise fail(f"{e} ({_submitted(ids, len(entries))})") from None
    except KeyboardInterrupt:
        raise fail(f"interrupted ({_submitted(ids, len(entries))})", code=130) from None
    if as_json:
        print(json.dumps({"trace": loaded.name, "ids": ids, **({"figures": figures} if figures else {})}))
    elif figures:
        out.print(", ".join(f"{k} {v}" for k, v in figures.items()), highlight=False)
    if figures and figures["completed"] < len(ids):  # as `carma wait`: a script sees that some did not complete
        raise typer.Exit(1)


def _submitted(ids: list[int], total: int) -> str:
    """What a replay that stopped had submitted, so that it can be finished or cancelled by hand."""
    return f"submitted {len(ids)} of {pluralize(total, 'task')}" + (f": {' '.join(map(str, ids))}" if ids else "")


class _Ended:
    """The replay's tasks that ended, each read whole (with its attempts) once it is seen to end: a server
    whose retention is shorter than the replay forgets the first ones before the last end."""

    def __init__(self, client, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
        self._client, self._ids = client, ids
        self._ended: dict[int, dict[str, Any]] = {}

    def look(self) -> None:
        from carma.server.client import ENDED, ServerDown

        try:
            seen = self._client.states(self._pending(), whole=True)
        except ServerDown:  # restarting, say: the submissions and the last wait deal with it
            return
        self._ended.update((t["id"], t) for t in seen if t["state"] in ENDED)

    def all(self) -> list[dict[str, Any]]:
        """Every task, whole, once all have ended."""
        return [*self._ended.values(), *self._client.wait(self._pending(), whole=True)]

    def _pending(self) -> list[int]:
        return [i for i in self._ids if i not in self._ended]


def _spec(w: Workload, oracle: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"command": fakejob_command(w), "workdir": str(absolute()), "gpus": w.gpus, "name": w.name}
    if oracle:
        spec["mem"] = w.mem_mib
    return spec


def _check_all(client, entries, oracle: bool) -> None:  # type: ignore[no-untyped-def]
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
            client.check(_spec(w, oracle))
        except Refused as e:  # a task this server cannot take: the trace's line says which
            raise Refused(f"{entry.where}: {e}", e.status) from None
        if oracle:
            continue
        try:
            client.check(_spec(w, oracle=True))
        except Refused as e:
            err.print(f"warning: {entry.where}: {e}: replayed without its need, it will run out of memory")


def _submit_all(client, entries, scale: float, oracle: bool, quiet: bool, ids: list[int], on_wait=None) -> None:  # type: ignore[no-untyped-def]
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
            submit = partial(client.submit, _spec(w, oracle))
            task = through_restarts(submit, f"going on with the replay at {entry.where}", err.print, NotAnswering)
        except Refused as e:  # the server changed since the check (restarted with fewer GPUs, say)
            raise Refused(f"{entry.where}: {e}", e.status) from None
        ids.append(task["id"])
        if not quiet:
            err.print(f"t={entry.submit_s:g}s submitted task {task['id']} ({w.name})", highlight=False)
