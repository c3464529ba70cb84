"""The daemon's world in-process: submission checks, restarts after a crash, its clock."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carma.config import EstimateConfig
from carma.core import SchedulerConfig, SpecError, TargetKind, TaskState
from carma.core.blocked import RiskFiltered
from carma.core.types import NeedKind
from carma.server.auth import Caller, Tokens, primary_gid
from carma.server.daemon import Daemon, DaemonClock
from carma.server.metrics import Metrics
from carma.server.mps import MpsControl
from carma.server.paths import Paths
from carma.server.spec import JobSpec
from carma.server.store import Observation
from carma.sim.gpus import parse_gpus
from carma.telemetry.fake import FakeDevice, FakeGpuBackend, fake_env
from servers import fakejob
from support import step_until


@pytest.fixture
def home(tmp_path):
    paths = Paths(tmp_path / "home")
    paths.create()
    FakeDevice.create(paths.fake_gpus, parse_gpus("2xA100-40GB"), time_scale=10.0)
    return paths


def daemon(paths: Paths, grace_s: float = 10.0, config: SchedulerConfig | None = None) -> Daemon:
    backend = FakeGpuBackend(paths.fake_gpus)
    return Daemon(paths, backend, config or SchedulerConfig(), 10.0, fake_env(paths.fake_gpus), grace_s)


def job(*argv: str, **fields: object) -> JobSpec:
    return JobSpec(fields.pop("name", "job"), argv, fields.pop("workdir", "/tmp"), **fields)  # type: ignore[arg-type]


def scrape(d: Daemon) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(Metrics(d).render().decode())}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (job("true", gpus=3), "needs 3 GPUs but this server has 2"),
        (
            job("true", mem_mib=100 * 1024),  # the fake GPUs are A100s of 40 GiB
            r"task 'job' needs 100.00 GiB of GPU memory per GPU, more than any GPU of this server has \(40.00 GiB\)",
        ),
        (job("true", gpus=2, mem_mib=41 * 1024), r"per GPU, more than the 2 largest GPUs of this server have each"),
        (
            job("true", mem_mib=40961),
            r"needs 40961 MiB of GPU memory per GPU, more than any GPU of this server has \(40960 MiB\)",
        ),
        (job("true", workdir="relative/dir"), "is not an absolute path"),
        (job("true", workdir="/proc/version"), "'/proc/version' is not a directory"),
        (job("true", workdir="/no/such/dir"), "does not exist"),
    ],
)
def test_jobs_it_can_never_run_are_refused_and_not_stored(home, spec, message):
    d = daemon(home)
    with pytest.raises(SpecError, match=message):
        d.check(spec)  # a dry run says what the submission will
    with pytest.raises(SpecError, match=message):
        d.submit(spec)
    assert d.store.load() == [] and d.scheduler.tasks == []
    d.close()


def test_a_dry_run_of_a_job_it_can_run_keeps_nothing(home):
    d = daemon(home)
    d.check(job("true", gpus=2, mem_mib=1024))
    assert d.store.load() == [] and d.scheduler.tasks == []
    assert d.submit(job("true")).id == 1  # no id was spent on the dry run
    d.close()


def test_a_declared_need_as_large_as_a_gpu_is_taken(home):
    """Up to the GPU's memory the need stands (above it less the margin, the task gets a whole GPU)."""
    d = daemon(home)
    assert d.submit(job("true", gpus=2, mem_mib=40 * 1024)).spec.mem_mib == 40 * 1024
    d.close()


def test_a_placement_whose_process_never_started_is_placed_again(home):
    first = daemon(home)
    task = first.submit(job("true"))
    first.loop.step(place=False)  # a first telemetry reading: GPUs never sampled are never used
    launches = first.scheduler.decide(first.clock.now())  # placed and persisted...
    first.store.save(first.scheduler.take_changes())
    assert launches and first.store.load()[0].task.state is TaskState.DISPATCHED
    first.close()  # ...but the daemon died before launching it
    second = daemon(home)
    restored = second.scheduler.task(task.id)
    assert restored.state is TaskState.QUEUED and restored.attempts == []
    step_until(second, lambda: second.scheduler.task(task.id).state is TaskState.COMPLETED)
    assert len(second.scheduler.task(task.id).attempts) == 1
    second.close()


