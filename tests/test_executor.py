"""The daemon's process executor with real processes: launching, logs, exits, cancels, restarts (Linux)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from carma.core import ExitKind, Launch, Task, TaskSpec
from carma.core.ports import TaskExit
from carma.core.recovery import classify_exit
from carma.server import proctree
from carma.server.executor import (
    LOG_TAIL_BYTES,
    ProcessExecutor,
    SpawnRecord,
    Stream,
    closed_to_others,
    first_closed,
)
from carma.server.shim import read_json
from carma.server.spec import JobSpec
from carma.server.trash import Trash
from support import NOBODY, nobody_can_run_carma, wait_until

PY = sys.executable
OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."

WAIT_FOR_TERM = """
import os, signal, sys, time
def bye(*_):
    os.write(1, b"bye\\n")  # not print: the signal may land inside print("ready"), which holds stdout's lock
    sys.exit(7)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(60)
"""
IGNORE_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""
SPAWN_GRANDCHILD = f"""
import subprocess, sys, time
grandchild = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
if sys.argv[1] == "stay":
    time.sleep(60)
"""


def py(code: str, *args: str) -> tuple[str, ...]:
    return (PY, "-c", code, *args)


def wait_for_exits(executor: ProcessExecutor, n: int, timeout: float = 10.0) -> list[TaskExit]:
    """Poll until `n` exits came (or more: a duplicate must show), failing at the deadline."""
    exits: list[TaskExit] = []
    deadline = time.monotonic() + timeout
    while len(exits) < n:
        assert time.monotonic() < deadline, f"timed out with {len(exits)} of {n} exits: {exits}"
        exits += executor.poll_exits()
        time.sleep(0.01)
    return exits + list(executor.poll_exits())


class World:
    """A daemon's view: its job specs, a home, the spawn records it persisted, and its executor."""

    def __init__(self, home: Path, **options: Any) -> None:
        self.home = home
        self.jobs: dict[int, JobSpec] = {}
        self.spawned: list[SpawnRecord] = []
        self.executor = self.restart(**options)

    def restart(self, **options: Any) -> ProcessExecutor:
        """A fresh executor over the same home, as after a daemon restart."""
        return ProcessExecutor(self.home, self.jobs.__getitem__, on_spawn=self.spawned.append, **options)

    def start(self, argv: tuple[str, ...], gpus: tuple[str, ...] = ("GPU-aaaa",), attempt: int = 1, **job: Any) -> int:
        task_id = len(self.jobs) + 1
        job.setdefault("workdir", str(self.home))
        self.jobs[task_id] = JobSpec(f"job{task_id}", argv, gpus=len(gpus), **job)
        task = Task(task_id, TaskSpec(f"job{task_id}", len(gpus)), 0.0)
        self.executor.launch(task, Launch(task_id, attempt, gpus, exclusive=False))
        return task_id

    def log(self, task_id: int, stream: Stream = "stdout", attempt: int = 1) -> str:
        return self.executor.log_path(task_id, attempt, stream).read_text()

    def record(self, task_id: int) -> SpawnRecord:
        return next(r for r in self.spawned if r.task_id == task_id)

    def kill_leftovers(self) -> None:
        for record in self.spawned:
            if proctree.group_members(record.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)


@pytest.fixture
def make_world(tmp_path: Path) -> Iterator[Callable[..., World]]:
    """Worlds with executor options, whose processes are all killed after the test, passed or not."""
    made: list[World] = []

    def make(home: Path = tmp_path, **options: Any) -> World:
        made.append(World(home, **options))
        return made[-1]

    yield make
    for w in made:
        w.kill_leftovers()


@pytest.fixture
def world(make_world: Callable[..., World]) -> World:
    return make_world()


def one_exit(world: World) -> TaskExit:
    (ended,) = wait_for_exits(world.executor, 1)
    return ended


# --- running ----------------------------------------------------------------------------------------


def test_argv_is_passed_literally_without_a_shell(world):
    args = ("two words", "'quoted'", '"double"', "$HOME", "*", "a;b|c")
    task = world.start(py("import json, sys; print(json.dumps(sys.argv[1:]))", *args))
    assert one_exit(world).exit.exit_code == 0
    assert json.loads(world.log(task)) == list(args)


