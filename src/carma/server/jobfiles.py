"""The files a job's estimate depends on, read as the job's user, off the scheduling loop.

A root daemon that read them itself would tell a user what they may not read (the first word of a closed
file's `#!` line, whether a closed file changed), and a file that blocks its reader (a FUSE mount, a hung
NFS home) would block the daemon. So they are read in a child process, running as the task's owner under
a root daemon, killed after a timeout or when the daemon stops. Only a digest and the interpreter come
back: the estimate cache's key is made by the caller, with the user in it, so
whatever a user makes their own child answer can only shape their own jobs' estimates.

Run as `python -I -m carma.server.jobfiles` it reads one user's jobs (JSON on stdin) and writes their
`JobFiles`: one child for up to `READ_AT_ONCE` jobs a user submitted at once, or a restarted daemon found queued.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from carma.estimate.base import EstimateError
from carma.estimate.script import interpreter, parse_argv
from carma.server.spec import JobSpec
from carma.units import cut
from carma.userfiles import open_for_reading

SCRIPT_BYTES = 16 << 20  # how much of the script file goes into the digest
SOURCE_DEPTH = 3  # how many folders below the script's its modules are looked for in
FOLDER_ENTRIES = 1000  # a folder with more entries holds data, not code
SCANNED = 20_000  # the most folder entries looked at for one job
SKIPPED = {"__pycache__", "node_modules", "site-packages", "build", "dist"}  # folders of no training code
NAMED_FILES = 64  # how many of a command's arguments are looked at as files it may read its settings from
SETTINGS_SUFFIXES = {".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".conf", ".py"}  # not logs or checkpoints
READERS = 4  # threads reading jobs' files, apart from the captures' workers
READ_AT_ONCE = 10  # the most jobs of one user read in one child (its timeout is for them all)
TIMEOUT_S = 30.0  # for the child: a file that blocks its reader fails the estimates, not the daemon
STOP_POLL_S = 0.5  # how often a read under way asks whether the daemon is stopping
ANSWER_BYTES = 64 << 10  # the most of the child's answer read, per job
REASON_CHARS = 300  # the most of a failure's reason kept


@dataclass(frozen=True)
class JobFiles:
    """What a job's files say for its estimate: the Python the task would run (None: carma's own) and a digest
    of its script, the size and time of each Python file around it and of the settings files its command names."""

    python: str | None
    digest: str


def read(job: JobSpec) -> JobFiles:
    """Read the job's files with this process's rights."""
    python = interpreter(job.argv, job.workdir, job.env.get("PATH", os.defpath))
    digest = hashlib.sha256()
    found = None if job.shell else _script(job)
    if found is not None:
        script, root = found
        with suppress(OSError), open_for_reading(Path(os.path.realpath(script)), single_link=False) as f:
            digest.update(f.read(SCRIPT_BYTES))
        for path in _sources(root):
            _stamp(digest, path, path.relative_to(root))
    for path in _named_files(job):
        _stamp(digest, path, path)
    return JobFiles(python, digest.hexdigest())


def read_in_child(
    jobs: Sequence[JobSpec],
    extra_groups: Sequence[int] | None = None,
    timeout_s: float = TIMEOUT_S,
    stopped: Callable[[], bool] = lambda: False,
) -> list[JobFiles | str]:
    """Read the files of one owner's jobs in a child process, as that user when `extra_groups` is given (the
    jobs' uid and gid, and those groups: a root daemon's reads), as their tasks would find them. Each job's
    `JobFiles`, or why its files could not be read; EstimateError when the child could not tell for any (it
    could not start, took over `timeout_s`, or `stopped` said so, which is asked every half second)."""
    job = jobs[0]
    if any((other.uid, other.gid) != (job.uid, job.gid) for other in jobs):
        raise ValueError("the jobs of one owner are read together, never another's")
    who = job.user or str(job.uid)
    as_owner = extra_groups is not None
    asked = [{"argv": list(j.argv), "workdir": j.workdir, "shell": j.shell, "path": j.env.get("PATH")} for j in jobs]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=out,  # files, not pipes: the child is the user's, and may say as much as it likes
                stderr=err,
                cwd="/",
                env={"PATH": os.defpath},
                start_new_session=True,
                user=job.uid if as_owner else None,
                group=job.gid if as_owner else None,
                extra_groups=extra_groups if as_owner else None,
            )
        except OSError as e:
            raise EstimateError(f"could not start {sys.executable} as {who}: {e}") from None
        _wait(child, json.dumps(asked).encode(), time.monotonic() + timeout_s, stopped, f"took over {timeout_s:g} s")
        out.seek(0)
        answer = _answer(out.read(ANSWER_BYTES * len(jobs)), len(jobs))
        if answer is None:
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - ANSWER_BYTES))
            lines = err.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {child.returncode}"
            raise EstimateError(f"reading the job's files as {who} failed: {cut(why, REASON_CHARS)}")
    return answer


class Readers:
    """Reads jobs' files in the background (`read_in_child`), on `READERS` threads: up to `READ_AT_ONCE` jobs
    of one user per child, and one child per user at a time, so that a user whose reads hang holds up no
    other user's. `groups` gives the supplementary groups of a job's user, whose reads then run as that user
    (a root daemon's); None: with this process's rights."""

    def __init__(self, groups: Callable[[JobSpec], Sequence[int]] | None) -> None:
        self._groups = groups
        self._pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="carma-jobfiles")
        self._unread: list[tuple[JobSpec, Future[JobFiles]]] = []  # what no reader has taken up yet
        self._users_read: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def ask(self, job: JobSpec) -> Future[JobFiles]:
        """The job's files, once read (EstimateError when they could not be); cancel it when no longer needed."""
        future: Future[JobFiles] = Future()
        with self._lock:
            self._unread.append((job, future))
        self._pool.submit(self._read_unread)
        return future

    def close(self) -> None:
        """Read no more; a read under way kills its child within `STOP_POLL_S`."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _read_unread(self) -> None:
        with self._lock:
            user = next((job.uid for job, _ in self._unread if job.uid not in self._users_read), None)
            if user is None or self._closed:
                return
            gid = next(job.gid for job, _ in self._unread if job.uid == user)  # one child runs as one uid and gid
            taken = [entry for entry in self._unread if (entry[0].uid, entry[0].gid) == (user, gid)][:READ_AT_ONCE]
            gone = {id(future) for _, future in taken}
            self._unread = [entry for entry in self._unread if id(entry[1]) not in gone]
            self._users_read.add(user)
        try:
            self._read(taken)
        finally:
            with self._lock:
                self._users_read.discard(user)
                more = bool(self._unread) and not self._closed
            if more:  # of this user's, waiting while these were read
                with suppress(RuntimeError):  # closed meanwhile
                    self._pool.submit(self._read_unread)

    def _read(self, taken: list[tuple[JobSpec, Future[JobFiles]]]) -> None:
        jobs = [(job, future) for job, future in taken if future.set_running_or_notify_cancel()]  # not cancelled
        if not jobs:
            return
        try:
            groups = None if self._groups is None else self._groups(jobs[0][0])  # may fail: sssd or LDAP down
            found = read_in_child([job for job, _ in jobs], groups, stopped=lambda: self._closed)
        except Exception as e:  # EstimateError, or a reader's bug: those jobs' reads fail, the daemon goes on
            for _, future in jobs:
                future.set_exception(e)
            return
        for (_, future), files in zip(jobs, found, strict=True):
            if isinstance(files, str):
                future.set_exception(EstimateError(f"its files could not be read ({files})"))
            else:
                future.set_result(files)


def _wait(
    child: subprocess.Popen[bytes], asked: bytes, deadline: float, stopped: Callable[[], bool], late: str
) -> None:
    """Hand the child `asked` and wait for it to end; killed past `deadline` or once `stopped()`."""
    given: bytes | None = asked
    while True:
        try:
            child.communicate(given, timeout=max(0.0, min(STOP_POLL_S, deadline - time.monotonic())))
            return
        except subprocess.TimeoutExpired:
            given = None  # the rest of it is still handed on: communicate remembers where it was
            if not stopped() and time.monotonic() < deadline:
                continue
            os.killpg(child.pid, signal.SIGKILL)  # not yet waited for: its number is still its own
            with suppress(subprocess.TimeoutExpired):
                child.wait(STOP_POLL_S)
            raise EstimateError("the daemon stopped" if stopped() else f"reading the job's files {late}") from None


def _answer(text: bytes, jobs: int) -> list[JobFiles | str] | None:
    """The child's answer for its `jobs`, if it is one (the child runs as the user, who may make it say anything)."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, list) or len(answer) != jobs:
        return None
    found: list[JobFiles | str] = []
    for files in answer:
        if not isinstance(files, dict):
            return None
        python, digest, error = files.get("python"), files.get("digest"), files.get("error")
        if isinstance(error, str):
            found.append(cut(error, REASON_CHARS))
        elif (python is None or isinstance(python, str)) and isinstance(digest, str):
            found.append(JobFiles(python, digest))
        else:
            return None
    return found


def _stamp(digest: hashlib._Hash, path: Path, name: Path) -> None:
    """Add a file's name, size and time to the digest (a file gone since it was listed adds nothing)."""
    with suppress(OSError):
        stat = path.stat()
        digest.update(f"{name} {stat.st_size} {stat.st_mtime_ns}".encode(errors="surrogateescape"))


def _named_files(job: JobSpec) -> list[Path]:
    """The settings files the command's arguments name (`config.yaml`, `--config=big.yaml`), relative to its
    folder: by their suffix, not a log or checkpoint the job itself rewrites (each run would change the key)."""
    found = []
    for word in job.argv[1:NAMED_FILES]:
        name = word.partition("=")[2] if word.startswith("-") else word
        path = Path(job.workdir, name) if name else None
        with suppress(OSError, ValueError):
            if path is not None and path.suffix.lower() in SETTINGS_SUFFIXES and path.is_file():
                found.append(path)
    return found


def _script(job: JobSpec) -> tuple[Path, Path] | None:
    """The file the command runs and the folder its own modules are in: (`train.py`, its folder) for
    `python train.py`, (`pkg/train.py`, the working directory) for `python -m pkg.train` when the package
    is there; None for code given inline, a module installed elsewhere, or a script its user cannot reach."""
    try:
        kind, what, _ = parse_argv(list(job.argv), job.workdir)
        if kind == "path":
            script = Path(job.workdir, what)
            return script, script.parent
        if kind == "module":
            module = Path(job.workdir, *what.split("."))
            found = next((p for p in (module.with_suffix(".py"), module / "__main__.py") if p.is_file()), None)
            return None if found is None else (found, Path(job.workdir))
    except (EstimateError, OSError):
        return None
    return None


def _sources(root: Path) -> list[Path]:
    """The Python files in `root` and the folders below it (`SOURCE_DEPTH` deep), in a fixed order. Hidden
    folders, caches, virtual environments and folders of more than `FOLDER_ENTRIES` entries (data, not
    code) are left out, and the walk stops after `SCANNED` entries: it runs for every task submitted."""
    found: list[Path] = []
    level, budget = [root], SCANNED
    for depth in range(SOURCE_DEPTH + 1):
        below: list[Path] = []
        for folder in level:
            try:
                with os.scandir(folder) as scan:
                    entries = sorted(itertools.islice(scan, FOLDER_ENTRIES + 1), key=lambda e: e.name)
            except OSError:
                continue
            budget -= len(entries)  # read, if left out too: a tree of large folders cost the walk its bound
            if budget < 0:
                return found
            if len(entries) > FOLDER_ENTRIES or any(e.name == "pyvenv.cfg" for e in entries):
                continue
            found += (Path(e.path) for e in entries if e.name.endswith(".py") and e.is_file())
            if depth < SOURCE_DEPTH:
                below += (Path(e.path) for e in entries if _code_folder(e))
        level = below
    return found


def _code_folder(entry: os.DirEntry[str]) -> bool:
    return entry.is_dir(follow_symlinks=False) and entry.name[0] != "." and entry.name not in SKIPPED


def _main() -> None:
    answer: list[dict[str, object]] = []
    for asked in json.load(sys.stdin):
        env = {} if asked["path"] is None else {"PATH": asked["path"]}
        job = JobSpec("", tuple(asked["argv"]), asked["workdir"], shell=asked["shell"], env=env)
        try:
            answer.append(asdict(read(job)))
        except Exception as e:  # this job's files, not the others'
            answer.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    _main()
