"""The daemon's API under attack: who is calling is settled before a body is read, connections are capped
per listener and per user and cut when idle, the descriptor limit is raised, and every refusal is a 4xx
(or 503) with one `{"detail": ...}` line, as the schema says."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import pwd
import resource
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from carma.config import ConfigError, parse_config
from carma.server.client import Client, Refused
from servers import Server, free_port, server_starter
from support import wait_until

ADMIN_TOKEN = "admin-token-0123456789"
SOFT, HARD = 64, 256  # the daemon's descriptor limits: it raises the soft one to the hard one
IDLE_S = 1.0
PER_USER = 4
PER_ADDRESS = 8
# a daemon started under the low limits above (as systemd starts one, with 1,024 and 524,288)
LAUNCHER = (
    sys.executable,
    "-c",
    f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, {HARD})); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, int]]:
    """A daemon on fake GPUs on TCP and on a unix socket other users may reach, under a low descriptor
    limit, with connections cut after a second without a request; and its TCP port."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < HARD:
        pytest.skip(f"the hard limit on open files here is below {HARD}")
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    home.chmod(0o711)  # its socket is reached by another user's connections (as root)
    (home / "tokens").write_text(f"{ADMIN_TOKEN} ops 0 admin\n")
    (home / "tokens").chmod(0o600)
    (home / "carma.toml").write_text(
        f"[server]\nmax_user_connections = {PER_USER}\nmax_address_connections = {PER_ADDRESS}\n"
        f"idle_timeout_s = {IDLE_S}\n"
    )
    port = free_port()
    starter = server_starter()
    start = next(starter)
    options = ("--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{port}", "--config", str(home / "carma.toml"))
    yield start(*options, home=home, launcher=LAUNCHER), port
    with contextlib.suppress(StopIteration):
        next(starter)
    shutil.rmtree(home, ignore_errors=True)


def _exchange(port: int, request: bytes, timeout: float = 10) -> bytes:
    """Send `request` raw and read the answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _request(port: int, method: str, path: str, token: str | None = ADMIN_TOKEN) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


# ----------------------------------------------------------------------------- auth first


def test_a_post_without_a_token_is_refused_before_its_body_is_sent(served):  # type: ignore[no-untyped-def]
    """The body was read, and parsed, before the token was checked: 20 such POSTs of 15 MiB took the daemon
    from 59 to 915 MiB. Now the answer comes from the head alone, and the connection is closed."""
    _, port = served
    head = (
        b"POST /v1/tasks HTTP/1.1\r\nHost: carma\r\nContent-Type: application/json\r\nContent-Length: 4194304\r\n\r\n"
    )
    answer = _exchange(port, head)  # no body follows: a server waiting for it would never answer
    status, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized"
    assert {b"www-authenticate: bearer", b"connection: close"} <= set(headers.lower().split(b"\r\n"))
    assert json.loads(body) == {"detail": "missing or unknown bearer token"}


def test_a_bad_body_without_a_token_is_401_not_422(served):  # type: ignore[no-untyped-def]
    _, port = served
    body = b'{"command": '  # not JSON: it was parsed, and refused, before the token was looked at
    head = b"POST /v1/tasks HTTP/1.1\r\nHost: carma\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    answer = _exchange(port, head % len(body) + body)
    assert answer.startswith(b"HTTP/1.1 401 ")  # was 422: the body judged before the caller


def test_a_body_that_is_not_json_is_a_400_one_liner(served):  # type: ignore[no-untyped-def]
    """As the schema says: it was a 422 located at `[1]` (a position in the body) with pydantic's words."""
    _, port = served
    body = b"{bad"
    head = b"POST /v1/tasks HTTP/1.1\r\nHost: carma\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    answer = _exchange(port, head % len(body) + b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {
        "detail": "the body is not JSON: Expecting property name enclosed in double quotes"
    }


def test_the_page_and_schema_stay_public(served):  # type: ignore[no-untyped-def]
    _, port = served
    assert [_request(port, "GET", path, token=None).status for path in ("/", "/openapi.json", "/v1/status")] == [
        200,
        200,
        401,
    ]


# ----------------------------------------------------------------------------- answers as the schema says


def test_a_working_directory_with_a_name_too_long_is_a_422_one_liner(served, tmp_path):  # type: ignore[no-untyped-def]
    server, _ = served
    workdir = f"{tmp_path}/{'x' * 300}"  # one component over 255 bytes: was HTTP 500, File name too long
    with pytest.raises(Refused) as refused:
        server.client.submit({"command": ["true"], "workdir": workdir})
    assert refused.value.status == 422
    assert str(refused.value) == f"working directory {workdir!r} cannot be checked (File name too long)"