def test_shell_jobs_run_through_sh(world):
    task = world.start(("echo $((40 + 2)) | tr 4 X", "&& echo", "$CARMA_TASK_ID"), shell=True)
    assert one_exit(world).exit.exit_code == 0
    assert world.log(task).split() == ["X2", "1"]


def test_workdir_environment_and_gpus(make_world, tmp_path):
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    w = make_world(tmp_path / "home", extra_env={"SHARED": "daemon", "FAKE_GPU": "1"})
    code = "import json, os; print(json.dumps({'cwd': os.getcwd(), **os.environ}))"
    task = w.start(
        py(code), gpus=("GPU-cccc", "GPU-aaaa"), attempt=3, workdir=str(workdir), env={"JOB": "x y", "SHARED": "job"}
    )
    assert one_exit(w).exit.exit_code == 0
    seen = json.loads(w.log(task, attempt=3))
    assert seen["cwd"] == str(workdir)
    assert seen["JOB"] == "x y"
    assert seen["SHARED"] == "daemon"  # the daemon's additions win over the job's
    assert seen["FAKE_GPU"] == "1"
    assert seen["CUDA_VISIBLE_DEVICES"] == "GPU-cccc,GPU-aaaa"
    assert (seen["CARMA_TASK_ID"], seen["CARMA_ATTEMPT"]) == (str(task), "3")
    assert "HOME" not in seen  # only the job's environment, not the daemon's


