"""The daemon's process executor (Linux only): runs tasks through a shim and reports how they end.

Each attempt gets a run directory, `home/tasks/<task_id>/<attempt>/`, holding

    shim.json    the shim's pid, start ticks and start time (or the daemon's "abandoned" marker)
    stdout.log   the task's standard output (appended to, also across daemon restarts)
    stderr.log   the task's standard error, and the shim's and executor's own messages
    exit.json    how the task ended: exit_code or signal, and ended_at (wall time)

The shim (`carma.server.shim`) leads the task's session and process group, so a cancel is one `killpg`,
and it outlives the daemon: after a crash the daemon `adopt`s the attempts it had recorded (pid plus start
ticks, via `on_spawn`), and `recover_unrecorded` settles a placement persisted before its pid was. Every
exit is reported exactly once, from `exit.json` when the shim could write it.

Not thread-safe: the daemon calls everything from one thread. `poll_exits` must run regularly (the
scheduling loop's step does): it reaps the shims and escalates a cancel to SIGKILL once `grace_s` passed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pwd
import secrets
import signal
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, TypeGuard

import carma
from carma.core.ports import TaskExit
from carma.core.types import Launch, ProcessExit, Reconfigure, Task, TaskId
from carma.server import proctree
from carma.server.shim import (
    ABANDONED,
    ADMITS,
    EXIT_FILE,
    LAUNCHED_AT,
    SHIM_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    claim,
    read_json,
    write_json_atomically,
)
from carma.server.spec import JobSpec
from carma.server.trash import Trash
from carma.units import inflect, pluralize
from carma.userfiles import MACHINE_FAULTS, UnsafeFile, hand_to_owner, open_for_append, open_for_reading, owners_of

log = logging.getLogger("carma.server")

LOG_TAIL_BYTES = 8192
LAUNCH_RETRY_S = 60.0  # how long a launch the machine refuses (MACHINE_FAULTS) is tried again
Stream = Literal["stdout", "stderr"]


class StaleRunDir(RuntimeError):
    """A launch met another launch's records in its run dir: its shim would refuse to start and its exit would
    be read from the other launch's exit.json (a task reported completed that never ran)."""


@dataclass(frozen=True)
class SpawnRecord:
    """What the daemon persists about a started attempt to find it again after a restart."""

    task_id: TaskId
    attempt: int
    pid: int  # the shim's, which is also the process group id
    start_ticks: int | None
    run_dir: str


@dataclass
class _Run:
    """A tracked attempt: our own child (`child` set) or one adopted after a restart."""

    record: SpawnRecord
    child: subprocess.Popen[bytes] | None = None
    sigkill_at: float | None = None  # monotonic deadline of a pending cancel
    sigkilled: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.record.run_dir)


