"""A task's user controls its run dir: what they put in place of a log or record is refused, never followed,
waited on or appended to, and the daemon keeps answering (docs/security.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from carma.server.client import ClientError
from carma.userfiles import UnsafeFile, open_for_append, open_for_reading, owners_of
from support import NOBODY, wait_until

SECRET = "s3cret-only-for-root"

# ----------------------------------------------------------------------------- the opener itself


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "secret").chmod(0o600)
    run = tmp_path / "run"
    run.mkdir()
    return run


def test_a_plain_file_is_read_and_appended_to(run_dir: Path) -> None:
    with open_for_append(run_dir / "stdout.log", owners_of(run_dir)) as f:
        f.write(b"one\n")
    with open_for_append(run_dir / "stdout.log", owners_of(run_dir)) as f:
        f.write(b"two\n")
    with open_for_reading(run_dir / "stdout.log", owners_of(run_dir)) as f:
        assert f.read() == b"one\ntwo\n"


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (lambda path, secret: path.symlink_to(secret), "is a symbolic link"),
        (lambda path, secret: os.link(secret, path), "has 2 hard links"),
        (lambda path, secret: os.mkfifo(path), "is a FIFO"),
        (lambda path, secret: path.mkdir(), "is a directory"),
    ],
    ids=["symlink", "hard link", "fifo", "directory"],
)
def test_what_a_user_plants_in_place_of_a_log_is_refused_at_once(run_dir: Path, plant, said: str) -> None:  # type: ignore[no-untyped-def]
    path = run_dir / "stdout.log"
    plant(path, run_dir.parent / "secret")
    with pytest.raises(UnsafeFile, match=f"stdout.log {said}: carma opens only the plain files it made there$"):
        open_for_reading(path, owners_of(run_dir))
    with pytest.raises(UnsafeFile, match=said):  # a FIFO: opened for writing it would wait for a reader
        open_for_append(path, owners_of(run_dir))
    assert (run_dir.parent / "secret").read_text() == SECRET  # nothing appended through a link


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(run_dir: Path) -> None:
    (run_dir / "stdout.log").write_text("theirs")
    os.chown(run_dir / "stdout.log", 4242, 4242)
    with pytest.raises(UnsafeFile, match="belongs to uid 4242, not to the task's user"):
        open_for_reading(run_dir / "stdout.log", owners_of(run_dir))
    os.chown(run_dir, 4242, 4242)  # the run dir's owner is the task's user: their files are theirs to show
    with open_for_reading(run_dir / "stdout.log", owners_of(run_dir)) as f:
        assert f.read() == b"theirs"
    (run_dir / "moved").write_text("root's")  # a file of root's the user moved in from a folder they can write
    with pytest.raises(UnsafeFile, match="belongs to uid 0, not to the task's user"):
        open_for_reading(run_dir / "moved", owners_of(run_dir))


def test_a_file_of_the_kernels_is_never_read(run_dir: Path) -> None:
    """/proc/kmsg is a regular file whose read waits for the kernel's next message (and takes it from the
    system log): named as a job's program, it hung the server's event loop."""
    for path in ("/proc/self/status", "/sys/kernel/notes"):
        with pytest.raises(UnsafeFile, match="is a file of the kernel's"):
            open_for_reading(Path(path))
    (run_dir / "stdout.log").symlink_to("/proc/self/status")
    with pytest.raises(UnsafeFile):
        open_for_reading(run_dir / "stdout.log", owners_of(run_dir))


LINKS = 1500  # Python resolves each link of a path by recursing: more than its recursion limit
CHAIN = f"i=0; while [ $i -lt {LINKS} ]; do ln -s l$((i + 1)) x/l$i; i=$((i + 1)); done"


def test_a_chain_of_links_too_long_to_resolve_is_refused_not_raised(run_dir: Path) -> None:
    """A user's chain of 1,500 links in place of a log raised RecursionError from the kernel-file check, which
    stopped the daemon (and again at each start, the task being adopted again)."""
    (run_dir / "x").mkdir()
    (run_dir / "x" / f"l{LINKS}").write_text("end")
    subprocess.run(["/bin/sh", "-c", CHAIN], cwd=run_dir, check=True)
    (run_dir / "stderr.log").symlink_to("x/l0")
    with pytest.raises(UnsafeFile, match=r"stderr\.log is a symbolic link"):
        open_for_reading(run_dir / "stderr.log", owners_of(run_dir))
    (run_dir / "x" / f"l{LINKS}").unlink()
    (run_dir / "x" / f"l{LINKS}").mkdir()  # the chain as the folder of the file asked for
    with pytest.raises(UnsafeFile, match="its folder is reached through too many symbolic links"):
        open_for_reading(run_dir / "x" / "l0" / "stderr.log", owners_of(run_dir))


def test_a_lease_on_a_log_fails_the_daemons_open_at_once(run_dir: Path) -> None:
    """A task's process that took a write lease on its stderr.log held the daemon's append (its note on how the
    task ended) for the kernel's lease-break time: 45 s of the event loop, at each such exit."""
    log = run_dir / "stderr.log"
    log.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", LEASE, str(log)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "leased\n"
    with pytest.raises(BlockingIOError):  # it waited for the lease to be broken, then opened
        open_for_append(log, owners_of(run_dir))
    with pytest.raises(BlockingIOError):  # reads already did not wait
        open_for_reading(log, owners_of(run_dir))
    holder.kill()
    holder.wait()