def test_the_task_gets_exactly_its_environment_with_pwd_its_workdir(make_world, tmp_path):
    """The shim's interpreter, started in the C locale, added LC_CTYPE=C.UTF-8 (PEP 538) to what `--clean-env`
    documents as only the given variables; PWD was the submitter's directory, not the task's workdir."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    w = make_world(tmp_path / "home")
    given = {"JOB": "1", "PWD": "/where/it/was/submitted"}
    before = time.time()
    plain = w.start(("/usr/bin/env",), workdir=str(workdir), env=given)
    kept = w.start(("/usr/bin/env",), workdir=str(workdir), env={**given, "LC_CTYPE": "C.UTF-8"})
    assert [ended.exit.exit_code for ended in wait_for_exits(w.executor, 2)] == [0, 0]
    seen = dict(line.split("=", 1) for line in w.log(plain).splitlines())
    assert seen == {"JOB": "1", "PWD": str(workdir), "CARMA_TASK_ID": str(plain), "CARMA_ATTEMPT": "1",
                    "CARMA_LAUNCHED_AT": seen["CARMA_LAUNCHED_AT"],
                    "CUDA_VISIBLE_DEVICES": seen["CUDA_VISIBLE_DEVICES"]}  # fmt: skip
    assert before - 0.001 <= float(seen["CARMA_LAUNCHED_AT"]) <= time.time()
    assert dict(line.split("=", 1) for line in w.log(kept).splitlines())["LC_CTYPE"] == "C.UTF-8"


def test_stdout_and_stderr_go_to_their_logs(world):
    task = world.start(py("import sys; print('to out'); print('to err', file=sys.stderr)"))
    one_exit(world)
    assert world.log(task, "stdout") == "to out\n"
    assert world.log(task, "stderr") == "to err\n"
    assert world.executor.log_path(task, 1, "stdout") == world.home / "tasks" / str(task) / "1" / "stdout.log"


@pytest.mark.parametrize(
    ("code", "exit_code", "sig"),
    [
        ("pass", 0, None),
        ("import sys; sys.exit(3)", 3, None),
        ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", None, signal.SIGUSR1),
    ],
)
def test_exit_codes_and_signals(world, code, exit_code, sig):
    world.start(py(code))
    ended = one_exit(world)
    assert (ended.exit.exit_code, ended.exit.signal) == (exit_code, sig)


def test_the_log_tail_carries_an_oom_to_the_classifier(world):
    noise = "for i in range(3000): print('step', i, 'loss 0.1', file=sys.stderr)"
    world.start(py(f"import sys\n{noise}\nprint({OOM_LINE!r}, file=sys.stderr)\nsys.exit(1)"))
    ended = one_exit(world)
    assert len(ended.exit.log_tail.encode()) <= LOG_TAIL_BYTES
    assert ended.exit.log_tail.endswith(OOM_LINE + "\n")
    assert classify_exit(ended.exit) is ExitKind.OOM


def test_the_log_tail_falls_back_to_stdout_when_stderr_is_empty(world):
    world.start(py(f"print({OOM_LINE!r}); raise SystemExit(1)"))
    assert classify_exit(one_exit(world).exit) is ExitKind.OOM


def test_ended_s_is_on_the_schedulers_clock(make_world):
    w = make_world(to_clock=lambda wall: wall - 1000.0)
    w.start(py("pass"))
    before = time.time()
    ended = one_exit(w)
    assert before - 1000.0 - 5 < ended.ended_s <= time.time() - 1000.0


# --- failing to start -------------------------------------------------------------------------------


def test_a_missing_executable_is_an_exit_127(world):
    task = world.start(("/no/such/program", "arg"))
    ended = one_exit(world)
    assert ended.exit.exit_code == 127
    assert "cannot run '/no/such/program': No such file or directory" in ended.exit.log_tail
    assert "No such file" in world.log(task, "stderr")


def test_a_command_not_on_path_is_an_exit_127(world):
    world.start(("carma-no-such-command",), env={"PATH": "/usr/bin:/bin"})
    assert one_exit(world).exit.exit_code == 127


def test_a_file_that_is_not_executable_is_an_exit_126(world, tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    world.start((str(script),))
    ended = one_exit(world)
    assert ended.exit.exit_code == 126
    assert "Permission denied" in ended.exit.log_tail


def test_a_directory_given_as_the_program_is_named_as_one(world, tmp_path):
    """Linux refuses to execute a directory with EACCES: "Permission denied" would send the user to chmod."""
    (tmp_path / "tools").mkdir()
    world.start(("./tools/",), workdir=str(tmp_path))
    ended = one_exit(world)
    assert ended.exit.exit_code == 126
    assert "cannot run './tools/': it is a directory" in ended.exit.log_tail


def test_a_missing_workdir_is_reported_as_an_exit_not_raised(world, tmp_path):
    missing = str(tmp_path / "gone")
    task = world.start(py("pass"), workdir=missing)
    ended = one_exit(world)
    assert ended.task_id == task
    assert ended.exit.exit_code == 126
    assert (
        ended.exit.log_tail.strip()
        == f"carma: cannot enter the working directory {missing!r}: No such file or directory"
    )
    assert classify_exit(ended.exit) is ExitKind.ERROR
    assert missing in world.log(task, "stderr")


# --- cancelling -------------------------------------------------------------------------------------


def test_kill_sends_sigterm_to_a_task_that_traps_it(world):
    task = world.start(py(WAIT_FOR_TERM))
    wait_until(lambda: "ready" in world.log(task))
    world.executor.kill(task)
    ended = one_exit(world)
    assert (ended.exit.exit_code, ended.exit.signal) == (7, None)
    assert world.log(task) == "ready\nbye\n"


def test_kill_escalates_to_sigkill_after_the_grace_period(make_world):
    w = make_world(grace_s=0.5)
    task = w.start(py(IGNORE_TERM))
    wait_until(lambda: "ready" in w.log(task))
    asked = time.monotonic()
    w.executor.kill(task)
    ended = one_exit(w)
    assert time.monotonic() - asked >= 0.5
    assert (ended.exit.exit_code, ended.exit.signal) == (None, signal.SIGKILL)


def test_kill_takes_the_whole_process_group(world):
    task = world.start(py(SPAWN_GRANDCHILD, "stay"))
    wait_until(lambda: world.log(task).strip())
    grandchild = int(world.log(task))
    ticks = proctree.start_ticks(grandchild)
    world.executor.kill(task)
    assert one_exit(world).exit.signal == signal.SIGTERM
    wait_until(lambda: not proctree.alive(grandchild, ticks))


def test_what_a_task_leaves_behind_is_ended_with_it(world):
    task = world.start(py(SPAWN_GRANDCHILD, "leave"))
    assert one_exit(world).exit.exit_code == 0
    grandchild = int(world.log(task))
    wait_until(lambda: not proctree.alive(grandchild, proctree.start_ticks(grandchild)))


def test_kill_is_idempotent_and_harmless_once_gone(world):
    task = world.start(py(WAIT_FOR_TERM))
    wait_until(lambda: "ready" in world.log(task))
    world.executor.kill(task)
    world.executor.kill(task)
    assert [e.task_id for e in wait_for_exits(world.executor, 1)] == [task]
    world.executor.kill(task)  # already reported
    world.executor.kill(999)  # never launched
    assert world.executor.poll_exits() == []


def test_each_exit_is_reported_exactly_once(world):
    tasks = [world.start(py(f"import sys; sys.exit({i})")) for i in range(5)]
    exits = wait_for_exits(world.executor, 5)
    assert sorted((e.task_id, e.exit.exit_code) for e in exits) == [(t, i) for i, t in enumerate(tasks)]
    assert world.executor.poll_exits() == []
    assert world.executor.shim_pids() == {}


# --- identity and ownership -------------------------------------------------------------------------


def test_on_spawn_gets_the_shims_pid_and_start_time(world):
    task = world.start(py(WAIT_FOR_TERM))
    (record,) = world.spawned
    assert (record.task_id, record.attempt, record.run_dir) == (task, 1, str(world.executor.run_dir(task, 1)))
    assert record.start_ticks == proctree.start_ticks(record.pid)
    assert proctree.alive(record.pid, record.start_ticks)
    assert not proctree.alive(record.pid, record.start_ticks - 1)  # a reused pid would start later
    shim_file = Path(record.run_dir) / "shim.json"
    wait_until(shim_file.exists)
    shim = json.loads(shim_file.read_text())
    assert (shim["pid"], shim["start_ticks"]) == (record.pid, record.start_ticks)
    assert world.executor.shim_pids() == {record.pid: task}


def test_owners_maps_a_grandchild_to_its_task(world):
    task = world.start(py(SPAWN_GRANDCHILD, "stay"))
    wait_until(lambda: world.log(task).strip())
    grandchild = int(world.log(task))
    assert proctree.owners([grandchild, os.getpid(), 999_999_999], world.executor.shim_pids()) == {grandchild: task}


def test_stat_parsing_survives_names_with_spaces_and_parentheses():
    child = subprocess.Popen(
        py("import sys, time; open('/proc/self/comm', 'w').write('a) (b c'); print(1, flush=True); time.sleep(60)"),
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()
        stat = proctree.read_stat(child.pid)
        assert (stat.ppid, stat.running) == (os.getpid(), True)
        assert proctree.owners([child.pid], {os.getpid(): 42}) == {child.pid: 42}
    finally:
        child.kill()
        child.wait()
    assert proctree.parse_stat("7 (x) y) (z) S 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 123 0").start_ticks == 123


@pytest.mark.skipif(os.geteuid() != 0, reason="running a task as another user needs root")
def test_tasks_run_as_their_owner_when_the_daemon_is_root(make_world):
    if not nobody_can_run_carma():
        pytest.skip(f"user nobody cannot run {PY} with carma (interpreter or sources not readable by others)")
    home = Path(tempfile.mkdtemp())  # not under tmp_path, which only root may enter
    try:
        home.chmod(0o755)  # the owner must be able to reach its run dir
        w = make_world(home, run_as_owner=True)
        task = w.start(("/bin/sh", "-c", "id -u; id -g; id -G"), workdir="/", uid=NOBODY, gid=NOBODY)
        assert one_exit(w).exit.exit_code == 0
        assert w.log(task).split() == [str(NOBODY)] * 3  # and no supplementary groups from the daemon
        run_dir = w.executor.run_dir(task, 1)
        assert (run_dir.stat().st_uid, run_dir.stat().st_gid) == (NOBODY, NOBODY)
        assert (run_dir / "exit.json").stat().st_uid == NOBODY
    finally:
        shutil.rmtree(home)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a task as another user needs root")
def test_a_task_cannot_enter_a_workdir_below_a_folder_closed_to_its_owner(make_world):
    """The shim enters the workdir as the user: a root `chdir` before the switch to the user put a task inside
    a folder below another user's closed home, where it read what its owner cannot."""
    if not nobody_can_run_carma():
        pytest.skip(f"user nobody cannot run {PY} with carma (interpreter or sources not readable by others)")
    home, closed = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())  # not under tmp_path: only root enters it
    try:
        home.chmod(0o755)
        (closed / "proj").mkdir(mode=0o755)  # open itself, but below a folder closed to others
        (closed / "proj" / "secret.txt").write_text("root's secret\n")
        (closed / "proj" / "secret.txt").chmod(0o644)
        w = make_world(home, run_as_owner=True)
        task = w.start(("cat", "secret.txt"), workdir=str(closed / "proj"), uid=NOBODY, gid=NOBODY)
        ended = one_exit(w)
        assert ended.exit.exit_code == 126 and "root's secret" not in w.log(task)
        assert ended.exit.log_tail.strip().endswith("proj': Permission denied")
    finally:
        shutil.rmtree(home)
        shutil.rmtree(closed)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a task as another user needs root")