class ProcessExecutor:
    """Runs each task's argv as a process group under a shim; implements `carma.core.ports.Executor`."""

    def __init__(
        self,
        home: Path,
        jobs: Callable[[TaskId], JobSpec],
        *,
        to_clock: Callable[[float], float] = lambda wall: wall,
        extra_env: Mapping[str, str] | None = None,
        run_as_owner: bool = False,
        grace_s: float = 10.0,
        on_spawn: Callable[[SpawnRecord], None] = lambda record: None,
        task_env: Callable[[Task, Launch], Mapping[str, str]] = lambda task, launch: {},
        reconfigure: Callable[[Reconfigure], None] | None = None,
    ) -> None:
        """`reconfigure`: how MIG reconfigurations are carried out (`carma.server.mig`; None: not at all)."""
        self._reconfigure = reconfigure
        self.home = Path(home).absolute()  # the shim runs in the job's workdir: its RUN_DIR must be absolute
        self.jobs = jobs
        self.to_clock = to_clock
        self.extra_env = dict(extra_env or {})
        self.run_as_owner = run_as_owner
        self.grace_s = grace_s
        self.on_spawn = on_spawn
        self.task_env = task_env  # per-attempt additions, e.g. an MPS memory limit from the task's need
        self._runs: dict[TaskId, _Run] = {}
        self._failed: list[TaskExit] = []  # launches that never got a process, reported at the next poll
        self._pending: dict[TaskId, tuple[Task, Launch, float]] = {}  # launches the machine refused, till when
        self.trash = Trash(self.home / "tasks")

    # --- the Executor protocol -------------------------------------------------------------------------

    def launch(self, task: Task, launch: Launch) -> None:
        """Start the attempt; a failure to start is reported as its exit at the next poll, never raised. A
        fault of the machine (no descriptor, no space, no memory) is not the task's: the launch is tried
        again at each poll for `LAUNCH_RETRY_S`, its GPUs held meanwhile."""
        _, _, deadline = self._pending.pop(task.id, (task, launch, time.monotonic() + LAUNCH_RETRY_S))
        job = self.jobs(task.id)
        run_dir = self.run_dir(task.id, launch.attempt)
        token = secrets.token_hex(8)  # lets this launch, and no late shim of an abandoned one, use the run dir
        try:
            self._prepare_run_dir(run_dir, job, token)
            child = self._spawn(run_dir, job, self._environment(job, task, launch), token)
        except OSError as exc:
            if exc.errno in MACHINE_FAULTS and time.monotonic() < deadline:
                self._pending[task.id] = (task, launch, deadline)
            else:
                self._refused(task, job, run_dir, exc)
            return
        except Exception as exc:  # a ValueError from a bad uid/gid, say: one task, never the loop
            self._refused(task, job, run_dir, exc)
            return
        record = SpawnRecord(task.id, launch.attempt, child.pid, proctree.start_ticks(child.pid), str(run_dir))
        self._runs[task.id] = _Run(record, child)
        self.on_spawn(record)

    def _refused(self, task: Task, job: JobSpec, run_dir: Path, exc: Exception) -> None:
        """Report a launch that got no process as the attempt's exit, at the next poll."""
        message = f"carma: could not start task {task.id} in {job.workdir!r}: {exc}"
        if isinstance(exc, PermissionError) and exc.filename == sys.executable and self.run_as_owner:
            message += f" (the daemon's Python, which {job.user} cannot run: see `carma server`'s warning)"
        if not isinstance(exc, StaleRunDir):  # its stderr.log is an earlier task's: leave it as it was
            self._note(run_dir, message)
        self._failed.append(TaskExit(task.id, ProcessExit(None, message), self.to_clock(time.time())))

    def kill(self, task_id: TaskId) -> None:
        """SIGTERM the task's process group now, SIGKILL it at a poll after `grace_s`; idempotent. A launch
        still waiting for the machine is dropped, its exit that of a task killed before it started."""
        if self._pending.pop(task_id, None) is not None:
            cancelled = ProcessExit(None, "carma: cancelled before its process could start", signal.SIGTERM)
            self._failed.append(TaskExit(task_id, cancelled, self.to_clock(time.time())))
            return
        run = self._runs.get(task_id)
        if run is None or run.sigkill_at is not None or run.sigkilled:
            return
        if self._signal(run, signal.SIGTERM):
            run.sigkill_at = time.monotonic() + self.grace_s

    def reconfigure(self, action: Reconfigure) -> None:
        if self._reconfigure is None:
            raise ValueError(f"cannot reconfigure MIG GPU {action.gpu}: carma server runs without --mig dynamic")
        self._reconfigure(action)

    def poll_exits(self) -> Sequence[TaskExit]:
        """The exits since the last poll, each once; also escalates cancels whose grace period is over."""
        for task, launch, _ in list(self._pending.values()):
            self.launch(task, launch)
        exits, self._failed = self._failed, []
        for task_id, run in list(self._runs.items()):
            if self._ended(run):
                try:
                    exits.append(self._exit(run))
                except OSError as e:  # a fault of the machine reading its records: read them at the next poll
                    if e.errno not in MACHINE_FAULTS:
                        raise
                    continue
                del self._runs[task_id]
            elif run.sigkill_at is not None and time.monotonic() >= run.sigkill_at:
                self._signal(run, signal.SIGKILL)
                run.sigkill_at, run.sigkilled = None, True
        return exits

    # --- restart --------------------------------------------------------------------------------------

    def adopt(self, record: SpawnRecord) -> None:
        """Track an attempt started by a previous daemon; its exit is reported by a later poll.

        Whether it still runs, ended with an exit.json, or vanished without one (its group SIGKILLed) is
        settled by `poll_exits`. Adopting a task already tracked changes nothing.
        """
        self._runs.setdefault(record.task_id, _Run(record))

    def recover_unrecorded(self, task_id: TaskId, attempt: int) -> SpawnRecord | None:
        """For a placement persisted before its pid: the shim's record if it started, else None.

        None is final: the run dir is marked abandoned, so a shim still starting up will not run the task
        (the caller may relaunch it without running it twice). A record should be persisted and adopted.
        """
        run_dir = self.run_dir(task_id, attempt)
        if run_dir.is_dir():
            claim(run_dir / SHIM_FILE, {ABANDONED: True, "at": time.time()})
        shim = read_json(run_dir / SHIM_FILE) or {}
        pid = _int(shim.get("pid"))
        if pid is None or shim.get(ABANDONED):
            return None
        return SpawnRecord(task_id, attempt, pid, _int(shim.get("start_ticks")), str(run_dir))

    # --- queries --------------------------------------------------------------------------------------

    def shim_pids(self) -> dict[int, TaskId]:
        """Pid of each tracked task's shim, the roots for `proctree.owners`."""
        return {run.record.pid: task_id for task_id, run in self._runs.items()}

    def run_dir(self, task_id: TaskId, attempt: int) -> Path:
        return self.home / "tasks" / str(task_id) / str(attempt)

    def remove_runs(self, task_id: TaskId) -> None:
        """Delete an ended task's run dirs (its logs), when the daemon forgets the task: in the background."""
        self.trash.throw(str(task_id), f"the logs of forgotten task {task_id}")

    def log_path(self, task_id: TaskId, attempt: int, stream: Stream) -> Path:
        return self.run_dir(task_id, attempt) / {"stdout": STDOUT_FILE, "stderr": STDERR_FILE}[stream]

    def open_log(self, task_id: TaskId, attempt: int, stream: Stream) -> BinaryIO:
        """A log opened for reading as `carma.userfiles` allows (UnsafeFile for a link, FIFO, directory or
        hard link the task's user put in its place); FileNotFoundError before the attempt started."""
        path = self.log_path(task_id, attempt, stream)
        return open_for_reading(path, owners_of(path.parent))

    # --- launching ------------------------------------------------------------------------------------

    def _environment(self, job: JobSpec, task: Task, launch: Launch) -> dict[str, str]:
        """The job's environment, the daemon's additions, the task's identity and its GPUs (by their ids, the
        GPUs' and MIG instances' UUIDs, so that the task sees exactly its targets whatever the device order),
        and PWD its workdir, as a shell's `cd` sets it (the submitter's was where `carma submit` ran).
        CARMA_LAUNCHED_AT, the Unix time of the launch, lets a job count its time to first kernel from it, its
        interpreter's start-up included, as the catalog's times are measured (a fake job does)."""
        devices = ",".join(launch.gpus)
        return {
            **job.env,
            **self.extra_env,
            **self.task_env(task, launch),
            "PWD": job.workdir,
            "CARMA_TASK_ID": str(launch.task_id),
            "CARMA_ATTEMPT": str(launch.attempt),
            LAUNCHED_AT: f"{time.time():.3f}",
            "CUDA_VISIBLE_DEVICES": devices,
        }

    def _prepare_run_dir(self, run_dir: Path, job: JobSpec, token: str) -> None:
        """Create the run dir and empty logs; hand them to the job's owner when the task runs as them. A run
        dir a restart abandoned (`recover_unrecorded`) is placed again: its marker admits this launch."""
        run_dir.mkdir(parents=True, exist_ok=True)
        # a root daemon of an earlier release left its marker as root's, which the shim (the user) cannot read
        marker = read_json(run_dir / SHIM_FILE) or (
            read_json(run_dir / SHIM_FILE, owners={0}) if self.run_as_owner else None
        )
        if marker is not None and marker.get(ABANDONED):
            write_json_atomically(run_dir / SHIM_FILE, {**marker, ADMITS: token})
        elif marker is not None or (run_dir / EXIT_FILE).exists():
            raise StaleRunDir(f"its run dir {run_dir} holds the records of an earlier launch, not started again")
        owners = owners_of(run_dir) | ({job.uid} if self.run_as_owner else set())
        for name in (STDOUT_FILE, STDERR_FILE):
            with open_for_append(run_dir / name, owners) as log:
                if self.run_as_owner:  # through the descriptor checked, never a name the user could swap
                    os.fchown(log.fileno(), job.uid, job.gid)
        if self.run_as_owner:
            for parent in (run_dir.parent.parent, run_dir.parent):  # tasks/ and tasks/<id>/: traversable
                parent.chmod(0o711)
            os.chown(run_dir, job.uid, job.gid, follow_symlinks=False)
            run_dir.chmod(0o700)

    def _spawn(self, run_dir: Path, job: JobSpec, env: dict[str, str], token: str) -> subprocess.Popen[bytes]:
        """Start the shim in a new session, in the job's environment (and user, as root); the shim enters the
        job's workdir itself, as the user (`subprocess` changes directory before it drops root's rights).

        `-I` keeps the job's PYTHON* variables and working directory out of the shim's own interpreter.
        The shim's own diagnostics (say, a traceback) land in stderr.log. An environment without LC_CTYPE
        gets none from the shim, whose interpreter sets one when it finds the C locale (PEP 538).
        """
        argv = [
            sys.executable,
            "-I",
            "-m",
            "carma.server.shim",
            str(run_dir),
            "--launch",
            token,
            "--workdir",
            job.workdir,
        ]
        argv += [] if "LC_CTYPE" in env else ["--unset", "LC_CTYPE"]
        argv += ["--shell", "--", *job.argv] if job.shell else ["--", *job.argv]
        owner: dict[str, object] = {}
        if self.run_as_owner:  # the user's own groups too: /dev/nvidia* is often group-restricted
            owner = {"user": job.uid, "group": job.gid, "extra_groups": groups_of(job)}
        with _open_log(run_dir / STDERR_FILE) as err:
            return subprocess.Popen(
                argv,
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                **owner,
            )

    def _note(self, run_dir: Path, message: str) -> None:
        """Leave the executor's own message in stderr.log, where the user looks, if the dir exists."""
        with contextlib.suppress(OSError), _open_log(run_dir / STDERR_FILE) as err:
            err.write(f"{message}\n".encode())

    # --- ending ---------------------------------------------------------------------------------------

    def _signal(self, run: _Run, signum: int) -> bool:
        """Signal the task's process group; False when there is nothing left to signal."""
        ours = run.child is not None and run.child.returncode is None  # unreaped: the pid is still ours
        if not ours and not _shim_lives(run.record):
            return False
        try:
            os.killpg(run.record.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def _ended(self, run: _Run) -> bool:
        """Whether the attempt is over: our child reaped, or an adopted shim recorded its exit or vanished."""
        if run.child is not None:
            return run.child.poll() is not None
        return (run.run_dir / EXIT_FILE).exists() or not _shim_lives(run.record)

    def _exit(self, run: _Run) -> TaskExit:
        """How the attempt ended: exit.json if the shim wrote one, else what the kernel or we know. Raises
        the OSError of a fault of the machine (MACHINE_FAULTS) rather than misreport the exit."""
        ended = read_json(run.run_dir / EXIT_FILE, raising=MACHINE_FAULTS)
        if ended is not None:
            code, sig, ended_at = _int(ended.get("exit_code")), _int(ended.get("signal")), ended.get("ended_at")
        else:
            (code, sig), ended_at = _status_without_record(run), None
            left = _end_leftovers(run)
            if left or not run.sigkilled:  # a cancel's SIGKILL needs no explaining
                self._note(run.run_dir, _without_record(run, left, code, sig))
        now = time.time()  # the task may have written exit.json: NaN, inf or a time to come is not an end
        wall = ended_at if _number(ended_at) and ended_at <= now else now
        tail, of_output = _log_tail(run.run_dir)
        exit = ProcessExit(code, tail, sig, tail_is_output=of_output)
        return TaskExit(run.record.task_id, exit, self.to_clock(wall))


def _status_without_record(run: _Run) -> tuple[int | None, int | None]:
    """(exit_code, signal) of a shim that died without writing exit.json (its group was SIGKILLed, say):
    the kernel's status for our own child; for an adopted one, only whether we sent the SIGKILL."""
    if run.child is None:
        return None, (signal.SIGKILL if run.sigkilled else None)
    returncode = run.child.returncode
    return (None, -returncode) if returncode < 0 else (returncode, None)


def _end_leftovers(run: _Run) -> int:
    """SIGKILL what is left in the process group of a shim that died without recording the exit (killed on
    its own, say): its task would run on, unwatched, on GPUs the scheduler now calls free, and a resubmitted
    copy would run beside it. Only when no process holds the shim's pid: Linux reuses no pid while a group of
    that id has members, so the group is still the task's. How many processes were left."""
    pgid = run.record.pid
    if proctree.read_stat(pgid) is not None:  # a zombie not yet reaped, or a new process: leave it alone
        return 0
    left = proctree.group_members(pgid)
    if left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return len(left)


def _without_record(run: _Run, left: int, code: int | None, sig: int | None) -> str:
    """The executor's line in stderr.log for an attempt that ended without its shim's record: it becomes the
    failure's reason, where the job's last output line read as if it were one."""
    if left:
        return (
            f"carma: the task's supervisor (its shim, pid {run.record.pid}) ended without recording how the task "
            f"ended; {pluralize(left, 'process', 'processes')} left in its group "
            f"{inflect(left, 'was', 'were')} killed"
        )
    if code is None and sig is None:
        return (
            "carma: the task ended without an exit status: its processes and its shim were killed together "
            "(a SIGKILL to its process group, or the kernel's OOM killer), or the shim alone while the task was "
            "ending"
        )
    return f"carma: the task's supervisor (its shim, pid {run.record.pid}) ended without recording how it ended"


def _shim_lives(record: SpawnRecord) -> bool:
    """Whether the recorded shim still runs: same pid and start time, and its command names this run dir,
    so neither a reused pid nor a forged shim.json in a user-owned run dir gets a foreign group signalled."""
    return proctree.alive(record.pid, record.start_ticks) and record.run_dir in proctree.cmdline(record.pid)


def _open_log(path: Path) -> BinaryIO:
    """Open a log of a user-owned run dir for appending the daemon's own lines (see `carma.userfiles`); one the
    task deleted is made again as the run dir owner's (as root's, the log would read as no log of theirs)."""
    log_file = open_for_append(path, owners_of(path.parent))
    try:
        hand_to_owner(log_file.fileno(), path.parent)
    except BaseException:
        log_file.close()
        raise
    return log_file


def _read_tail(path: Path, size: int) -> str:
    """The end of a log, "" when it is missing or not a plain file of the task's (the exit is still reported:
    its classification then has no output to read, never the daemon blocked on a FIFO). A fault of the
    machine is raised: the tail decides whether the task ran out of GPU memory."""
    try:
        with open_for_reading(path, owners_of(path.parent)) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read(size).decode(errors="replace")
    except UnsafeFile as e:
        log.warning("%s", e)
        return ""
    except OSError as e:
        if e.errno in MACHINE_FAULTS:
            raise
        return ""


def _log_tail(run_dir: Path) -> tuple[str, bool]:
    """What the classifier reads: the end of stderr, or of stdout when the task wrote no errors; and whether
    it is stdout's."""
    tail = _read_tail(run_dir / STDERR_FILE, LOG_TAIL_BYTES)
    return (tail, False) if tail.strip() else (_read_tail(run_dir / STDOUT_FILE, LOG_TAIL_BYTES), True)


def _number(value: object) -> TypeGuard[float]:
    """Whether a record file's field is a finite number (an integer beyond a float's range is none: a
    task-written 10**400 raised OverflowError in `math.isfinite`)."""
    return math.isfinite(value) if isinstance(value, float) else _int(value) is not None


def _int(value: object) -> int | None:
    """An integer field of a record file, None when absent, not an integer or beyond any pid, tick or status."""
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53 else None


def groups_of(job: JobSpec) -> list[int]:
    """The supplementary groups the job's user has (none for a uid without a user name)."""
    try:
        return os.getgrouplist(pwd.getpwuid(job.uid).pw_name, job.gid)
    except KeyError:
        return []


def closed_to_others() -> Path | None:
    """The first of the daemon's interpreter, standard library, site-packages and carma package that a user
    other than the owner cannot reach, or None. A root daemon starts every task's shim with that interpreter
    as the task's owner: installed under /root (mode 0700), it can run no other user's task."""
    python = Path(sys.executable)
    return first_closed(
        [python, python.resolve(), Path(os.__file__).parent, Path(sysconfig.get_paths()["purelib"]), *carma.__path__]
    )


def first_closed(paths: Sequence[str | Path]) -> Path | None:
    """The first folder on the way to one of `paths` that others cannot enter (no o+x), or path itself that
    they cannot read and enter or run (no o+rx)."""
    for path in map(Path, paths):
        for folder in reversed(path.parents):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return folder
        if os.stat(path).st_mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
            return path
    return None