LEASE = """
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # told to give the lease up: it keeps it, as the task did
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
time.sleep(60)
"""


def test_a_record_linked_twice_is_read_as_claim_links_it_in_place(run_dir: Path) -> None:
    (run_dir / ".shim.json.tmp").write_text('{"pid": 7}')
    os.link(run_dir / ".shim.json.tmp", run_dir / "shim.json")
    with open_for_reading(run_dir / "shim.json", owners_of(run_dir), single_link=False) as f:
        assert f.read() == b'{"pid": 7}'


# ----------------------------------------------------------------------------- through the real daemon


def _attack(server, then: str) -> int:  # type: ignore[no-untyped-def]
    """A task that replaces its own logs in its run dir (`then`, run there), says it did, and waits."""
    run = f"{server.home}/tasks/$CARMA_TASK_ID/$CARMA_ATTEMPT"
    script = f"echo hello; cd {run} && {then} && touch planted && while [ ! -e go ]; do sleep 0.1; done; exit 3"
    task = server.client.submit({"command": ["/bin/sh", "-c", script], "workdir": "/tmp"})["id"]
    wait_until(lambda: (server.home / "tasks" / str(task) / "1" / "planted").exists(), 60, "the task's plant")
    return task


def _go(server, task: int) -> None:  # type: ignore[no-untyped-def]
    (server.home / "tasks" / str(task) / "1" / "go").touch()


def _answers(server) -> None:  # type: ignore[no-untyped-def]
    """The daemon answers at once (a daemon blocked on a FIFO never does: the client's timeout would end it)."""
    done = threading.Event()
    threading.Thread(target=lambda: (server.client.status(), done.set()), daemon=True).start()
    assert done.wait(10), "the daemon stopped answering"


@pytest.fixture
def server(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "10")
    (server.home / "secret").write_text(SECRET)
    (server.home / "secret").chmod(0o600)
    return server


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        ("rm stdout.log && ln -s {home}/secret stdout.log", "is a symbolic link"),
        ("rm stdout.log && ln -s {home}/tokens stdout.log", "is a symbolic link"),
        ("rm stdout.log && ln {home}/secret stdout.log", "has 2 hard links"),
        ("rm stdout.log && mkdir stdout.log", "is a directory"),
        ("rm stdout.log && mkfifo stdout.log", "is a FIFO"),
        (f"mkdir x && touch x/l{LINKS} && {CHAIN} && rm stdout.log && ln -s x/l0 stdout.log", "is a symbolic link"),
    ],
    ids=["symlink to a root-only file", "symlink to tokens", "hard link", "directory", "fifo", "chain of links"],
)
def test_carma_logs_refuses_what_the_task_put_in_place_of_its_log(server, plant: str, said: str) -> None:  # type: ignore[no-untyped-def]
    (server.home / "tokens").write_text("admin-token-0123456789 ops 0 admin\n")
    (server.home / "tokens").chmod(0o600)
    task = _attack(server, plant.format(home=server.home))
    shown = server.cli("logs", task)
    assert shown.returncode != 0 and SECRET not in shown.stdout + shown.stderr
    assert "admin-token" not in shown.stdout + shown.stderr
    assert shown.stderr.count("\n") == 1 and said in shown.stderr, shown.stderr
    with pytest.raises(ClientError, match=said):
        server.client.logs(task)
    _answers(server)
    assert "hello" not in shown.stdout
    _go(server, task)
    assert server.wait_state(task, "failed")["state"] == "failed"