@pytest.mark.parametrize("release", ["this", "earlier"])
def test_an_abandoned_attempt_placed_again_runs_as_its_owner_under_a_root_daemon(make_world, release):
    """The abandoned marker a restarted root daemon leaves is the run dir owner's: the shim, as that user, read
    it as root's file (refused) and took the new launch for the abandoned one, so the task failed. An earlier
    release's marker, root's, is replaced by one of the user's."""
    if not nobody_can_run_carma():
        pytest.skip(f"user nobody cannot run {PY} with carma (interpreter or sources not readable by others)")
    home = Path(tempfile.mkdtemp())
    try:
        home.chmod(0o755)
        w = make_world(home, run_as_owner=True)
        run_dir = w.executor.run_dir(1, 1)
        run_dir.mkdir(parents=True)  # the old daemon died after making it the user's, before the shim started
        for folder in (run_dir.parent.parent, run_dir.parent):
            folder.chmod(0o711)
        os.chown(run_dir, NOBODY, NOBODY)
        assert w.executor.recover_unrecorded(1, 1) is None
        assert (run_dir / "shim.json").stat().st_uid == NOBODY
        if release == "earlier":
            os.chown(run_dir / "shim.json", 0, 0)
            (run_dir / "shim.json").chmod(0o600)
        task = w.start(("/bin/echo", "ran"), workdir="/", uid=NOBODY, gid=NOBODY)
        assert one_exit(w).exit.exit_code == 0 and w.log(task) == "ran\n"
    finally:
        shutil.rmtree(home)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a task as another user needs root")