def _unsearchable(tmp_path: Path) -> Path:
    """A path this user (the daemon's) may not stat: below a directory closed to it, or another process's
    working directory (closed to root too where ptrace rights are not held)."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0)
    for path in (closed / "x", Path("/proc/1/cwd/x")):
        try:
            path.is_dir()
        except PermissionError:
            return path
    pytest.skip("this user may stat every path tried (root, with the rights to read /proc/1/cwd)")


def test_a_working_directory_the_daemon_may_not_stat_is_a_422_one_liner(served, tmp_path):  # type: ignore[no-untyped-def]
    server, _ = served
    workdir = str(_unsearchable(tmp_path))  # was HTTP 500, Permission denied
    with pytest.raises(Refused) as refused:
        server.client.submit({"command": ["true"], "workdir": workdir})
    assert refused.value.status == 422
    assert str(refused.value) == f"working directory {workdir!r} cannot be checked (Permission denied)"


def test_a_method_a_path_does_not_take_gets_405_naming_every_method_it_does(served):  # type: ignore[no-untyped-def]
    """OPTIONS /v1/tasks answered `Allow: POST`, the methods of the path's first route only."""
    _, port = served
    for method, path, allow in (("OPTIONS", "/v1/tasks", "GET, POST"), ("DELETE", "/v1/tasks/1", "GET"),
                                ("PUT", "/v1/drain", "POST")):  # fmt: skip
        response = _request(port, method, path)
        assert (response.status, response.getheader("Allow")) == (405, allow), (method, path)


def test_the_schema_declares_every_error_as_answered(served):  # type: ignore[no-untyped-def]
    """Errors are `{"detail": "<one line>"}`; the schema said a list (FastAPI's validation errors), declared
    no 404, and took any `state`."""
    _, port = served
    schema = Client(url=f"http://127.0.0.1:{port}", token=ADMIN_TOKEN).request("GET", "/openapi.json")
    problem = schema["components"]["schemas"]["Problem"]
    assert problem["properties"] == {"detail": {"type": "string", "title": "Detail"}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                if not code.startswith("2"):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/Problem", (method, path, code)
    assert {"400", "401", "413", "422", "503", "507"} <= set(schema["paths"]["/v1/tasks"]["post"]["responses"])
    assert "404" in schema["paths"]["/v1/tasks/{task_id}"]["get"]["responses"]
    (state,) = [p for p in schema["paths"]["/v1/tasks"]["get"]["parameters"] if p["name"] == "state"]
    assert {"$ref": "#/components/schemas/TaskState"} in state["schema"]["anyOf"]
    assert "oom_crashed" in schema["components"]["schemas"]["TaskState"]["enum"]
    missing = _request(port, "GET", "/v1/tasks/999")
    assert missing.status == 404


# ----------------------------------------------------------------------------- descriptors


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_daemon_raises_its_descriptor_limit_and_caps_connections_to_half_of_it(served):  # type: ignore[no-untyped-def]
    server, _ = served
    log = (server.home / "test-server.log").read_text()
    assert (
        f"open descriptors: at most {HARD} (raised from {SOFT}); connections: at most {HARD // 4} per listener "
        f"(half the descriptors; [server] max_connections is more), {PER_USER} per user on the unix socket, "
        f"{PER_ADDRESS} per address on TCP, each closed after {IDLE_S:g}s without a request"
    ) in log


def test_an_idle_connection_flood_leaves_the_daemon_answering(served):  # type: ignore[no-untyped-def]
    """1,500 idle connections without a token exhausted the daemon's 1,024 descriptors, and the scheduling
    loop stopped the server (`Too many open files: '/proc'`). Here 400 against a limit of 256, from 50
    addresses (loopback's), each within its own cap."""
    server, port = served
    flood = []
    for address in range(50):
        for _ in range(PER_ADDRESS):
            flood.append(_connect(port, f"127.0.1.{address + 1}"))
    try:
        assert _descriptors(server.proc.pid) < HARD
        assert server.client.status()["draining"] is False  # the unix socket answers an admin at once
        refusals = 0
        for sock in flood:  # each over the cap is answered and closed at once; the others after a second idle
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            if answer.startswith(b"HTTP/1.1 503 "):
                refusals += 1
                assert json.loads(answer.partition(b"\r\n\r\n")[2])["detail"].startswith(
                    f"the carma server has {HARD // 4} "
                )
        assert refusals >= 250  # all but the cap's 64, unless the first were cut idle before the last came
    finally:
        for sock in flood:
            sock.close()
    wait_until(lambda: _request(port, "GET", "/v1/status").status == 200, 10, "TCP to answer again")
    task = server.submit("true")
    assert server.wait_state(task, "completed", timeout=60)["state"] == "completed"  # the loop runs on


def _connect(port: int, source: str) -> socket.socket:
    """A connection to the server's TCP port from `source` (any 127.x.y.z address is this machine's)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def test_one_address_cannot_take_the_tcp_listener_from_the_others(served):  # type: ignore[no-untyped-def]
    """256 connections from one address held the TCP listener, each for its idle timeout, from everyone else."""
    _, port = served
    held = [_connect(port, "127.0.2.1") for _ in range(PER_ADDRESS + 3)]
    try:
        for sock in held:
            sock.settimeout(IDLE_S + 5)
        answers = [_answer(sock) for sock in held]  # the refused at once, the others cut idle without one
        refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503 ")]
        assert len(refused) == 3
        assert json.loads(refused[0].partition(b"\r\n\r\n")[2]) == {
            "detail": f"your address (127.0.2.1) has {PER_ADDRESS} connections open to the carma server: close some, "
            "then retry"
        }
    finally:
        for sock in held:
            sock.close()


def test_a_connection_sending_its_request_a_byte_at_a_time_is_cut(served):  # type: ignore[no-untyped-def]
    """uvicorn closed a silent keep-alive connection only, and one that never sent a whole request never."""
    _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: carma\r\nX-Slow: ")
        while not select.select([sock], [], [], 0.1)[0]:  # a byte every 0.1 s, until the server closes
            assert time.monotonic() < started + IDLE_S + 5, "the server kept a connection that sent no request"
            sock.send(b"x")
        with contextlib.suppress(ConnectionResetError):  # the close met a byte sent after it
            assert sock.recv(4096) == b""
    assert time.monotonic() - started < IDLE_S + 2


def test_a_connection_sending_its_body_a_byte_at_a_time_is_cut(served):  # type: ignore[no-untyped-def]
    """Once a request's head had come, its body could trickle for ever: 32 connections a user, each holding
    up to the cap's 4 MiB. A body gets six times the idle timeout."""
    _, port = served
    head = f"POST /v1/tasks HTTP/1.1\r\nHost: carma\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{".encode())
        while not select.select([sock], [], [], 0.1)[0]:  # a byte every 0.1 s, until the server closes
            assert time.monotonic() < started + 8 * IDLE_S + 5, "the server kept a connection whose body trickled"
            sock.send(b" ")
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""
    assert time.monotonic() - started >= 6 * IDLE_S  # not cut as a request that sent no head


