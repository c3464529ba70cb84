"""The daemon's state under faults: a missing, emptied or damaged database, ids never handed out twice, a full
disk and no file descriptors left; the daemon says what is wrong in one line, or keeps answering."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from carma.core import Scheduler, SchedulerConfig, SchedulingLoop, TaskSpec, TaskState
from carma.core.loop import JournalError
from carma.server.daemon import Daemon
from carma.server.faults import FaultLog, StoreUnavailable
from carma.server.paths import Paths
from carma.server.spec import JobSpec
from carma.server.state import make_backup, open_store
from carma.server.store import Store, StoreError
from carma.sim.gpus import parse_gpus
from carma.telemetry.fake import FakeDevice, FakeGpuBackend, fake_env
from servers import fakejob, free_port
from support import cli_env, run_carma, wait_until
from test_core_loop import World

FULL = sqlite3.OperationalError("database or disk is full")
JOB = JobSpec("job", ("true",), "/tmp")
GPUS = ("--fake-gpus", "1xA100-40GB", "--time-scale", "10")


# --------------------------------------------------------------------------------------------- the store


def damage(path: Path, how: str) -> None:
    """Damage the database at `path` as a crash, a bad disk or a stray command would."""
    size = path.stat().st_size
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(size // 2 + 100)
    elif how == "garbage header":
        with open(path, "r+b") as f:
            f.write(b"this is not SQLite!" * 5)
    elif how == "random pages":
        with open(path, "r+b") as f:
            for page in range(1, size // 4096):
                f.seek(page * 4096)
                f.write(os.urandom(4096))
    elif how == "a directory":
        path.unlink()
        path.mkdir()
    elif how == "not readable":
        path.chmod(0)
    for extra in ("-wal", "-shm"):
        path.with_name(path.name + extra).unlink(missing_ok=True)


DAMAGES = ["truncated", "garbage header", "random pages", "a directory", "not readable"]


def filled(paths: Paths, tasks: int = 30) -> None:
    """A store with tasks, checkpointed into the database file (its WAL gone), and their run dirs."""
    paths.create()
    store = open_store(paths)
    for _ in range(tasks):
        task_id = store.add(JobSpec("job", ("echo", "x" * 500), "/tmp"), 0.0)
        (paths.tasks / str(task_id) / "1").mkdir(parents=True)
    store.close()


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home")


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_database_is_one_line_naming_it_and_the_recovery(paths, how):
    filled(paths)
    make_backup(paths.database, paths.home / "carma.db.backup")
    damage(paths.database, how)
    if how == "not readable" and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    with pytest.raises(StoreError) as caught:
        open_store(paths)
    line = str(caught.value)
    assert "\n" not in line and str(paths.database) in line
    assert f"cp {paths.home}/carma.db.backup {paths.database}" in line or "cannot open" in line


def test_an_emptied_or_missing_database_beside_run_dirs_is_refused(paths):
    filled(paths)
    paths.database.write_bytes(b"")
    with pytest.raises(StoreError, match=r"carma.db is empty, but .* holds earlier state \(the run dirs under"):
        open_store(paths)
    paths.database.unlink()
    shutil.rmtree(paths.tasks)  # the ids file alone still says tasks were taken
    with pytest.raises(StoreError, match=r"carma.db is missing, but .*next-task-id, which says task ids were"):
        open_store(paths)


def test_a_new_state_dir_with_tokens_and_a_lock_starts_empty(paths):
    paths.create()
    paths.tokens.write_text("")
    paths.lock.write_text("")
    assert open_store(paths).next_id == 1


def test_ids_are_never_handed_out_twice_even_with_the_database_replaced(paths):
    filled(paths, tasks=3)
    make_backup(paths.database, paths.home / "old.db")
    store = open_store(paths)
    store.add(JOB, 0.0)  # task 4: no run dir yet
    store.close()
    shutil.copy(paths.home / "old.db", paths.database)  # restored from a backup of 3 tasks
    assert open_store(paths).add(JOB, 0.0) == 5
    paths.ids.unlink()  # and without the ids file, the run dirs still count
    (paths.tasks / "9").mkdir()
    assert open_store(paths).add(JOB, 0.0) == 10


def test_a_backup_is_a_sound_copy_kept_only_when_whole(paths):
    filled(paths, tasks=2)
    backup = paths.home / "carma.db.backup"
    make_backup(paths.database, backup)
    assert len(Store(backup).load()) == 2 and backup.stat().st_mode & 0o077 == 0
    damage(paths.database, "random pages")
    with pytest.raises((StoreError, sqlite3.DatabaseError)):
        make_backup(paths.database, backup)
    assert len(Store(backup).load()) == 2  # the good one is kept
    assert not (paths.home / "carma.db.backup.tmp").exists()


def test_a_save_that_failed_writes_its_events_when_retried(tmp_path):
    store = Store(tmp_path / "carma.db")
    store.add(JOB, 0.0)
    task = store.load()[0].task
    task.state = TaskState.CANCELLED
    with fail_writes(store), pytest.raises(sqlite3.OperationalError):
        store.save([task])
    store.save([task])
    states = [row[0] for row in store._db.execute("SELECT state FROM events ORDER BY id")]
    assert states == ["queued", "cancelled"]


@contextlib.contextmanager
def fail_writes(store: Store) -> Iterator[None]:
    """The store's writes fail as on a full disk (reads work)."""

    @contextlib.contextmanager
    def full() -> Iterator[None]:
        raise FULL
        yield

    store._transaction = full  # type: ignore[method-assign]
    try:
        yield
    finally:
        del store._transaction