def test_a_cancel_survives_a_crash_of_the_daemon(home):
    first = daemon(home, grace_s=0.3)
    stubborn = first.submit(job("sh", "-c", "trap '' TERM; sleep 60"))
    step_until(first, lambda: first.scheduler.task(stubborn.id).state is TaskState.DISPATCHED)
    first.loop.cancel(stubborn.id)  # SIGTERM is ignored; the SIGKILL would come after the grace period...
    first.close()  # ...but the daemon dies first
    second = daemon(home, grace_s=0.3)
    step_until(second, lambda: second.scheduler.task(stubborn.id).state is TaskState.CANCELLED)
    second.close()


class Reordered(FakeGpuBackend):
    """The same fake GPUs, listed last first (a GPU moved to another slot), or without the first (`drop`)."""

    def __init__(self, root, drop: bool = False) -> None:  # type: ignore[no-untyped-def]
        super().__init__(root)
        self.drop = drop

    def gpus(self):  # type: ignore[no-untyped-def]
        first, second = super().gpus()
        return [second] if self.drop else [second, first]

    def read(self, now):  # type: ignore[no-untyped-def]
        ids = [g.id for g in self.gpus()]
        return sorted((r for r in super().read(now) if r.sample.gpu in ids), key=lambda r: ids.index(r.sample.gpu))


def test_a_restart_follows_its_tasks_gpus_by_identity_and_refuses_when_one_is_gone(home):
    first = daemon(home)
    running = first.submit(job("sleep", "60"))
    step_until(first, lambda: first.scheduler.task(running.id).state is TaskState.DISPATCHED)
    (target,) = first.scheduler.task(running.id).current.gpus
    assert first.scheduler.shown(target) == 0
    first.close()
    env = fake_env(home.fake_gpus)
    moved = Daemon(home, Reordered(home.fake_gpus), SchedulerConfig(), 10.0, env)
    assert moved.scheduler.task(running.id).current.gpus == (target,) and moved.scheduler.shown(target) == 1
    assert [s.tasks for s in moved.scheduler.gpu_status(moved.clock.now())] == [(), (running.id,)]
    moved.close()
    with pytest.raises(
        RuntimeError, match=rf"running tasks were placed on are gone .*: {target} \(task {running.id}\)"
    ):
        Daemon(home, Reordered(home.fake_gpus, drop=True), SchedulerConfig(), 10.0, env)
    last = daemon(home)
    last.loop.cancel(running.id)
    step_until(last, lambda: last.scheduler.task(running.id).state is TaskState.CANCELLED)
    last.close()


class MigBackend(FakeGpuBackend):
    """Fake GPUs whose second one is a MIG instance (an exclusive target)."""

    def gpus(self):  # type: ignore[no-untyped-def]
        whole, instance = super().gpus()
        return [
            whole,
            dataclasses.replace(
                instance, name="A100 MIG 3g.20gb", kind=TargetKind.MIG, parent=whole.id, shareable=False
            ),
        ]


def test_a_task_on_a_mig_instance_is_no_mps_client(home, tmp_path):
    """carma's one MPS control daemon sees every GPU, and a CUDA process (an MPS server too) enumerates one
    MIG instance at most: a client on an instance would wait on a server that cannot serve it."""
    mps = MpsControl(tmp_path / "state")
    d = Daemon(home, MigBackend(home.fake_gpus), SchedulerConfig(), 10.0, fake_env(home.fake_gpus), mps=mps)
    show = ("sh", "-c", "env | grep -c ^CUDA_MPS_PIPE_DIRECTORY || true")
    tasks = [d.submit(job(*show, mem_mib=4096)) for _ in range(2)]
    step_until(d, lambda: all(d.scheduler.task(t.id).state is TaskState.COMPLETED for t in tasks))
    shown = d.scheduler.shown
    seen = {
        tuple(map(shown, d.scheduler.task(t.id).attempts[0].gpus)): d.executor.log_path(t.id, 1, "stdout").read_text()
        for t in tasks
    }
    assert seen == {(0,): "1\n", (1,): "0\n"}
    d.close()


