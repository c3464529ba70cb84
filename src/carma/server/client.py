"""A client of the daemon's API: the unix socket by default, or `CARMA_URL` (http or https) with `CARMA_TOKEN`.

It uses the standard library's http.client: a CLI command pays for every import at start-up, and a JSON
round trip needs nothing more.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from carma.server.paths import SYSTEM_HOME, Paths, server_socket
from carma.units import inflect

TIMEOUT_S = 30.0
RECONNECT_S = 60.0  # how long `wait`, `logs -f` and a replay's submissions wait out a restart (it takes seconds)
ENDED = frozenset({"completed", "failed", "cancelled"})
DRAINING = "the server is draining: no placements until `carma resume`"  # a waiting task's reason, as the API says it
FEW_TASKS = 20  # up to this many, `wait` asks for each task; beyond, it lists them once per poll
LISTED_IDS = 500  # tasks asked for in one listing (the API takes up to 1,000)
T = TypeVar("T")


def _json_body(value: Any) -> bytes:
    """`value` as UTF-8 JSON, not \\u escapes: a command in another script is not six times its size against
    the server's cap. Text that is no UTF-8 (bytes of another encoding, read from argv) goes escaped, and the
    server says which part it is."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(value).encode()


class ClientError(Exception):
    """A request the server refused or could not take, as one line for the user."""