def test_a_task_ending_with_fifos_for_logs_is_reported_and_the_daemon_keeps_answering(server) -> None:  # type: ignore[no-untyped-def]
    task = _attack(server, "rm stdout.log stderr.log && mkfifo stdout.log stderr.log")
    _go(server, task)
    ended = server.wait_state(task, "failed")
    assert ended["reason"] == "exit code 3"
    _answers(server)


def test_a_restarted_daemon_is_not_frozen_by_fifos_left_by_a_task_that_ended_while_it_was_down(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    task = _attack(server, "rm stdout.log stderr.log && mkfifo stdout.log stderr.log")
    server.kill9()
    _go(server, task)
    wait_until(lambda: (server.home / "tasks" / str(task) / "1" / "exit.json").exists(), 30, "the task's exit")
    again = start_server("--fake-gpus", "1xA100-40GB", home=server.home)  # waits until it answers
    assert again.wait_state(task, "failed")["state"] == "failed"
    _answers(again)


# ----------------------------------------------------------------------------- fake GPUs under a root daemon


@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon's fake device, used by another user's job")
def test_a_root_daemons_fake_device_is_usable_by_any_users_job_and_forgeries_are_ignored() -> None:
    from carma.sim.gpus import parse_gpus
    from carma.telemetry.fake import FakeDevice

    home = Path(tempfile.mkdtemp())  # not under tmp_path, which only root may enter
    home.chmod(0o711)  # as a state dir
    try:
        _use_as_nobody(FakeDevice.create(home / "fake-gpus", parse_gpus("1xA100-40GB")))
    finally:
        shutil.rmtree(home)


def _use_as_nobody(device) -> None:  # type: ignore[no-untyped-def]
    root, uuid = device.root, device.gpus()[0].id
    # what a fake job does as its user (without Python: this machine's may be closed to others), and what it
    # may try: a FIFO for the daemon to wait on, a registration forged for root's process, pid 1
    job = (
        f"exec 3>>{root}/device.lock && echo $$ > {root}/generation"
        f' && echo \'{{"pid": \'$$\', "mib": {{"{uuid}": 1024}}, "load": null}}\' > {root}/procs/$$.json'
        f" && mkfifo {root}/procs/7.json"
        f' && echo \'{{"pid": 1, "mib": {{"{uuid}": 4096}}, "load": null}}\' > {root}/procs/1.json'
        f" && touch {root}/procs/registered && sleep 30"
    )
    proc = subprocess.Popen(["/bin/sh", "-c", job], user=NOBODY, group=NOBODY, cwd="/")
    try:
        wait_until(lambda: (root / "procs/registered").exists() or proc.poll() is not None, 10, "the registration")
        assert proc.poll() is None, "user nobody could not use the fake device"
        assert device.processes(uuid) == [(proc.pid, 1024, None)]  # the forged one for pid 1 is no registration
    finally:
        proc.kill()
        proc.wait()
    assert device.processes(uuid) == []


# ----------------------------------------------------------------------------- a run dir of an earlier launch


def test_a_launch_that_meets_an_earlier_launchs_records_fails_and_leaves_them_as_they_were(tmp_path: Path) -> None:
    """Task ids reused (a database replaced) made a new task 1 meet the old one's shim.json: it never ran and
    was reported completed from the old exit.json."""
    from carma.core.types import Launch, Task, TaskSpec
    from carma.server.executor import ProcessExecutor
    from carma.server.spec import JobSpec

    def launch(argv: tuple[str, ...]):  # type: ignore[no-untyped-def]
        executor = ProcessExecutor(tmp_path, {1: JobSpec("job", argv, workdir=str(tmp_path))}.__getitem__)
        executor.launch(Task(1, TaskSpec("job", 1), 0.0), Launch(1, 1, ("GPU-0",), exclusive=False))
        return wait_until(executor.poll_exits, 20, "the exit")

    (old,) = launch(("/bin/sh", "-c", "echo old"))
    assert old.exit.exit_code == 0
    (new,) = launch(("/bin/sh", "-c", "echo new"))
    assert new.exit.exit_code is None and "holds the records of an earlier launch" in new.exit.log_tail
    assert (tmp_path / "tasks/1/1/stdout.log").read_text() == "old\n"