def _answer(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except TimeoutError:
        return b""


def test_one_user_cannot_take_the_unix_socket_from_the_others(served):  # type: ignore[no-untyped-def]
    """1,100 idle unix-socket connections of one unprivileged user exhausted the daemon's descriptors."""
    server, _ = served
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root")
    nobody = pwd.getpwnam("nobody")
    report_r, report_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: 10 connections, held until released
        try:
            os.close(report_r)
            os.close(release_w)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            held = [socket.socket(socket.AF_UNIX) for _ in range(10)]
            for sock in held:
                sock.settimeout(IDLE_S + 5)
                sock.connect(str(server.home / "carma.sock"))
            # answered at once when refused; the others are cut after a second idle, without an answer
            refused = sum(_answer(sock).startswith(b"HTTP/1.1 503 ") for sock in held)
            os.write(report_w, str(refused).encode())
            os.read(release_r, 1)
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(release_r)
    try:
        assert os.read(report_r, 16) == str(10 - PER_USER).encode()
        assert server.client.status()["you"]["user"] == "root"
    finally:
        os.close(release_w)
        os.waitpid(pid, 0)
        os.close(report_r)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_connections": 0}, "max_connections must be at least 1, not 0"),
        ({"max_user_connections": -1}, "max_user_connections must be at least 1, not -1"),
        ({"max_address_connections": 0}, "max_address_connections must be at least 1, not 0"),
        ({"idle_timeout_s": 0}, "idle_timeout_s must be positive, not 0"),
        ({"idle_timeout_s": "10"}, "idle_timeout_s must be a number, not '10'"),
    ],
)
def test_connection_settings_out_of_range_are_refused_in_one_line(settings, message):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as refused:
        parse_config({"server": settings}, "carma.toml")
    assert str(refused.value) == f"carma.toml [server]: {message}"


def test_a_working_directory_whose_check_hangs_refuses_its_submission_not_the_daemon(monkeypatch):  # type: ignore[no-untyped-def]
    """The check is a stat as root: on a hung NFS home it never returned, and on the event loop it stopped the
    daemon. It runs on a thread of its own: past the timeout the submission is refused, and while the stuck
    checks hold every slot, the next ones are refused at once; a check that returns frees its slot."""
    from carma.server import workdirs

    hung = threading.Event()
    stat = workdirs.problem
    monkeypatch.setattr(workdirs, "problem", lambda path: hung.wait(10) and stat(path) if "nfs" in path else stat(path))
    checks = workdirs.WorkdirChecks(timeout_s=0.2, slots=1)

    def check(path: str) -> str | None:
        return asyncio.run(checks.problem(path))

    assert check("/home/nfs/bob") == "cannot be checked (no answer within 0.2 s: a hung network file system?)"
    assert check("/tmp") == workdirs.STUCK  # the one slot is held by the stuck stat
    assert check("relative") == "is not an absolute path"  # no file system asked
    hung.set()
    wait_until(lambda: check("/tmp") is None)  # the stat returned: its slot is free
    assert check("/no/such/dir") == "does not exist"


