"""The web dashboard: its page and assets (shipped in the package, no CDN: the machine may be offline),
the data its views load (a timeline of attempts, archived GPU series) and a live stream of the server's
state as server-sent events, at most once a wall second.

The page and assets carry no data and need no credentials; every data route takes the same caller as
the rest of the API, so on TCP the page sends its bearer token (it reads it from the URL's fragment,
`http://HOST:PORT/#token=...`, which never reaches the server or its logs).
"""

# no `from __future__ import annotations`: FastAPI must see the caller dependency `who`, a local, itself
import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import Response, StreamingResponse

from carma import __version__
from carma.core.types import ACTIVE_STATES, TERMINAL_STATES, Task
from carma.server.apart import AnswersApart, in_turns
from carma.server.daemon import Daemon
from carma.server.store import Reads
from carma.server.views import as_seen_by_others, gpu_views, shown_targets, status_view, task_summary

SERIES_POINTS = 4000  # a GPU's in `/v1/series`: a month of ten-second buckets of 8 GPUs took 10 s to send
SNAPSHOT_TASKS = 500  # tasks in a live event: the queue table's rows; `carma queue` lists every one

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}


def _assets() -> dict[str, tuple[bytes, str]]:
    """The dashboard's files, read once: name -> (content, media type)."""
    root = resources.files("carma.server") / "static"
    out = {}
    for entry in root.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in MEDIA_TYPES:
            out[entry.name] = (entry.read_bytes(), MEDIA_TYPES[suffix])
    return out


def series_step(window_s: float, bucket_s: float) -> float | None:
    """The step `/v1/series` merges buckets into for a window of `window_s`, a whole number of buckets; None
    where the window holds no more than `SERIES_POINTS` of them."""
    buckets = math.ceil(window_s / bucket_s / SERIES_POINTS)
    return None if buckets <= 1 else buckets * bucket_s


def timeline_rows(daemon: Daemon, task: Task, since_s: float) -> list[dict[str, Any]]:
    """A task's attempts that ran after `since_s` (or still run), for the per-GPU Gantt chart."""
    job = daemon.jobs.get(task.id)
    if job is None:  # forgotten since the listing began
        return []
    return [
        {
            "task_id": task.id,
            "attempt": a.number,
            "name": job.name,
            "user": job.user,
            "gpus": [daemon.scheduler.shown(g) for g in a.gpus],
            "start_s": a.dispatched_s,
            "first_kernel_s": a.first_kernel_s,
            "end_s": a.ended_s,
            "outcome": a.outcome.value if a.outcome else None,
            "restarted_early": a.restarted_early,  # relaunched as after an OOM crash, before one
            "exclusive": a.exclusive,
            "recovery": a.recovery,
        }
        for a in task.attempts
        if a.ended_s is None or a.ended_s >= since_s
    ]


def timeline_view(daemon: Daemon, since_s: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The attempts of the window (`timeline_rows`) and the MIG reconfigurations since then (from the store:
    those before a restart too)."""
    reconfigurations = [asdict(r) for r in daemon.store.reconfigurations(since_s)]
    return {"now_s": daemon.clock.now(), "since_s": since_s, "attempts": rows, "reconfigurations": reconfigurations}


def snapshot(daemon: Daemon) -> dict[str, Any]:
    """The live state the dashboard redraws: status, GPUs, and the tasks not yet ended: the running ones
    and the first waiting ones, up to `SNAPSHOT_TASKS` (with 10,000 queued, each event was 3.7 MB)."""
    live = [t for t in daemon.scheduler.tasks if t.state not in TERMINAL_STATES]
    shown = sorted(live, key=lambda t: (t.state not in ACTIVE_STATES, t.id))[:SNAPSHOT_TASKS]
    return {
        "tick": daemon.tick,
        "now_s": daemon.clock.now(),
        "status": status_view(daemon),
        "gpus": gpu_views(daemon),
        "tasks": [as_seen_by_others(task_summary(daemon, t)) for t in shown],  # one snapshot for every viewer
        "tasks_not_shown": len(live) - len(shown),
    }


def dashboard_routes(daemon: Daemon, who: Any, answers: AnswersApart, too_many: dict[int | str, Any]) -> APIRouter:
    """The dashboard's routes; `too_many`: the schema's answer when a user's long reads are over their cap."""
    router = APIRouter()
    assets = _assets()
    index = assets.pop("index.html")[0].replace(b"{{version}}", __version__.encode())  # served at / only
    cache: dict[str, Any] = {"tick": -1, "data": b""}

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(index, media_type=MEDIA_TYPES[".html"], headers={"Cache-Control": "no-cache"})

    @router.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(404, f"no dashboard file {name!r}")
        content, media_type = assets[name]
        return Response(content, media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    @router.get("/v1/timeline", response_model=dict[str, Any])
    async def timeline(_: who, hours: Annotated[float, Query(gt=0, le=24 * 90, allow_inf_nan=False)] = 6.0) -> Response:
        """Attempts that ran in the last `hours` (running ones included), per task and GPU, and the MIG
        reconfigurations of those hours."""
        since = daemon.clock.now() - hours * 3600
        rows = await in_turns(list(daemon.scheduler.tasks), lambda task: timeline_rows(daemon, task, since))
        return await answers.encoded(timeline_view(daemon, since, rows))

    @router.get("/v1/series", response_model=dict[str, Any], responses=too_many)
    async def series(
        caller: who, minutes: Annotated[float, Query(gt=0, le=60 * 24 * 90, allow_inf_nan=False)] = 60.0
    ) -> Response:
        """Archived per-GPU samples of the last `minutes`, one per bucket, as columns: at most
        `SERIES_POINTS` a GPU, buckets merged into longer steps (`bucket_s`) where the window holds more."""
        since, step = daemon.clock.now() - minutes * 60, series_step(minutes * 60, daemon.archive.bucket_s)
        shown = shown_targets(daemon)

        def read(reads: Reads) -> dict[str, Any]:
            gpus = reads.gpu_series(since, step_s=step)
            return {
                "bucket_s": step or daemon.archive.bucket_s,
                "gpus": {str(shown.get(g, g)): s for g, s in gpus.items()},
            }

        return await answers.json(read, caller.uid)

    def encoded() -> bytes:
        if cache["tick"] != daemon.tick:  # one encoding per step, whatever the number of viewers
            cache["tick"], cache["data"] = daemon.tick, json.dumps(snapshot(daemon)).encode()
        return cache["data"]

    @router.get("/v1/events")
    async def events(
        _: who, interval: Annotated[float, Query(ge=0.2, le=60, allow_inf_nan=False)] = 1.0
    ) -> StreamingResponse:
        """Server-sent events: the live state after each scheduling step, at most once per `interval`
        wall seconds."""

        async def stream() -> AsyncIterator[bytes]:
            seen = -1
            while True:
                seen = await daemon.wait_tick(seen)
                if daemon.closing:
                    return
                sent = time.monotonic()
                yield b"data: " + encoded() + b"\n\n"
                await asyncio.sleep(max(0.0, sent + interval - time.monotonic()))

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return router
