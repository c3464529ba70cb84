"""The daemon's HTTP API (FastAPI; OpenAPI schema at /openapi.json).
Every handler and dependency is a coroutine, so it runs on the daemon's one event-loop thread beside the
scheduling loop (FastAPI would run plain functions in worker threads) and reads and changes the core
without locks. Bad input gets a 4xx with a one-line `detail` and changes nothing; the schema declares each
status a route answers, and the `{"detail": ...}` they come with.
"""

import codecs
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Security
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from carma import __version__
from carma.config import ServerConfig
from carma.core.scheduler import SpecError
from carma.core.types import TERMINAL_STATES, TargetId, Task, TaskId, TaskState
from carma.estimate.registry import METHODS
from carma.server.apart import AnswersApart, in_turns
from carma.server.auth import UNAUTHORIZED, AuthFirst, Caller, Tokens
from carma.server.daemon import Daemon
from carma.server.dashboard import dashboard_routes
from carma.server.metrics import Metrics
from carma.server.spec import ENV_NAME, JobSpec, exec_size_problem, is_text
from carma.server.views import (
    as_seen_by_others,
    gpu_views,
    shown_targets,
    source_only,
    status_view,
    task_summary,
    task_view,
)
from carma.server.workdirs import WorkdirChecks
from carma.units import DURATION_PATTERN, MAX_DURATION_S, cut, parse_mib, parse_seconds