class Refused(ClientError):
    """The server answered with an error status (`status`: 404 for a task it does not have, say)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerDown(ClientError):
    """Nothing answers where the server should be: it is not started, or is between a stop and a restart."""


class NotAnswering(ServerDown):
    """Nothing took the request (no socket, connection refused): unlike a connection closed in the middle of
    one, which the server may have acted on, it can be sent again without being done twice."""


class GaveUp(ServerDown):
    """The server stayed down longer than a command following tasks through a restart waits for it."""


class WaitTimeout(ClientError):
    """Tasks still had not ended when the wait gave up (its timeout, or the server down too long); `tasks` are
    their last known states."""

    def __init__(self, message: str, tasks: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.tasks = tasks


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("carma", timeout=TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class Client:
    def __init__(self, socket_path: Path | None = None, url: str | None = None, token: str | None = None) -> None:
        url = url or (None if socket_path else os.environ.get("CARMA_URL"))  # a socket given is the one meant
        token = token or os.environ.get("CARMA_TOKEN")
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            raise ClientError("cannot use CARMA_TOKEN: a token is printable ASCII without spaces")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._prefix = ""
        if url:
            self._connect = self._tcp(url)
            self.where = url
        else:
            path = str(socket_path or server_socket())
            self.where = path
            self._connect = lambda: _UnixConnection(path)

    def _tcp(self, url: str) -> Callable[[], http.client.HTTPConnection]:
        """Connections to `http[s]://HOST[:PORT][/PATH]`: a path is the prefix a reverse proxy serves the API under."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:  # out of range, or not a number
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query or parts.fragment:
            raise ClientError(f"cannot use CARMA_URL {url!r}: write http://HOST:PORT or https://HOST[:PORT][/PATH]")
        self._prefix = parts.path.rstrip("/")
        if parts.scheme == "https":  # certificates checked against the system's CAs (or SSL_CERT_FILE's)
            return lambda: http.client.HTTPSConnection(parts.hostname, port or 443, timeout=TIMEOUT_S)
        return lambda: http.client.HTTPConnection(parts.hostname, port or 80, timeout=TIMEOUT_S)

    def request(self, method: str, path: str, params: dict[str, Any] | None = None, json_body: Any = None) -> Any:
        query = (
            "?" + urlencode({k: str(v).lower() if isinstance(v, bool) else v for k, v in params.items()})
            if params
            else ""
        )
        body = _json_body(json_body) if json_body is not None else None
        headers = {**self._headers, **({"Content-Type": "application/json"} if body is not None else {})}
        conn = self._connect()
        try:
            conn.request(method, self._prefix + path + query, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except (FileNotFoundError, ConnectionRefusedError):
            if self.where == str(Paths(SYSTEM_HOME).socket) and os.geteuid() != 0:
                raise NotAnswering(
                    f"the system's carma server is not running (nothing answers at {self.where}): ask its admin, "
                    "or set CARMA_HOME for a server of your own"
                ) from None
            raise NotAnswering(
                f"the carma server is not running (nothing answers at {self.where}); start it with `carma server`"
            ) from None
        except ConnectionResetError as e:  # a server stopping in the middle of the request
            raise ServerDown(f"the carma server at {self.where} closed the connection ({e})") from None
        except OSError as e:
            raise ClientError(f"could not talk to the carma server at {self.where}: {e}") from None
        finally:
            conn.close()
        try:
            data = json.loads(payload) if payload else None
        except ValueError:
            data = None
        if response.status >= 400:
            raise Refused(self._refusal(response.status, data, payload), response.status)
        return data

    def _refusal(self, status: int, data: Any, payload: bytes) -> str:
        if status == 413:  # carma's cap (4 MiB), or a proxy's in front of it
            return f"the request is larger than the server at {self.where} takes (HTTP 413)"
        detail = data.get("detail") if isinstance(data, dict) else None
        # carma's 404s say what is missing; a bare "Not Found" is a path no route takes (CARMA_URL's path
        # wrong), and no detail at all some other web server
        if status == 404 and detail in (None, "Not Found"):
            return f"HTTP 404 from {self.where}: no carma API there (check CARMA_URL and its path)"
        if detail:
            hint = " (set CARMA_TOKEN to your token)" if status == 401 and not self._headers else ""
            return f"{detail}{hint}"
        text = " ".join(payload.decode(errors="replace").split())
        return f"HTTP {status}" + (f": {text[:200]}" if text else "")

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v1/tasks", json_body=spec)

    def check(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Raise Refused as `submit` would, keeping nothing; else `{"dry_run": true, "name": ..., "draining": ...}`."""
        return self.request("POST", "/v1/tasks", {"dry_run": True}, json_body=spec)

    def tasks(self, all: bool = False, state: str | None = None, ids: list[int] | None = None) -> list[dict[str, Any]]:
        """With `ids`, those tasks the server has (whatever `all` says), asked `LISTED_IDS` at a time."""
        params: dict[str, Any] = {"all": all}
        if state:
            params["state"] = state
        if ids is None:
            return self.request("GET", "/v1/tasks", params)
        chunks = (ids[i : i + LISTED_IDS] for i in range(0, len(ids), LISTED_IDS))
        return [
            t
            for chunk in chunks
            for t in self.request("GET", "/v1/tasks", {**params, "ids": ",".join(map(str, chunk))})
        ]

    def task(self, task_id: int) -> dict[str, Any]:
        return self.request("GET", f"/v1/tasks/{task_id}")

    def wait(
        self,
        task_ids: list[int],
        timeout_s: float | None = None,
        poll_s: float = 0.5,
        reconnect_s: float | None = None,
        whole: bool = False,
        on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """The tasks once every one has ended (completed, failed or cancelled); with `whole`, each as `task`
        gives it (with its attempts), read as soon as it is seen to end: the server may forget it later.
        `on_poll` is shown the tasks at each poll (a progress bar).

        A server that stops answering after the first poll is polled on for `reconnect_s` (RECONNECT_S by
        default): a daemon restart (an upgrade, a service manager's restart) re-adopts running tasks, so a
        script's wait should outlive it; WaitTimeout after that, as after `timeout_s`.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tasks = self.states(task_ids)  # a server not running at all is an error at once
        outage = Outage(reconnect_s)
        while True:
            if whole:
                tasks = self._whole(tasks)
            pending = [t["id"] for t in tasks if t["state"] not in ENDED]
            if not pending:
                return tasks
            if on_poll is not None:
                on_poll(tasks)
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(f"timed out waiting for {_ids(pending)}", tasks)
            time.sleep(poll_s)
            try:  # the ended ones are not asked again: the server may forget them (its retention)
                polled = {t["id"]: t for t in self.states(pending)}
                tasks = [polled.get(t["id"], t) for t in tasks]
                outage.over()
            except ServerDown as e:
                try:
                    outage.goes_on(e, f"waiting for {_ids(pending)}")
                except GaveUp as gave_up:
                    raise WaitTimeout(str(gave_up), tasks) from None

    def states(self, task_ids: list[int], whole: bool = False) -> list[dict[str, Any]]:
        """The tasks now (id, state, reason and more), in the order given, without waiting; with `whole`, the
        ended ones as `task` gives them (with their attempts). One request each for a few, a listing of just them
        for many (a thousand requests per poll kept the daemon busy, and a listing of every task it keeps grows
        with its history)."""
        tasks = self._states(task_ids)
        return self._whole(tasks) if whole else tasks

    def _whole(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.task(t["id"]) if t["state"] in ENDED and "attempt_list" not in t else t for t in tasks]

    def _states(self, task_ids: list[int]) -> list[dict[str, Any]]:
        if len(task_ids) <= FEW_TASKS:
            return [self.task(t) for t in task_ids]
        by_id = {t["id"]: t for t in self.tasks(ids=task_ids)}
        if (missing := next((t for t in task_ids if t not in by_id), None)) is not None:
            self.task(missing)  # the server says why (never was, or forgotten)
            raise ClientError(f"no task with id {missing}")
        return [by_id[t] for t in task_ids]

    def cancel(self, task_id: int) -> dict[str, Any]:
        return self.request("POST", f"/v1/tasks/{task_id}/cancel")

    def cancel_many(self, task_ids: list[int]) -> list[dict[str, Any]]:
        """Per id, in order: {"id", "state", "again"} once cancelled or stopping (again: it was before this
        request), {"id", "error"} if refused."""
        return self.request("POST", "/v1/cancel", json_body={"ids": task_ids})["results"]

    def logs(self, task_id: int, stream: str = "stdout", attempt: int | None = None, offset: int = 0) -> dict[str, Any]:
        params: dict[str, Any] = {"stream": stream, "offset": offset}
        if attempt:
            params["attempt"] = attempt
        return self.request("GET", f"/v1/tasks/{task_id}/logs", params)

    def gpus(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/gpus")

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/status")

    def history(self, hours: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        params = {"hours": hours, "limit": limit}
        return self.request("GET", "/v1/history", {k: v for k, v in params.items() if v is not None} or None)

    def drain(self, on: bool) -> dict[str, Any]:
        return self.request("POST", "/v1/drain" if on else "/v1/resume")


class Outage:
    """How long the server has not answered, for a command that follows tasks through a daemon restart (an
    upgrade, a service manager's restart: it re-adopts the running tasks) instead of failing at its first
    second down."""

    def __init__(self, reconnect_s: float | None = None) -> None:
        self.reconnect_s = RECONNECT_S if reconnect_s is None else reconnect_s
        self.since: float | None = None

    def goes_on(self, error: ServerDown, doing: str) -> None:
        """Note a failed request; once the server has been down `reconnect_s`, GaveUp saying what gave up."""
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since > self.reconnect_s:
            raise GaveUp(f"{error}; gave up {doing} after {self.reconnect_s:g} s") from None

    def over(self) -> None:
        self.since = None


def through_restarts(
    request: Callable[[], T], doing: str, said: Callable[[str], None], retried: type[ServerDown] = ServerDown
) -> T:
    """The request's answer once the server answers, sent again while it is down (`retried`: for a request
    that must not be done twice, `NotAnswering` only) for up to RECONNECT_S; `said` gets one line the first
    time, so that the command does not look hung."""
    outage = Outage()
    while True:
        try:
            return request()
        except retried as e:
            if outage.since is None:
                said(f"carma: the server stopped answering; {doing} when it is back")
            outage.goes_on(e, doing)
            time.sleep(0.5)


def _ids(ids: list[int]) -> str:
    """Task ids for a message: all of a few, the first ones of many."""
    if len(ids) <= FEW_TASKS:
        return f"{inflect(len(ids), 'task', 'tasks')} " + ", ".join(map(str, ids))
    return f"{len(ids)} tasks ({', '.join(map(str, ids[:5]))}, ...)"


def run_figures(tasks: list[dict[str, Any]]) -> dict[str, float | int]:
    """A finished run's figures from its tasks as the API shows them: makespan, outcomes, OOM crashes."""
    attempts = [a for t in tasks for a in t["attempt_list"]]
    return {
        "makespan_s": round(max(t["ended_s"] for t in tasks) - min(t["submit_s"] for t in tasks), 1),
        "completed": sum(t["state"] == "completed" for t in tasks),
        "failed": sum(t["state"] == "failed" for t in tasks),
        "cancelled": sum(t["state"] == "cancelled" for t in tasks),
        "oom_crashes": sum(a["outcome"] == "oom" and not a.get("restarted_early") for a in attempts),
        "collocated_attempts": sum(not a["exclusive"] for a in attempts),
    }