# --------------------------------------------------------------------------------------------- the loop


class FailingJournal(World):
    def __init__(self) -> None:
        super().__init__()
        self.failing = True

    def save(self, tasks) -> None:  # type: ignore[no-untyped-def]
        if self.failing:
            raise JournalError("database or disk is full")
        super().save(tasks)


def test_the_loop_launches_nothing_unwritten_and_catches_up_when_the_journal_can_write():
    world = FailingJournal()
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world, journal=world)
    task = loop.submit(TaskSpec("job"))  # the world recorded the submission itself
    assert loop.step() == [] and loop.step() == [] and world.log == []
    assert loop.behind and task.state is TaskState.QUEUED  # nothing is placed while the journal is behind
    with pytest.raises(JournalError):
        loop.cancel(task.id)  # refused, and nothing changed
    assert not task.cancel_requested
    world.failing = False
    assert [launch.task_id for launch in loop.step()] == [1]
    assert world.log == [("save", ((1, "queued"),)), ("save", ((1, "dispatched"),)), ("launch", 1)]
    assert not loop.behind


def test_a_placement_whose_write_failed_is_launched_once_it_is_written():
    world = FailingJournal()
    world.failing = False
    loop = SchedulingLoop(Scheduler(world.gpus()), world, world, world, journal=world)
    loop.submit(TaskSpec("job"))
    world.failing = True
    assert loop.step() == []  # decided, not written: not launched
    world.failing = False
    assert [launch.task_id for launch in loop.step()] == [1]
    assert world.log[-2:] == [("save", ((1, "dispatched"),)), ("launch", 1)]