def test_an_mps_control_daemon_that_stopped_is_started_again_before_a_client_launches(home, tmp_path, monkeypatch):
    """A client finding no control daemon runs without MPS, and without its memory limit, silently."""
    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'bin'}:{os.environ['PATH']}")  # the stand-in tool
    mps = MpsControl(tmp_path / "state")
    mps.start()
    d = Daemon(home, FakeGpuBackend(home.fake_gpus), SchedulerConfig(), 10.0, fake_env(home.fake_gpus), mps=mps)
    mps.stop()  # e.g. `carma mps stop` while the server runs
    task = d.submit(job("true"))
    step_until(d, lambda: d.scheduler.task(task.id).state is TaskState.COMPLETED)
    assert mps.status().running
    d.close()
    mps.stop()


def test_what_telemetry_saw_of_a_task_outlives_a_stop_of_the_daemon(home):
    """The peak and metrics lived in memory only: a task that ended while the daemon was down had none in
    the history, and `--estimate history` then found no earlier run to go by."""
    first = daemon(home)
    task = first.submit(job(*fakejob(40, "3GiB", "--smact", "0.4"), mem_mib=4096))
    step_until(first, lambda: first.recorder.live().get(task.id, Observation(0, None, None, None)).peak_mib == 3072)
    first.close()  # a clean stop: the task runs on
    time.sleep(5)  # and ends while no daemon runs (40 s at 10x)
    second = daemon(home)
    step_until(second, lambda: second.scheduler.task(task.id).state is TaskState.COMPLETED)
    (run,) = second.store.history()
    assert run["peak_mib"] == 3072 and run["smact_mean"] is not None  # the means of the samples seen
    second.close()


def test_a_task_s_peak_outlives_a_kill_of_the_daemon_soon_after_it_is_seen(home):
    """Saved every 60 s only: a daemon killed (no stop) within that lost the peak of tasks that ended while
    it was down."""
    first = daemon(home)
    task = first.submit(job(*fakejob(100, "3GiB"), mem_mib=4096))  # 10 s at 10x
    step_until(first, lambda: first.recorder.live().get(task.id, Observation(0, None, None, None)).peak_mib == 3072)
    seen = time.monotonic()
    step_until(first, lambda: time.monotonic() - seen > 6)  # a few seconds more, then killed: no close()
    time.sleep(5)  # the task ends while no daemon runs
    second = daemon(home)
    step_until(second, lambda: second.scheduler.task(task.id).state is TaskState.COMPLETED)
    (run,) = second.store.history()
    assert run["peak_mib"] == 3072
    second.close()
    first.close()


def test_ended_tasks_past_the_retention_are_forgotten_with_their_logs_and_counted_still(home, monkeypatch):
    monkeypatch.setattr("carma.server.daemon.FORGET_EVERY_S", 1.0)
    d = Daemon(home, FakeGpuBackend(home.fake_gpus), SchedulerConfig(), 10.0, fake_env(home.fake_gpus),
               keep_ended_s=20.0)  # fmt: skip
    quick = d.submit(job("sh", "-c", "echo done; exit 3"))
    slow = d.submit(job("sleep", "30"))
    step_until(d, lambda: d.scheduler.task(quick.id).state is TaskState.FAILED)
    logs = d.executor.run_dir(quick.id, 1)
    assert logs.is_dir()
    step_until(d, lambda: quick.id not in {t.id for t in d.scheduler.tasks})  # 20 s of its clock after it ended
    assert not logs.exists() and quick.id not in d.jobs
    assert [s.task.id for s in d.store.load()] == [slow.id]  # running: kept
    assert "it ended over 0.000231481 day(s) ago and was forgotten" in d.no_task(quick.id)
    assert d.no_task(99) == "no task with id 99"
    ended = {s.labels["outcome"]: s.value for s in scrape(d)["carma_tasks_ended"] if s.name.endswith("_total")}
    assert ended["failed"] == 1.0  # a counter never goes down
    d.loop.cancel(slow.id)
    step_until(d, lambda: d.scheduler.tasks == [])
    d.close()
    again = daemon(home)  # every task forgotten: ids go on
    assert again.submit(job("true")).id == slow.id + 1
    again.close()