def test_tcp_clients_are_counted_by_their_address_or_their_ipv6_64():  # type: ignore[no-untyped-def]
    """An IPv6 client holds a /64 (2^64 addresses of its own): counted by address, it had no cap at all."""
    from carma.server.auth import client_address

    assert client_address("192.0.2.7") == "192.0.2.7"
    assert client_address("::ffff:192.0.2.7") == "192.0.2.7"  # an IPv4 client on a dual-stack listener
    assert client_address("2001:db8:1:2:aaaa::1") == client_address("2001:db8:1:2::ffff") == "2001:db8:1:2::/64"
    assert client_address("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert client_address("fe80::1%eth0") == "fe80::/64"


def test_a_working_directory_check_without_a_thread_to_run_on_is_refused_and_frees_its_slot(monkeypatch):  # type: ignore[no-untyped-def]
    """At the machine's limit on processes a thread cannot start: the slot it took was never given back, so
    64 such submissions refused every later one until a restart."""
    from carma.server import workdirs

    checks = workdirs.WorkdirChecks(slots=1)

    def no_thread(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert asyncio.run(checks.problem("/tmp")) == workdirs.STUCK
    monkeypatch.undo()
    assert asyncio.run(checks.problem("/tmp")) is None


def test_long_programs_and_commands_are_cut_in_names_and_the_history(served):  # type: ignore[no-untyped-def]
    """A program's 128 KiB file name, the default task name, made each dashboard event 128 MB with 500 such
    tasks; every ended run's 2 MB command made one `/v1/history` answer gigabytes."""
    server, _ = served
    program = f"/nonexist/{'n' * 5000}"
    named = server.client.submit({"command": [program], "workdir": "/tmp"})
    assert len(named["name"]) == 200 and named["name"].endswith("…")
    long = server.client.submit({"command": ["/bin/true", "a" * 100_000, "b"], "workdir": "/tmp"})
    server.wait_state(long["id"], "completed", timeout=60)
    (run,) = [r for r in server.client.history() if r["task_id"] == long["id"]]
    assert run["command"] == ["/bin/true", "a" * 4086 + "…"]  # 4,096 characters of it
    assert server.client.task(long["id"])["command"] == ["/bin/true", "a" * 100_000, "b"]  # the task keeps it whole


def test_tasks_are_listed_by_their_ids_in_the_order_asked(served):  # type: ignore[no-untyped-def]
    """`carma wait` on many tasks lists just them at each poll: a listing of every task the server keeps
    grows with its history (100,000 ended tasks made each poll a second of the daemon's)."""
    server, port = served
    first, second = (server.client.submit({"command": ["/bin/true"], "workdir": "/tmp"})["id"] for _ in range(2))
    listed = server.client.tasks(ids=[second, first, 10**9, second])
    assert [t["id"] for t in listed] == [second, first]  # a task the server has not is left out
    assert [t["id"] for t in server.client.tasks(ids=list(range(1, first + 600)))][-2:] == [first, second]  # 2 asks
    for ids in ("1,x", "", ",".join(["1"] * 1001)):  # not ids, or more than 1,000 of them
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", f"/v1/tasks?ids={ids}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        response = conn.getresponse()
        detail = json.loads(response.read())["detail"]
        assert response.status == 422 and detail.startswith("invalid request: query.ids") and "pattern" in detail, (
            detail
        )
        conn.close()


def test_a_cancel_naming_a_task_many_times_cancels_it_once(served):  # type: ignore[no-untyped-def]
    """One running task's id 1,000 times in one `/v1/cancel` wrote its record twice per id: 5.7 s of the event
    loop (a million ids were allowed). Each id is answered once, and a task already stopping is not written."""
    server, _ = served
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    task = server.client.submit({"command": [sys.executable, "-c", stubborn], "workdir": "/tmp"})["id"]
    wait_until(lambda: server.client.task(task)["state"] in ("dispatched", "running"), 30, "the task to start")
    first = server.client.cancel_many([task] * 1000 + [10**9])
    assert [(r["id"], r.get("again"), "error" in r) for r in first] == [(task, False, False), (10**9, None, True)]
    assert first[0]["state"] in ("dispatched", "running")
    (again,) = server.client.cancel_many([task, task])
    assert again["again"] is True and again["state"] in ("dispatched", "running")