def test_the_start_check_of_the_interpreter_agrees_with_running_it_as_another_user(make_world):
    """A root daemon whose Python lives under /root ran no other user's task, each failing with a
    'Permission denied' naming carma's interpreter; `carma server` now warns at its start."""
    closed = closed_to_others()
    assert (closed is None) == nobody_can_run_carma()
    if closed is not None:
        home = Path(tempfile.mkdtemp())
        try:
            home.chmod(0o755)
            w = make_world(home, run_as_owner=True)
            w.start(("true",), workdir="/", uid=NOBODY, gid=NOBODY, user="nobody")
            assert "(the daemon's Python, which nobody cannot run: see" in one_exit(w).exit.log_tail
        finally:
            shutil.rmtree(home)


def test_a_path_closed_to_other_users_is_found_on_the_way_or_at_the_end():
    top = Path(tempfile.mkdtemp())  # under /tmp, open to all; mkdtemp makes it 0700
    try:
        (top / "lib").mkdir(mode=0o755)
        (top / "lib" / "python").write_text("")
        assert first_closed([top / "lib" / "python"]) == top
        top.chmod(0o755)
        (top / "lib" / "python").chmod(0o600)
        assert first_closed([top / "lib", top / "lib" / "python"]) == top / "lib" / "python"
        (top / "lib" / "python").chmod(0o755)
        assert first_closed([top / "lib", top / "lib" / "python"]) is None
    finally:
        shutil.rmtree(top)