def test_a_task_keeps_its_submission_time_across_a_restart(home, monkeypatch):
    """The queue took a later time than the store did (after its commit), so an ended task's time changed."""
    first = daemon(home)
    add = first.store.add

    def slow_add(*args):  # type: ignore[no-untyped-def]
        task_id = add(*args)
        time.sleep(0.2)  # a commit that takes 2 s of the 10x clock
        return task_id

    monkeypatch.setattr(first.store, "add", slow_add)
    submitted = first.submit(job("sleep", "30")).submit_s
    first.close()
    second = daemon(home)
    assert second.scheduler.task(1).submit_s == submitted
    second.close()


def test_the_scaled_clock_continues_across_restarts(home):
    first = daemon(home)
    before = first.clock.now()
    first.close()
    time.sleep(0.2)
    second = daemon(home)
    assert second.clock.now() >= before + 10 * 0.2  # simulated time kept running at 10x while it was down
    second.close()


def test_clock_conversions():
    clock = DaemonClock(60.0, origin_wall=1000.0, origin=5000.0)
    assert clock.to_clock(1001.0) == 5060.0
    with pytest.raises(ValueError):
        DaemonClock(0, 0, 0)


def test_api_handlers_run_on_the_event_loop_beside_the_scheduler(home, tmp_path):
    """FastAPI runs plain-function handlers in worker threads, where they would race the scheduling loop:
    every endpoint and dependency must be a coroutine."""
    import inspect

    from fastapi.routing import APIRoute

    from carma.server.api import create_app

    d = daemon(home)
    routes = [r for r in create_app(d, Tokens(tmp_path / "tokens")).routes if isinstance(r, APIRoute)]
    assert len(routes) >= 10
    for route in routes:
        calls = [route.dependant.call, *(dep.call for dep in _dependencies(route.dependant))]
        # an object (the bearer scheme the schema names) runs on the loop when its __call__ is a coroutine
        calls = [call if inspect.isfunction(call) else call.__call__ for call in calls]
        assert all(inspect.iscoroutinefunction(call) for call in calls), route.path
    d.close()