LOG_CHUNK = 1 << 20
NAME_CHARS = 200  # a task's name, given or taken from its program
HISTORY_COMMAND_CHARS = 4096  # of each run's command in `/v1/history`
HISTORY_RUNS = 1000  # the newest runs `/v1/history` gives unless asked for more
MAX_HISTORY_RUNS = 10_000  # 100,000 runs of long commands made one answer 456 MB
MAX_CANCEL_IDS = 100_000  # of one `/v1/cancel`: ten users' whole queues (`max_user_tasks`)
MAX_LISTED_IDS = 1000  # of `/v1/tasks?ids=`: 7 KB of query, far below a request head's limit
NO_ESTIMATE = "none"  # `estimate`: recovery only, whatever the server's default
MAX_OFFSET = 1 << 62  # a log offset beyond any file, below what seeking accepts
# a task a process could start is at most ARG_MAX of command and environment (2 MiB under the usual 8 MiB stack),
# under twice that of UTF-8 JSON: more is refused before it is read, and a body is parsed on the event loop (16
# MiB of one-character arguments held it 1.9 s)
MAX_BODY_BYTES = max(4 << 20, 2 * os.sysconf("SC_ARG_MAX"))
# what a browser loads before it has a token: the dashboard's page and assets, the API's schema and docs
PUBLIC_PATHS = frozenset({"/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


class Problem(BaseModel):
    """Every error's answer: one line saying what was wrong."""

    detail: str


ERRORS = {
    400: "a body that is not JSON text (not UTF-8)",
    401: "no known bearer token (TCP)",
    403: "not the caller's task, or not an admin's request",
    404: "no such task, or no such attempt of it",
    409: "the task already ended, or its log cannot be read",
    413: f"a request over {MAX_BODY_BYTES >> 20} MiB",
    422: "an invalid request",
    429: "over what the server takes from one user: tasks not ended, or their commands and environments, "
    "as many or as large as [server] max_user_tasks or max_user_spec_mib allow; or long reads (history, series) "
    "under way",
    503: "too many connections open to the server, or its state cannot be written now",
    507: "no space left under the server's state directory: nothing was changed",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The schema's error answers of a route, beside the 401 and 503 every route may give."""
    return {code: {"model": Problem, "description": ERRORS[code]} for code in (401, *codes, 503)}


# a run time as `carma.units.parse_seconds` reads it, said in the schema so that a client (or a fuzzer) can tell
RunTimeText = Annotated[StrictStr, StringConstraints(pattern=DURATION_PATTERN)]
PositiveSeconds = Annotated[StrictInt | StrictFloat, Field(gt=0, le=MAX_DURATION_S)]


class SubmitRequest(BaseModel):
    """A task spec: argv (or one shell line with `shell`), working directory, GPUs, memory, environment."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(min_length=1, description="argv; with shell=true, a single shell command line")
    workdir: str = Field(description="absolute working directory")
    name: str | None = Field(None, max_length=NAME_CHARS)
    # strict: a task file's `gpus: true` or `shell: "yes"` is a mistake to report, not a value to coerce
    gpus: StrictInt = Field(1, ge=1)
    mem: StrictStr | StrictInt | None = Field(None, description="GPU memory need, e.g. 8GiB or MiB as a number")
    env: dict[str, str] = Field(default_factory=dict)
    shell: StrictBool = False
    mps_threads: StrictInt | None = Field(None, ge=1, le=100, description="MPS active thread percentage")
    estimate: str | None = Field(
        None,
        description=f"memory estimator when mem is not given: {', '.join(METHODS)}, or none (recovery only); "
        "absent: the server's [estimate] default",
    )
    duration: RunTimeText | PositiveSeconds | None = Field(
        None,
        description="the run time expected, not a limit, e.g. 2h, 90min, 1h30m, or seconds as a number; absent: "
        "its command's history",
    )


class CancelRequest(BaseModel):
    """Tasks to cancel together."""

    model_config = ConfigDict(extra="forbid")

    ids: list[StrictInt] = Field(min_length=1, max_length=MAX_CANCEL_IDS)


_UNION_MEMBERS = {"str", "int", "bool", "float"}  # pydantic's names for a union's members in an error's location


def _one_line(exc: RequestValidationError) -> str:
    """The first error, with the field as a task file writes it (`command[3]`, not `command.3`, nor `mem.str`
    for one of the types a field takes) and the value given, when it is a short one (a YAML number in a list)."""
    first = exc.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    value = first.get("input")
    if first.get("type") == "enum":  # a query's choice (`state`), the choices as a user types them
        choices = ", ".join(re.findall(r"'([^']*)'", first.get("ctx", {}).get("expected", "")))
        return f"invalid request: {loc[-1]} must be one of {choices}; got {value!r}"
    if loc[:1] == ["duration"]:  # the schema's members (a pattern, a range) would be named, not the run time's rule
        return f"invalid request: duration: {_run_time_problem(value)}"
    if len(loc) > 1 and loc[-1] in _UNION_MEMBERS:
        loc.pop()
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if where and isinstance(value, str | int | float) and len(repr(value)) <= 40:
        where += f" = {value!r}"
    message = first.get("msg", "invalid")
    if loc == ["mem"] and isinstance(value, float):  # `mem: 8192` is MiB: 1.5 was told to be quoted, as "1.5"
        message = (
            "a memory size is a finite number"  # `.inf` in YAML was told to be given with a unit
            if not math.isfinite(value)
            else "a size without a unit is whole MiB, written as an integer, or give it with its unit, e.g. '8GiB'"
            if value.is_integer()  # 1e300 was told to be given as a fraction
            else "a size without a unit is whole MiB; give a fraction with its unit, e.g. '1.5GiB'"
        )
    elif message == "Input should be a valid string" and isinstance(value, int | float | bool):
        message += " (quote it in a task file)"
    return f"invalid request: {where + ': ' if where else ''}{message}"


def _run_time_problem(value: object) -> str:
    """Why `value` is no run time, in the words `carma submit --duration` uses."""
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        try:
            parse_seconds(value)
        except ValueError as e:
            return str(e)
    return "a run time is text such as 2h, 90min or 1h30m, or a number of seconds"


def _texts(request: SubmitRequest) -> Iterator[tuple[str, str]]:
    """The texts a submission hands the task's process (its command, working directory and environment
    values), each with how an error names it."""
    for n, arg in enumerate(request.command, 1):
        yield (f"argument {n} of the command" if len(request.command) > 1 else "the command"), arg
    yield "the working directory", request.workdir
    for k, v in request.env.items():
        yield f"the value of environment variable {k}", v


def _not_text(request: SubmitRequest) -> str | None:
    """What of a submission is not UTF-8 text, if anything: kept, it ran, but every answer naming it failed
    (HTTP 500 for the submission, which had queued it, and for `show` and `history`, everyone's)."""
    return next((what for what, text in _texts(request) if not is_text(text)), None)


def _program_name(command: list[str]) -> str:
    """A task's default name: the file name of its program (of a shell line's first word), cut to a name's
    length, as every listing and dashboard event carries it; "" for none."""
    words = command[0].split()
    return cut(Path(words[0]).name, NAME_CHARS) if words else ""


def _history_row(run: dict[str, Any]) -> dict[str, Any]:
    """An ended attempt as `/v1/history` gives it: its command cut after `HISTORY_COMMAND_CHARS` characters,
    the last word kept ending in "…" (a command may hold 2 MB, and the answer holds every ended run)."""
    command, kept, room = run["command"], [], HISTORY_COMMAND_CHARS
    if sum(map(len, command)) <= room:
        return run
    for word in command:
        if len(word) >= room:
            kept.append(cut(word, max(room, 2)))
            break
        kept.append(word)
        room -= len(word)
    return {**run, "command": kept}


def _history_view(runs: list[dict[str, Any]], shown: dict[TargetId, int | str], who: Caller) -> list[dict[str, Any]]:
    """`/v1/history`'s runs: GPUs as `carma gpus` names them (`shown`: a GPU gone, by its id), each command
    cut; why another user's estimate failed (its capture's last error line) is theirs."""
    runs = [_history_row({**r, "gpus": [shown.get(g, g) for g in r["gpus"]]}) for r in runs]
    if who.admin:
        return runs
    return [r if r["user"] == who.user else {**r, "need_source": source_only(r["need_source"])} for r in runs]


TOO_LARGE = f"the request is over {MAX_BODY_BYTES >> 20} MiB"


def too_large_as_json(app: ASGIApp) -> ASGIApp:
    """`app`, answering a request whose Content-Length is over the cap at once, as its other errors,
    `{"detail": ...}`: Starlette's cap answers that one in plain text (a body sent without a length, which
    it finds too large as it reads, gets the JSON)."""

    async def capped(scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope.get("headers", ())).get(b"content-length", b"0") if scope["type"] == "http" else b"0"
        if length.isdigit() and int(length) > MAX_BODY_BYTES:  # h11 refuses a malformed length first
            await JSONResponse({"detail": TOO_LARGE}, status_code=413)(scope, receive, send)
            return
        await app(scope, receive, send)

    return capped


def create_app(daemon: Daemon, tokens: Tokens, settings: ServerConfig | None = None) -> FastAPI:
    """The API over `daemon`; `settings`: what one user (not an admin) may hold of it ([server] max_user_*)."""
    settings = settings or ServerConfig()
    app = FastAPI(
        title="carma",
        version=__version__,
        description="Collocation-aware GPU resource manager",
        max_body_size=MAX_BODY_BYTES,
    )

    app.add_middleware(AuthFirst, tokens=tokens, public=is_public)
    workdir_checks = WorkdirChecks()
    answers = AnswersApart(daemon.store)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # no request to validate: the body is not JSON at all
            why = first.get("ctx", {}).get("error", "malformed")
            return JSONResponse({"detail": f"the body is not JSON: {why}"}, status_code=400)
        return JSONResponse({"detail": _one_line(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:  # Starlette's Allow named the methods of one route of the path, not all
            allow = ", ".join(sorted(methods(request.scope)))
            exc = StarletteHTTPException(405, f"{request.method} is not allowed here; use {allow}", {"Allow": allow})
        return await http_exception_handler(request, exc)

    def methods(scope: Scope) -> set[str]:
        return {m for r in app.routes if r.matches(scope)[0] is not Match.NONE for m in getattr(r, "methods", ())}

    bearer = HTTPBearer(auto_error=False, description="on TCP, a token of the tokens file; none on the unix socket")

    async def caller(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> Caller:
        """Who is calling, as `AuthFirst` found it before anything read the body."""
        found = request.scope.get("carma.caller")
        if found is None:  # a route taking a caller at a path left public: refused all the same
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        return found

    Who = Annotated[Caller, Depends(caller)]

    async def admin(who: Who) -> Caller:
        if not who.admin:
            raise HTTPException(
                403, "only root or the daemon's owner may do this (on TCP: a token marked admin in the tokens file)"
            )
        return who

    def kept(task_id: TaskId) -> Task | None:
        try:
            return daemon.scheduler.task(task_id)
        except KeyError:
            return None

    def task_or_404(task_id: TaskId) -> Task:
        if (task := kept(task_id)) is None:
            raise HTTPException(404, daemon.no_task(task_id))
        return task

    def is_theirs(task: Task, who: Caller) -> bool:
        return who.admin or daemon.jobs[task.id].uid == who.uid

    def seen_by(who: Caller, task: Task, view: dict[str, Any]) -> dict[str, Any]:
        return view if is_theirs(task, who) else as_seen_by_others(view)

    def owned(task: Task, who: Caller) -> None:
        if not is_theirs(task, who):
            raise HTTPException(403, f"task {task.id} belongs to {daemon.jobs[task.id].user}, not to {who.user}")

    @app.get("/v1/status", responses=errors())
    async def status(who: Who) -> dict[str, Any]:
        return {**status_view(daemon), "you": {"user": who.user, "uid": who.uid, "admin": who.admin}}

    @app.get("/v1/gpus", responses=errors())
    async def gpus(_: Who) -> list[dict[str, Any]]:
        return gpu_views(daemon)

    @app.post(
        "/v1/tasks",
        status_code=201,
        responses={200: {"description": "dry_run: the server would take the task"}, **errors(400, 413, 422, 429, 507)},
    )
    async def submit(request: SubmitRequest, who: Who, response: Response, dry_run: bool = False) -> dict[str, Any]:
        bad_env = [k for k in request.env if not ENV_NAME.match(k)]
        if bad_env:
            raise HTTPException(422, f"invalid request: environment variable name {bad_env[0]!r}")
        if request.shell and len(request.command) != 1:
            raise HTTPException(422, "invalid request: with shell=true, command must be one shell line")
        if any("\0" in text for _, text in _texts(request)):
            raise HTTPException(422, "invalid request: the command, working directory or environment holds a NUL byte")
        if not_text := _not_text(request):
            raise HTTPException(422, f"invalid request: {not_text} is not UTF-8 text (bytes of another encoding?)")
        if too_big := exec_size_problem(request.command, request.env):
            raise HTTPException(422, f"invalid request: {too_big}")
        name = request.name or _program_name(request.command)
        if not name:
            raise HTTPException(422, "invalid request: command: its program is empty")
        if not name.isprintable():  # the queue is shown on everyone's terminal: no escape sequences, no new lines
            whose = "name" if request.name else "the program's name, the task's name when none is given,"
            raise HTTPException(422, f"invalid request: {whose} {name!r} holds a control character")
        try:
            mem = parse_mib(request.mem) if request.mem is not None else None
        except ValueError as e:
            raise HTTPException(422, f"invalid request: mem: {e}") from None
        try:
            duration_s = parse_seconds(request.duration) if request.duration is not None else None
        except ValueError as e:
            raise HTTPException(422, f"invalid request: duration: {e}") from None
        if request.estimate is not None and request.estimate not in (*METHODS, NO_ESTIMATE):
            raise HTTPException(422, f"invalid request: estimate: choose one of {', '.join(METHODS)} or none")
        if request.estimate is not None and mem is not None:
            raise HTTPException(422, "invalid request: give mem or estimate, not both")
        if request.estimate not in (None, "history", NO_ESTIMATE) and request.shell:  # a capture runs Python
            raise HTTPException(
                422, f"a shell command line cannot be estimated by {request.estimate}: submit `python script.py ...`"
                " without --shell, or declare its memory (--mem)",
            )  # fmt: skip
        if daemon.executor.run_as_owner and who.gid < 0:
            raise HTTPException(
                422,
                f"uid {who.uid} ({who.user}) has no account on this machine, and a daemon run as root runs each "
                "task as its owner: give the token a uid that has one",
            )
        job = JobSpec(
            name=name,
            argv=tuple(request.command),
            workdir=request.workdir,
            gpus=request.gpus,
            mem_mib=mem,
            env=request.env,
            shell=request.shell,
            uid=who.uid,
            gid=who.gid,
            user=who.user,
            mps_threads=request.mps_threads,
            estimator=None if request.estimate == NO_ESTIMATE else request.estimate,
            duration_s=duration_s,
        )
        # awaited before the caps are counted: nothing between them and the submission may let another in
        if problem := await workdir_checks.problem(job.workdir):
            raise HTTPException(422, f"working directory {job.workdir!r} {problem}")
        if not who.admin:  # each holds its spec, environment included, in memory and in the database
            jobs = (daemon.jobs[t.id] for t in daemon.scheduler.tasks if not t.terminal)
            mine = [other for other in jobs if other.uid == who.uid]
            if len(mine) >= settings.max_user_tasks:
                raise HTTPException(
                    429,
                    f"{who.user} has {len(mine)} tasks not ended, the most this server takes from one user ([server] "
                    "max_user_tasks): submit more as they end",
                )
            held = sum(other.size_bytes for other in mine) + job.size_bytes
            if held > settings.max_user_spec_mib << 20:
                raise HTTPException(
                    429,
                    f"{who.user}'s tasks not ended would hold {held / 2**20:.1f} MiB of commands and environments, "
                    f"more than this server keeps for one user ({settings.max_user_spec_mib} MiB, [server] "
                    "max_user_spec_mib): submit more as they end, or with a smaller environment",
                )
        try:
            if dry_run:
                daemon.check(job, workdir_checked=True)
                response.status_code = 200
                return {"dry_run": True, "name": name, "draining": daemon.draining}
            task = daemon.submit(job, default_estimate=request.estimate != NO_ESTIMATE, workdir_checked=True)
        except SpecError as e:
            raise HTTPException(422, str(e)) from None
        return task_view(daemon, task)

    @app.get("/v1/tasks", responses=errors(422), response_model=list[dict[str, Any]])
    async def tasks(
        who: Who,
        state: TaskState | None = None,
        all: bool = False,
        ids: Annotated[
            str | None,
            Query(
                description=f"these tasks only, whatever their state: up to {MAX_LISTED_IDS:,} ids, comma-separated",
                pattern=rf"^[0-9]{{1,18}}(,[0-9]{{1,18}}){{0,{MAX_LISTED_IDS - 1}}}$",
            ),
        ] = None,
    ) -> Response:
        """The tasks not ended (`all`: every task the server keeps; `state`: those in it), oldest first. A
        task of `ids` the server does not have is left out."""
        if ids is not None:
            selected = [t for t in map(kept, dict.fromkeys(map(int, ids.split(",")))) if t is not None]
        else:
            selected = [t for t in daemon.scheduler.tasks if all or state or t.state not in TERMINAL_STATES]
        if state:
            selected = [t for t in selected if t.state is state]

        def summary(task: Task) -> list[dict[str, Any]]:  # none of a task forgotten meanwhile
            return [seen_by(who, task, task_summary(daemon, task))] if task.id in daemon.jobs else []

        return await answers.encoded(await in_turns(selected, summary))

    @app.get("/v1/tasks/{task_id}", responses=errors(404, 422))
    async def show(task_id: TaskId, who: Who) -> dict[str, Any]:
        task = task_or_404(task_id)
        return seen_by(who, task, task_view(daemon, task))

    def cancellable(task_id: TaskId, who: Caller) -> Task:
        task = task_or_404(task_id)
        owned(task, who)
        if task.state in TERMINAL_STATES:
            raise HTTPException(409, f"task {task_id} already ended ({task.state.value})")
        return task

    @app.post("/v1/tasks/{task_id}/cancel", responses=errors(403, 404, 409, 422, 507))
    async def cancel(task_id: TaskId, who: Who) -> dict[str, Any]:
        (task,) = daemon.cancel(cancellable(task_id, who).id)
        return task_view(daemon, task)

    @app.post("/v1/cancel", responses=errors(400, 413, 422, 507))
    async def cancel_many(body: CancelRequest, who: Who) -> dict[str, Any]:
        """Cancel several tasks at once, each on its own (one refused stops none of the others), one result
        per id given (an id given twice is answered once). No placement comes between them: one at a time, a
        waiting task was started on the GPU a running one just freed, before its own cancel came."""
        results: dict[TaskId, dict[str, Any]] = {}
        for task_id in dict.fromkeys(body.ids):
            try:
                task = cancellable(task_id, who)
            except HTTPException as e:
                results[task_id] = {"id": task_id, "error": e.detail}
                continue
            if task.cancel_requested:  # stopping already: nothing to write, no second SIGTERM
                results[task_id] = {"id": task_id, "state": task.state.value, "again": True}
            else:
                results[task_id] = {"id": task_id, "again": False}
        for task in daemon.cancel(*(i for i, r in results.items() if r.get("again") is False)):
            results[task.id]["state"] = task.state.value
        return {"results": list(results.values())}

    @app.get("/v1/tasks/{task_id}/logs", responses=errors(403, 404, 409, 422))
    async def logs(
        task_id: TaskId,
        who: Who,
        stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
        attempt: Annotated[int | None, Query(ge=1)] = None,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    ) -> dict[str, Any]:
        """Up to `LOG_CHUNK` bytes of the log from `offset`, cut after its last whole UTF-8 character (the
        next chunk starts with the rest); `done` once the attempt has ended (the task did, or was relaunched:
        `attempts` says how many it has) and the chunk reaches the log's end."""
        task = task_or_404(task_id)
        owned(task, who)
        number = attempt or (task.current.number if task.current else None)
        attempts = len(task.attempts)
        if number is None:
            return {"attempt": None, "attempts": 0, "text": "", "offset": 0, "done": task.state in TERMINAL_STATES}
        if not 1 <= number <= attempts:
            raise HTTPException(404, f"task {task_id} has no attempt {number}")
        finished = task.state in TERMINAL_STATES or number < attempts  # before reading: no line written after
        data, at_end = b"", True
        try:
            with daemon.executor.open_log(task_id, number, stream) as f:
                f.seek(offset)
                data = f.read(LOG_CHUNK)
                at_end = not f.read(1)
        except FileNotFoundError:
            pass  # the attempt has not started yet
        except OSError as e:  # a link, FIFO or directory the task put in its log's place: refused, never followed
            raise HTTPException(409, f"task {task_id}'s {stream} cannot be read: {e.strerror or e}") from None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = decoder.decode(data, final=finished and at_end)  # a running task may write the rest of a character
        end = offset + len(data) - len(decoder.getstate()[0])  # a character cut at the chunk's end comes next
        return {"attempt": number, "attempts": attempts, "text": text, "offset": end, "done": finished and at_end}

    @app.get("/v1/history", responses=errors(422, 429), response_model=list[dict[str, Any]])
    async def history(
        who: Who,
        hours: Annotated[float | None, Query(gt=0, allow_inf_nan=False)] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_HISTORY_RUNS)] = HISTORY_RUNS,
    ) -> Response:
        """The newest `limit` ended attempts with what telemetry saw of them, oldest first; of the last `hours`
        only with it."""
        since = None if hours is None else daemon.clock.now() - hours * 3600
        shown = shown_targets(daemon)
        return await answers.json(lambda reads: _history_view(reads.history(since, limit), shown, who), who.uid)

    metrics = Metrics(daemon)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(_: Who) -> Response:
        """Prometheus exposition (bearer token on TCP, like every request)."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(dashboard_routes(daemon, Who, answers, errors(429)), responses=errors(422))

    def set_draining(on: bool) -> dict[str, Any]:
        """`changed`: whether it was not so already (a second drain is said to be one)."""
        changed, daemon.draining = daemon.draining != on, on
        return {"draining": on, "changed": changed}

    @app.post("/v1/drain", responses=errors(403, 507))
    async def drain(_: Annotated[Caller, Depends(admin)]) -> dict[str, Any]:
        return set_draining(True)

    @app.post("/v1/resume", responses=errors(403, 507))
    async def resume(_: Annotated[Caller, Depends(admin)]) -> dict[str, Any]:
        return set_draining(False)

    return app