def test_a_lasting_fault_is_reported_once_then_rarely_then_when_it_clears(caplog):
    now = [0.0]
    faults = FaultLog(logging.getLogger("test.faults"), repeat_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.faults"):
        for _ in range(100):
            now[0] += 1
            with faults.guard("saving"):
                raise OSError(28, "No space left on device")
        with faults.guard("saving"):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "saving failed: No space left on device (retrying)"
    assert lines[1].startswith("saving still fails: No space left on device (60 times in 60 s)")
    assert lines[-1].startswith("saving works again, after 99 s")
    assert len(lines) == 3
    with pytest.raises(ZeroDivisionError), faults.guard("saving"):  # a bug is no fault of the world
        raise ZeroDivisionError


# --------------------------------------------------------------------------------------------- the daemon


@pytest.fixture
def home(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "home")
    paths.create()
    FakeDevice.create(paths.fake_gpus, parse_gpus("1xA100-40GB"), time_scale=10.0)
    return paths


def daemon(paths: Paths) -> Daemon:
    return Daemon(paths, FakeGpuBackend(paths.fake_gpus), SchedulerConfig(), 10.0, fake_env(paths.fake_gpus))


def test_a_full_disk_refuses_submissions_with_507_while_accepted_tasks_run_and_end(home):
    d = daemon(home)
    task = d.submit(JobSpec("job", tuple(fakejob(2, "1GiB")), str(home.home)))
    with fail_writes(d.store):
        with pytest.raises(StoreUnavailable) as refused:
            d.submit(JOB)
        assert refused.value.status_code == 507
        assert refused.value.detail.startswith(f"no space left under {home.home}: database or disk is full")
        wait_steps(d, lambda: task.state is TaskState.DISPATCHED)  # placed: its placement waits for the journal
        assert d.loop.behind and d.executor.shim_pids() == {}
    wait_steps(d, lambda: task.terminal, timeout=60)  # space came back: launched, ended
    assert task.state is TaskState.COMPLETED, task.reason
    assert d.submit(JOB).id == 2
    d.close()
    again = daemon(home)
    assert [t.state for t in again.scheduler.tasks] == [TaskState.COMPLETED, TaskState.QUEUED]
    again.close()


def wait_steps(d: Daemon, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    def stepped() -> bool:
        d.step()
        return predicate()

    wait_until(stepped, timeout, "the daemon's steps")


def test_a_waiting_task_whose_next_run_dir_exists_fails_rather_than_meet_it(home):
    d = daemon(home)
    task_id = d.submit(JOB).id
    d.close()
    (home.tasks / str(task_id) / "1").mkdir(parents=True)  # as after a restore of an older database
    again = daemon(home)
    task = again.scheduler.task(task_id)
    assert task.state is TaskState.FAILED and "restored from an older backup" in task.reason
    again.close()


# --------------------------------------------------------------------------------------------- end to end


def server_line(home: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`carma server` on `home`, expected to refuse to start."""
    return run_carma("server", *options, env=cli_env(CARMA_HOME=str(home)))


@pytest.fixture
def ran(start_server) -> Paths:  # type: ignore[no-untyped-def]
    """A state dir where a server ran a task, and stopped."""
    server = start_server(*GPUS)
    server.submit(*fakejob(0, "1GiB"))
    wait_until(lambda: all(t["state"] == "completed" for t in server.json("queue", "--all")), 60, "the tasks")
    wait_until((server.home / "carma.db.backup").exists, 10, "the backup")
    server.stop()
    return Paths(server.home)


@pytest.mark.parametrize("how", ["emptied", "removed"])
def test_a_server_does_not_start_on_an_emptied_or_missing_database_beside_its_tasks(ran, how):
    ran.database.write_bytes(b"") if how == "emptied" else ran.database.unlink()
    result = server_line(ran.home, *GPUS)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {ran.database} is {'empty' if how == 'emptied' else 'missing'}, but")
    assert f"cp {ran.home}/carma.db.backup {ran.database}" in line


@pytest.mark.parametrize("how", DAMAGES)
def test_a_server_on_a_damaged_database_says_so_in_one_line_and_check_agrees(ran, how):
    assert run_carma("server", "--check", env=cli_env(CARMA_HOME=str(ran.home))).returncode == 0
    damage(ran.database, how)
    if how == "not readable" and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000")
    for result in (server_line(ran.home, *GPUS), server_line(ran.home, "--check")):
        assert "Traceback" not in result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"error: {ran.database}") and "carma.db.backup" in line
    assert result.returncode == 1  # --check's: the state is unsound
    shutil.rmtree(ran.database) if how == "a directory" else ran.database.unlink()
    shutil.copy(ran.home / "carma.db.backup", ran.database)  # the recovery the line gives
    check = server_line(ran.home, "--check")
    assert check.returncode == 0 and check.stdout.startswith(f"ok: {ran.database}: ")


def test_ids_are_not_reused_after_the_database_is_replaced(ran, start_server):
    ran.database.unlink()
    Store(ran.database).close()  # a sound database of no tasks: an older backup, another server's
    server = start_server(*GPUS, home=ran.home)
    task_id = server.submit(*fakejob(0, "1GiB"))
    assert task_id == 2
    server.wait_state(task_id, "completed")


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 6 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="cfull", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        (where / "h").mkdir()
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill(directory: Path) -> Path:
    """Take every free byte under `directory`; the file returned gives them back when removed."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 512):  # then the last partial block
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_refuses_submissions_and_the_daemon_recovers_by_itself(small_disk, start_server):
    server = start_server(*GPUS, home=small_disk / "h")
    started = Path(tempfile.mkdtemp()) / "started"  # off the small disk
    script = f"touch {started}; sleep 3"  # no output: its log is on the full disk too
    running = server.client.submit({"command": ["/bin/sh", "-c", script], "workdir": "/"})["id"]
    wait_until(started.exists, 30, "the task to start")
    filler = fill(small_disk)
    refused = server.cli("submit", "--", "true")
    assert refused.returncode != 0 and "no space left under" in refused.stderr, refused.stderr
    # the accepted task ended meanwhile, and the daemon took its end in from the shim's exit status (its exit
    # record could not be written)
    assert (t := server.wait_state(running, "completed", "failed", timeout=30))["state"] == "completed", t["reason"]
    started.unlink()
    filler.unlink()
    wait_until(lambda: server.cli("submit", "--", "true").returncode == 0, 30, "a submission after space returned")
    acknowledged = [t["id"] for t in server.json("queue", "--all")]
    server.stop()
    server.start()
    assert [t["id"] for t in server.json("queue", "--all")] == acknowledged
    assert server.proc.poll() is None


def test_a_restart_on_a_full_disk_says_so_in_one_line(small_disk, start_server):
    server = start_server(*GPUS, home=small_disk / "h")
    server.submit("true")
    server.stop()
    filler = fill(small_disk)
    result = server_line(server.home, *GPUS)
    filler.unlink()
    assert "Traceback" not in result.stderr and "listening" not in result.stdout
    assert result.returncode == 2 and result.stderr.startswith("error: no space left under"), result.stderr


def test_a_daemon_out_of_file_descriptors_keeps_scheduling_and_answering(start_server):
    port = free_port()
    launcher = ("sh", "-c", 'ulimit -n 64 && exec "$@"', "carma")
    server = start_server(*GPUS, "--tcp", f"127.0.0.1:{port}", launcher=launcher)
    task_id = server.submit(*fakejob(3, "1GiB"))
    with contextlib.ExitStack() as stack:
        for _ in range(80):  # more than the daemon's descriptors
            stack.enter_context(socket.create_connection(("127.0.0.1", port)))
        server.wait_state(task_id, "completed", timeout=60)
    assert server.proc.poll() is None
    assert server.submit(*fakejob(0, "1GiB")) == task_id + 1


def test_a_scheduling_step_out_of_descriptors_is_reported_and_retried(home, caplog):
    d = daemon(home)
    task = d.submit(JobSpec("job", tuple(fakejob(2, "1GiB")), str(home.home)))
    wait_steps(d, lambda: task.state is TaskState.RUNNING)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    taken = []
    try:
        with contextlib.suppress(OSError):
            while True:
                taken.append(os.open("/dev/null", os.O_RDONLY))
        for _ in range(5):
            d.step()  # raises nothing
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    failed = [r.getMessage() for r in caplog.records if "Too many open files" in r.getMessage()]
    assert len(failed) == 1 and failed[0].endswith("Too many open files (retrying)")  # once, not every step
    wait_steps(d, lambda: task.terminal, timeout=60)
    assert task.state is TaskState.COMPLETED
    d.close()


# ----------------------------------------------------------------------------- the executor under faults of the machine


def _executor(home: Path, argv: tuple[str, ...]):  # type: ignore[no-untyped-def]
    from carma.server.executor import ProcessExecutor

    jobs = {1: JobSpec("job", argv, workdir=str(home))}
    return ProcessExecutor(home, jobs.__getitem__)


def _launch(executor) -> None:  # type: ignore[no-untyped-def]
    from carma.core.types import Launch, Task

    executor.launch(Task(1, TaskSpec("job", 1), 0.0), Launch(1, 1, ("GPU-0",), exclusive=False))


def test_a_launch_the_machine_refuses_for_a_while_starts_once_it_can(tmp_path, monkeypatch):
    executor = _executor(tmp_path, ("/bin/sh", "-c", "echo ran"))
    spawn, refusals = executor._spawn, [OSError(errno.EMFILE, "Too many open files")] * 2

    def refusing(*args):  # type: ignore[no-untyped-def]
        if refusals:
            raise refusals.pop()
        return spawn(*args)

    monkeypatch.setattr(executor, "_spawn", refusing)
    _launch(executor)
    assert executor.poll_exits() == [] and not refusals  # tried again at this poll, refused once more
    (ended,) = wait_until(executor.poll_exits, 20, "the exit")
    assert ended.exit.exit_code == 0 and (tmp_path / "tasks/1/1/stdout.log").read_text() == "ran\n"


def test_a_launch_waiting_for_the_machine_is_cancelled_without_ever_starting(tmp_path, monkeypatch):
    executor = _executor(tmp_path, ("/bin/sh", "-c", "echo ran"))
    monkeypatch.setattr(executor, "_spawn", lambda *args: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    _launch(executor)
    executor.kill(1)
    monkeypatch.undo()
    (ended,) = executor.poll_exits()
    assert ended.exit.signal == signal.SIGTERM and executor.poll_exits() == []
    assert (tmp_path / "tasks/1/1/stdout.log").read_text() == ""


def test_an_exit_record_unreadable_for_want_of_descriptors_is_read_at_a_later_poll(tmp_path, monkeypatch):
    import carma.server.shim as shim

    executor = _executor(tmp_path, ("/bin/sh", "-c", "exit 7"))
    _launch(executor)
    wait_until(lambda: (tmp_path / "tasks/1/1/exit.json").exists(), 20, "the exit record")
    opened = shim.open_for_reading
    monkeypatch.setattr(shim, "open_for_reading", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EMFILE, "")))
    assert executor.poll_exits() == []  # not misread as an exit without a record
    monkeypatch.setattr(shim, "open_for_reading", opened)
    (ended,) = wait_until(executor.poll_exits, 20, "the exit")
    assert ended.exit.exit_code == 7