async def _asgi_get(app, path: str, query: bytes = b"") -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    """One GET through the app as the unix socket hands it one: from this process's user."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query, "headers": [],
        "client": None, "server": None, "carma.peer": (os.getpid(), os.getuid(), os.getgid()),
    }  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_slow_history_read_holds_up_no_other_request(home, tmp_path):
    """A server's history may hold years of runs: `/v1/history` (and `/v1/series`) read on a thread of their
    own, and the loop answers meanwhile (it parsed every ended job on the loop: 100,000 runs held it 2.7 s)."""
    import asyncio
    import contextlib
    import json
    import threading

    from carma.server.api import create_app

    d = daemon(home)
    d.submit(job("true"))
    step_until(d, lambda: d.store.history())
    release, apart = threading.Event(), d.store.apart

    @contextlib.contextmanager
    def slow():  # type: ignore[no-untyped-def]
        assert release.wait(10)
        with apart() as reads:
            yield reads

    d.store.apart = slow  # type: ignore[method-assign]
    app = create_app(d, Tokens(tmp_path / "tokens"))

    async def requests() -> tuple[int, list]:
        history = asyncio.ensure_future(_asgi_get(app, "/v1/history", b"limit=5"))
        series = asyncio.ensure_future(_asgi_get(app, "/v1/series"))
        status, _ = await asyncio.wait_for(_asgi_get(app, "/v1/status"), 5)
        assert status == 200 and not history.done() and not series.done()
        third, body = await asyncio.wait_for(_asgi_get(app, "/v1/history"), 5)  # one user's: two at most
        assert third == 429 and b"2 reads of the history or series under way" in body
        release.set()
        assert (await asyncio.wait_for(series, 10))[0] == 200
        status, body = await asyncio.wait_for(history, 10)
        assert (await asyncio.wait_for(_asgi_get(app, "/v1/history"), 10))[0] == 200  # counted until done
        return status, json.loads(body)

    status, runs = asyncio.run(requests())
    assert status == 200 and [(r["name"], r["outcome"], r["gpus"]) for r in runs] == [("job", "success", [0])]
    d.close()


def test_a_long_listing_lets_the_loop_answer_others_between_its_turns(monkeypatch):
    """`carma queue --all` of 100,000 kept tasks held the event loop 1.4 s: listings are built a thousand
    items at a time, other coroutines running in between, and an item gone meanwhile is left out."""
    import asyncio

    from carma.server import apart

    monkeypatch.setattr(apart, "LISTED_AT_ONCE", 2)
    turns: list[int] = []
    gone = {3}

    async def listing() -> list[int]:
        async def other() -> None:
            while True:
                turns.append(len(turns))
                await asyncio.sleep(0)

        beside = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        listed = await apart.in_turns([1, 2, 3, 4, 5], lambda item: [] if item in gone else [item * 10])
        beside.cancel()
        return listed

    assert asyncio.run(listing()) == [10, 20, 40, 50]
    assert len(turns) >= 3  # before, and between each two of the three batches


def _dependencies(dependant):  # type: ignore[no-untyped-def]
    for dep in dependant.dependencies:
        yield dep
        yield from _dependencies(dep)


def test_tcp_connections_send_responses_without_delay():
    """asyncio sets TCP_NODELAY only on sockets created as IPPROTO_TCP; without it each keep-alive
    response waited 40 ms (Nagle and delayed ACKs)."""
    import socket

    from carma.server.serve import bind_tcp

    listener = bind_tcp("127.0.0.1:0")
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    assert accepted.proto == socket.IPPROTO_TCP
    for s in (client, accepted, listener):
        s.close()


TOKEN = "k3y-0f-sixteen-chars"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (f"{TOKEN} alice\n", "line 1: write <token> <user> <uid> [admin]"),
        (f"{TOKEN} alice 1000 root\n", "line 1: write <token> <user> <uid> [admin]"),
        ("# team\ncafé-token-0123456789 alice 1000\n", "line 2: a token is printable ASCII"),  # no client sends it
        (f"{TOKEN} alice 1000\n{TOKEN} bob 1001 admin\n", "line 2: this token is already on line 1"),  # bob's, silently
        ("alice-pw alice 1000\n", "line 1: a token of 8 characters is easy to guess; write one of at least 16"),
        (f"{TOKEN} alice 99999999999999999999\n", "line 1: a uid is at most 4294967294, not 99999999999999999999"),
    ],
)
def test_a_tokens_file_the_daemon_cannot_trust_is_refused_naming_the_line(tmp_path, lines, message):
    (tmp_path / "tokens").write_text(lines)
    (tmp_path / "tokens").chmod(0o600)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'tokens'}, {re.escape(message)}"):
        Tokens(tmp_path / "tokens")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602])
def test_a_tokens_file_other_users_may_read_or_change_is_refused(tmp_path, mode):
    """Accepted without a word: any local user could read every token, admins' included."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN} alice 1000\n")
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"^{path}: other users may read or change it \\(mode {mode:04o}\\)"):
        Tokens(path)