def test_a_launch_that_cannot_start_is_its_exit_never_an_exception(make_world, tmp_path):
    """As root, a task of a token's uid without an account has no group to run with (Popen raises
    ValueError); that once escaped `launch` and stopped the daemon's scheduling loop."""
    w = make_world(tmp_path, run_as_owner=True)
    task = w.start(("true",), uid=4242, gid=-1)
    ended = one_exit(w)
    assert (ended.task_id, ended.exit.exit_code, ended.exit.signal) == (task, None, None)
    assert ended.exit.log_tail.startswith(f"carma: could not start task {task} in ")


# --- the shim on its own ----------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), [("raise SystemExit(3)", 3), ("import os; os.kill(os.getpid(), 10)", 138)])
def test_the_shim_exits_with_its_tasks_status(tmp_path, code, status):
    shim = subprocess.run([PY, "-m", "carma.server.shim", str(tmp_path), "--", *py(code)], start_new_session=True)
    assert shim.returncode == status
    recorded = json.loads((tmp_path / "exit.json").read_text())
    assert (recorded["exit_code"], recorded["signal"]) == ((3, None) if status == 3 else (None, 10))


def test_the_shim_needs_a_command_after_the_separator(tmp_path):
    shim = subprocess.run([PY, "-m", "carma.server.shim", str(tmp_path), "true"], capture_output=True, text=True)
    assert shim.returncode == 2
    assert "must follow '--'" in shim.stderr


# --- daemon restarts --------------------------------------------------------------------------------


RUN_UNTIL_GO = """
import os, sys, time
n = 0
while not os.path.exists("go"):
    print("tick", n, flush=True)
    n += 1
    time.sleep(0.02)
sys.exit(4)
"""


def test_a_restarted_daemon_adopts_running_ended_and_vanished_tasks(world):
    running = world.start(py(RUN_UNTIL_GO))
    ended = world.start(py("raise SystemExit(5)"))
    vanished = world.start(py("import time; time.sleep(60)"))
    wait_until(lambda: "tick" in world.log(running))
    wait_until((Path(world.record(ended).run_dir) / "exit.json").exists)
    gone = world.record(vanished)
    wait_until((Path(gone.run_dir) / "shim.json").exists)
    os.killpg(gone.pid, signal.SIGKILL)  # the task and its shim, while no daemon watched
    wait_until(lambda: not proctree.alive(gone.pid, gone.start_ticks))

    restarted = world.restart(to_clock=lambda wall: wall - 1000.0)  # the old executor is never polled again
    for record in world.spawned:
        restarted.adopt(record)
    first = {e.task_id: e for e in wait_for_exits(restarted, 2)}
    assert set(first) == {ended, vanished}
    recorded = json.loads((Path(world.record(ended).run_dir) / "exit.json").read_text())
    assert first[ended].exit.exit_code == 5
    assert first[ended].ended_s == recorded["ended_at"] - 1000.0
    assert (first[vanished].exit.exit_code, first[vanished].exit.signal) == (None, None)
    assert restarted.shim_pids() == {world.record(running).pid: running}

    size = len(world.log(running))
    wait_until(lambda: len(world.log(running)) > size)  # the adopted task still writes to its log
    (world.home / "go").touch()
    (last,) = wait_for_exits(restarted, 1)
    assert (last.task_id, last.exit.exit_code) == (running, 4)
    assert restarted.poll_exits() == []


PRINT_PID_AND_STAY = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"


def _job_pid(world: World, task: int) -> tuple[int, int | None]:
    wait_until(lambda: world.log(task).strip())
    pid = int(world.log(task))
    return pid, proctree.start_ticks(pid)


def test_a_task_whose_shim_is_killed_alone_is_ended_with_it(world):
    """It ran on, unwatched, after the daemon had called the task failed and its GPUs free."""
    task = world.start(py(PRINT_PID_AND_STAY))
    job = _job_pid(world, task)
    os.kill(world.record(task).pid, signal.SIGKILL)
    assert one_exit(world).exit.signal == signal.SIGKILL
    wait_until(lambda: not proctree.alive(*job))
    assert world.log(task, "stderr").endswith(
        " ended without recording how the task ended; 1 process left in its group was killed\n"
    )