def test_a_tokens_file_that_is_not_a_file_of_text_is_refused_naming_it(tmp_path):
    """A directory was "other users may read or change it (mode 0755)", a Latin-1 file an error naming no file."""
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match=f"^{tmp_path / 'dir'}: not a file; the tokens file holds one <token>"):
        Tokens(tmp_path / "dir")
    path = tmp_path / "tokens"
    path.write_bytes(b"\xff" + TOKEN.encode() + b" alice 1000\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=f"^{path}: not UTF-8 text \\(byte 0"):
        Tokens(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_tokens_file_or_state_directory_of_another_user_is_refused(tmp_path):
    """A root daemon on a state directory a user owned read the tokens that user wrote: `<token> root 0 admin`,
    and their tasks ran as root."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN} root 0 admin\n")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match=f"^{path}: it belongs to uid 65534, not to the server's user"):
        Tokens(path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to the server's user"):
        Paths(theirs).create()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by all, not sticky: the state directory in it could be swapped
    with pytest.raises(PermissionError, match="the folder of the state directory, may be changed by another user"):
        Paths(shared / "home").create()


def test_a_token_naming_a_user_other_than_its_uids_account_is_said_in_the_log(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN} nobody-at-all 0\n")
    path.chmod(0o600)
    Tokens(path)
    assert "uid 0 is root on this machine: tasks submitted with this token run as root" in caplog.text


def test_a_token_made_at_the_first_start_is_a_line_of_its_own(tmp_path):
    """Appended to a last line without its end (`# tokens for carma`), it was in that comment, and each start
    made another."""
    path = tmp_path / "tokens"
    path.write_text("# tokens for carma")
    path.chmod(0o600)
    token = Tokens(path).create("ops", 0, admin=True)
    assert Tokens(path).caller(token) is not None


def test_comments_in_the_tokens_file_may_be_indented_or_follow_a_line(tmp_path):
    """An indented or trailing comment stopped the server ("write <token> <user> <uid> [admin]")."""
    path = tmp_path / "tokens"
    path.write_text(f"  # the team\n{TOKEN} alice 1000 admin  # on call\n")
    path.chmod(0o600)
    assert Tokens(path).caller(TOKEN) == Caller(1000, "alice", admin=True, gid=primary_gid(1000))


def test_a_commands_expected_duration_is_learnt_from_its_successful_runs_only(home):
    """The daemon's duration port (backfilling, the growth prediction's horizon)."""
    d = daemon(home)
    ran = [d.submit(job("true")), d.submit(job("true")), d.submit(job("false"))]
    step_until(d, lambda: all(d.scheduler.task(t.id).terminal for t in ran))
    runs = [d.scheduler.task(t.id).attempts[0] for t in ran[:2]]
    times = sorted(a.ended_s - a.dispatched_s for a in runs)
    assert d.hints.duration(d.submit(job("true"))) == pytest.approx(sum(times) / 2)  # the median of two
    assert d.hints.duration(d.submit(job("false"))) is None  # it never succeeded
    assert d.hints.duration(d.submit(job("true", workdir="/"))) is None  # another workdir: another command
    assert d.hints.duration(d.submit(job("true", duration_s=5400.0))) == 5400.0  # declared: before the history
    d.close()


def test_a_commands_expected_activity_is_learnt_from_its_runs_alone(home):
    """`warmup_risk`'s source in the daemon: the median SMACT, SMOCC and DRAMA telemetry saw while the command's
    successful runs were alone on their GPUs; a run beside another task shows the other's activity too."""
    d = daemon(home)  # two GPUs: the third task joins one of the first two once its window has passed
    command = fakejob(60, "1GiB", "--smact", "0.6", "--smocc", "0.2", "--drama", "0.3")
    ran = [d.submit(job(*command, mem_mib=2048)) for _ in range(3)]
    step_until(d, lambda: all(d.scheduler.task(t.id).terminal for t in ran), timeout=60)
    shared = [d.scheduler.task(t.id).attempts[0].shared for t in ran]
    assert shared.count(True) == 2
    alone = d.estimates.history.runs(d.jobs[ran[0].id]).alone
    assert len(alone) == 1
    seen = d.hints.activity(d.submit(job(*command)))
    assert seen == alone[0] and 0.4 < seen.smact <= 0.6  # its warm-up (no load yet) is in the means
    assert (seen.smocc, seen.drama) == (pytest.approx(seen.smact / 3), pytest.approx(seen.smact / 2))
    assert d.hints.activity(d.submit(job(*fakejob(60, "1GiB")))) is None  # never ran
    d.close()


def test_with_warmup_risk_a_command_that_saturated_its_gpu_alone_closes_it_while_it_warms_up(home):
    """Open warm-ups let a third task join a GPU whose task has not computed yet; told by the history that the
    command saturates a GPU, the risk filter keeps it out (and `carma gpus` shows those GPUs excluded)."""
    config = SchedulerConfig(ttfk_unknown_only=True, warmup_risk=True)
    d = daemon(home, config=config)
    bound = fakejob(20, "1GiB", "--smact", "1.0", "--smocc", "0.6", "--drama", "0.8")
    first = d.submit(job(*bound, mem_mib=2048))
    step_until(d, lambda: d.scheduler.task(first.id).terminal)
    warming = [d.submit(job(*bound, mem_mib=2048)) for _ in range(2)]
    later = d.submit(job(*fakejob(20, "1GiB"), mem_mib=2048))
    step_until(d, lambda: all(d.scheduler.task(t.id).current for t in warming))
    assert d.scheduler.task(later.id).current is None
    assert isinstance(d.scheduler.blocked(later.id), RiskFiltered)
    assert all(gpu.excluded for gpu in d.scheduler.gpu_status(d.clock.now()))
    d.close()


def test_pair_ranks_gpus_by_the_interference_of_the_commands_history(home):
    """The daemon's `pair`: the twin's fitted interference model over each command's GRACT, SMACT, SMOCC and
    DRAMA alone. A light task goes beside another light one, not beside a busy task whose GPU has more free
    memory (MAGM's choice); a command never run alone has no load, and pairing cannot tell its cost."""
    d = daemon(home, config=SchedulerConfig(policy="pair", ttfk_unknown_only=True))
    busy = fakejob(30, "1GiB", "--gract", "0.9", "--smact", "0.7", "--smocc", "0.3", "--drama", "0.3")
    light = fakejob(30, "6GiB", "--gract", "0.2", "--smact", "0.15", "--smocc", "0.1", "--drama", "0.1")
    for command, mib in ((busy, 2048), (light, 7168)):  # one run alone each: their loads are learnt
        ran = d.submit(job(*command, mem_mib=mib))
        step_until(d, lambda ran=ran: d.scheduler.task(ran.id).state is TaskState.COMPLETED, timeout=60)
    heavy_load = d.hints.load(d.submit(job(*busy, mem_mib=2048)))
    assert heavy_load is not None and 0.5 < heavy_load.gract <= 0.9  # its start-up is in the means
    assert d.hints.load(d.submit(job(*light, mem_mib=7168))).gract <= 0.2
    step_until(d, lambda: all(d.scheduler.task(i).current for i in (3, 4)))
    third = d.submit(job(*light, mem_mib=7168))
    step_until(d, lambda: d.scheduler.task(third.id).current)
    light_gpu = d.scheduler.task(4).current.gpus
    assert d.scheduler.task(3).current.gpus != light_gpu and d.scheduler.task(third.id).current.gpus == light_gpu
    assert d.hints.load(d.submit(job(*fakejob(30, "1GiB"), mem_mib=2048))) is None  # never ran
    d.close()


def test_a_task_given_no_need_is_placed_with_its_commands_history_by_default(home):
    """Recovery only is the fallback for a command never run before, not the default ([estimate] default)."""
    d = daemon(home)
    first = d.submit(job(*fakejob(5, "3GiB")))
    step_until(d, lambda: d.scheduler.task(first.id).state is TaskState.COMPLETED)
    assert d.scheduler.task(first.id).attempts[0].need.kind is NeedKind.UNKNOWN  # no earlier run
    again = d.submit(job(*fakejob(5, "3GiB")))
    step_until(d, lambda: d.scheduler.task(again.id).attempts)
    need = d.scheduler.task(again.id).attempts[0].need
    assert (need.kind, need.source) == (NeedKind.KNOWN, "history") and need.mib >= 3072
    d.close()
    off = Daemon(home, FakeGpuBackend(home.fake_gpus), SchedulerConfig(), 10.0, fake_env(home.fake_gpus),
                 estimate=EstimateConfig(default="none"))  # fmt: skip
    assert off.submit(job(*fakejob(5, "3GiB"))).spec.mem_mib is None and off.jobs[3].estimator is None
    off.close()


def test_what_a_tasks_output_says_is_its_owners_not_every_users(home):
    """The queue is everyone's, but a failed task's reason and an attempt's message are its log's last lines:
    another user sees that there is one, not what it says (nor a failed estimate's last error line)."""
    import json

    from carma.server.views import OWNERS_ONLY, as_seen_by_others, task_summary, task_view

    d = daemon(home)
    task = d.submit(job("/bin/sh", "-c", "echo password=$SECRET >&2; exit 3", mem_mib=1024, env={"SECRET": "hunter2"}))
    step_until(d, lambda: d.scheduler.task(task.id).terminal)
    mine = task_view(d, d.scheduler.task(task.id))
    assert "hunter2" in mine["reason"]
    theirs = as_seen_by_others(mine)
    assert theirs["reason"] == OWNERS_ONLY and "hunter2" not in json.dumps(theirs)
    assert theirs["env"] is None and theirs["state"] == mine["state"] == "failed"
    assert "hunter2" not in json.dumps(as_seen_by_others(task_summary(d, d.scheduler.task(task.id))))
    failed = {**mine, "need_source": "xmem failed: KeyError: 'hunter2'"}
    assert as_seen_by_others(failed)["need_source"] == "xmem failed"
    d.close()


def test_a_user_without_a_daemon_of_their_own_reaches_the_systems(tmp_path, monkeypatch):
    """With the systemd service (root's daemon in /var/lib/carma), `carma submit` as a user looked in their own
    state dir and said to start a server there: a second one, on the same GPUs."""
    from carma.server import paths as paths_module

    system = tmp_path / "system"
    system.mkdir()
    monkeypatch.setattr(paths_module, "SYSTEM_HOME", system)
    monkeypatch.delenv("CARMA_HOME", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    own = tmp_path / "xdg" / "carma" / "carma.sock"
    assert paths_module.server_socket() == own  # no daemon anywhere: the user's own, as `carma server` makes it
    (system / "carma.sock").touch()
    assert paths_module.server_socket() == system / "carma.sock"
    own.parent.mkdir(parents=True)
    assert paths_module.server_socket() == own  # a server of their own ran here (stopped now): not the system's
    monkeypatch.setenv("CARMA_HOME", str(tmp_path / "elsewhere"))
    assert paths_module.server_socket() == tmp_path / "elsewhere" / "carma.sock"


def test_an_ended_tasks_environment_is_kept_in_the_store_not_in_memory(home):
    """A user's loop of submissions of 2 MB environments, each cancelled, grew the daemon's memory 2 MB a
    task (the caps count tasks not ended): an ended task's environment is read from the store for its view."""
    from carma.server.views import task_view

    d = daemon(home)
    d.draining = True  # kept waiting until cancelled
    env = {"HIDDEN": "x" * 100_000}
    queued, done = d.submit(job("sleep", "30", env=env)), d.submit(job("true", env=env))
    d.draining = False
    assert d.jobs[queued.id].env == env  # a task not ended keeps its own: it is yet to run
    d.cancel(queued.id)
    step_until(d, lambda: d.scheduler.task(done.id).state is TaskState.COMPLETED)
    for task_id in (queued.id, done.id):
        assert d.jobs[task_id].env == {}
        assert task_view(d, d.scheduler.task(task_id))["env"] == env  # its owner still sees what it was given
    d.close()
    again = daemon(home)
    assert again.jobs[done.id].env == {} and task_view(again, again.scheduler.task(done.id))["env"] == env
    again.close()