def test_an_adopted_task_whose_shim_died_unwatched_is_ended_and_says_so(world):
    task = world.start(py(PRINT_PID_AND_STAY))
    job = _job_pid(world, task)
    shim = world.record(task)
    restarted = world.restart()  # the old executor, which reaps the shim, is never polled again
    os.kill(shim.pid, signal.SIGKILL)
    os.waitpid(shim.pid, 0)  # as init reaps an orphan once the daemon that started it is gone
    restarted.adopt(shim)
    (ended,) = wait_for_exits(restarted, 1)
    assert (ended.exit.exit_code, ended.exit.signal) == (None, None)
    assert "1 process left in its group was killed" in ended.exit.log_tail
    wait_until(lambda: not proctree.alive(*job))


def test_a_task_killed_with_its_shim_unwatched_is_said_to_have_no_exit_status(world):
    """Its reason was its last output line ("step 9/10 ..."), as if the task had said why it failed."""
    task = world.start(py("print('step 9/10', flush=True); import time; time.sleep(60)"))
    wait_until(lambda: "step" in world.log(task))
    shim = world.record(task)
    restarted = world.restart()
    os.killpg(shim.pid, signal.SIGKILL)
    os.waitpid(shim.pid, 0)
    wait_until(lambda: not proctree.group_members(shim.pid))
    restarted.adopt(shim)
    (ended,) = wait_for_exits(restarted, 1)
    assert ended.exit.log_tail.endswith(
        "carma: the task ended without an exit status: its processes and its shim were killed together (a "
        "SIGKILL to its process group, or the kernel's OOM killer), or the shim alone while the task was ending\n"
    )


def test_an_abandoned_attempt_placed_again_runs_and_a_late_shim_of_it_still_does_not(world, tmp_path):
    """A restart abandons an attempt whose shim had not started, and the daemon places the task again under
    the same attempt number: the new shim found the marker and exited 1 without running the task."""
    run_dir = world.executor.run_dir(1, 1)
    run_dir.mkdir(parents=True)  # the old daemon died after creating it, before its shim wrote shim.json
    assert world.executor.recover_unrecorded(1, 1) is None
    task = world.start(py("open('ran', 'w')"))  # task 1, attempt 1 again
    (ended,) = wait_for_exits(world.executor, 1)
    assert (ended.task_id, ended.exit.exit_code) == (task, 0) and (tmp_path / "ran").exists()
    late = subprocess.run(
        [PY, "-m", "carma.server.shim", str(run_dir), "--", *py("open('late', 'w')")], cwd=tmp_path, capture_output=True
    )
    assert late.returncode == 1 and not (tmp_path / "late").exists()


@pytest.mark.parametrize("ended_at", ["NaN", "Infinity", "1e300", "true", "1" + "0" * 400])
def test_an_end_time_a_task_wrote_that_is_no_time_is_taken_as_now(world, ended_at):
    """exit.json is in the task's own run dir: a NaN there stopped the daemon (its event row needs a time), at
    every restart, as the task was taken up again."""
    run_dir = world.executor.run_dir(1, 1)
    run_dir.mkdir(parents=True)
    (run_dir / "exit.json").write_text(f'{{"exit_code": 0, "signal": null, "ended_at": {ended_at}}}')
    gone = subprocess.Popen(["true"])
    gone.wait()
    before = time.time()
    world.executor.adopt(SpawnRecord(1, 1, gone.pid, None, str(run_dir)))
    (ended,) = wait_for_exits(world.executor, 1)
    assert ended.exit.exit_code == 0 and before <= ended.ended_s <= time.time()


def test_a_record_file_the_size_of_no_record_is_none_not_read_whole(tmp_path):
    """A task can make its exit.json a sparse file of a terabyte for nothing: read whole, it stopped the daemon
    (MemoryError) at every start; nested past the parser's depth, it raised RecursionError."""
    sparse = tmp_path / "exit.json"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    assert read_json(sparse) is None
    (tmp_path / "shim.json").write_text("[" * 100_000 + "]" * 100_000)
    assert read_json(tmp_path / "shim.json") is None


def test_a_run_dir_too_deep_to_delete_is_left_with_a_warning_not_raised(world, caplog, monkeypatch):
    """A task can leave a tree deeper than the interpreter's stack in its run dir (1,200 folders): Python 3.11's
    rmtree raised RecursionError deleting it when the task was forgotten, which stopped the daemon."""
    world.executor.run_dir(1, 1).mkdir(parents=True)

    def too_deep(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(shutil, "rmtree", too_deep)
    world.executor.remove_runs(1)
    wait_until(lambda: "could not delete the logs of forgotten task 1: maximum recursion depth exceeded" in caplog.text)


def test_a_forgotten_tasks_run_dirs_go_at_once_and_are_deleted_in_the_background(world, monkeypatch):
    """A task may leave millions of files: their deletion stopped the scheduling loop (1.2 s for 200,000).
    What a stopped daemon had not deleted yet is deleted after its next start."""
    release = threading.Event()
    rmtree = shutil.rmtree

    def slow(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(10)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow)
    for task_id in (1, 2):
        (world.executor.run_dir(task_id, 1) / "data").mkdir(parents=True)
    world.executor.remove_runs(1)
    tasks = world.executor.home / "tasks"
    assert [p.name.rpartition("-")[0] for p in sorted(tasks.iterdir())] == [".thrown-1", ""]  # out of the way
    assert (tasks / "2").is_dir()
    assert world.executor.trash.pending == 1
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    restarted = Trash(tasks)  # the next start's, while the one before still waits
    wait_until(lambda: restarted.pending == 0)
    assert sorted(p.name for p in tasks.iterdir()) == ["2"]
    release.set()
    wait_until(lambda: world.executor.trash.pending == 0)
    world.executor.remove_runs(3)  # a task that never started: nothing to delete
    assert world.executor.trash.pending == 0


def test_kill_reaches_an_adopted_task(world):
    task = world.start(py(WAIT_FOR_TERM))
    wait_until(lambda: "ready" in world.log(task))
    restarted = world.restart()
    restarted.adopt(world.record(task))
    restarted.kill(task)
    (ended,) = wait_for_exits(restarted, 1)
    assert (ended.exit.exit_code, world.log(task)) == (7, "ready\nbye\n")


def test_a_pid_that_is_not_the_recorded_shim_is_never_signalled(world):
    task = world.start(py(WAIT_FOR_TERM))
    wait_until(lambda: "ready" in world.log(task))
    forged = SpawnRecord(task, 1, os.getpid(), proctree.start_ticks(os.getpid()), world.spawned[0].run_dir)
    restarted = world.restart()
    restarted.adopt(forged)
    restarted.kill(task)  # would SIGTERM the test's own group if the pid were trusted
    (ended,) = wait_for_exits(restarted, 1)
    assert (ended.exit.exit_code, ended.exit.signal) == (None, None)


def test_recover_unrecorded_finds_a_started_shim(world):
    task = world.start(py(WAIT_FOR_TERM))
    wait_until((world.executor.run_dir(task, 1) / "shim.json").exists)
    assert world.restart().recover_unrecorded(task, 1) == world.record(task)


def test_recover_unrecorded_abandons_an_attempt_that_had_not_started(world, tmp_path):
    restarted = world.restart()
    assert restarted.recover_unrecorded(7, 1) is None  # no run dir: the placement never reached a spawn
    run_dir = restarted.run_dir(7, 2)
    run_dir.mkdir(parents=True)  # the old daemon died after creating it, before its shim wrote shim.json
    assert restarted.recover_unrecorded(7, 2) is None
    late = subprocess.run(
        [PY, "-m", "carma.server.shim", str(run_dir), "--", *py("open('ran', 'w')")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert late.returncode == 1 and "abandoned" in late.stderr
    assert not (tmp_path / "ran").exists()  # the shim that started late did not run the task
    assert restarted.recover_unrecorded(7, 2) is None
