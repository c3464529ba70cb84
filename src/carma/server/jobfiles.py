"""The files a job's estimate depends on, read as the job's user, off the scheduling loop.

A root daemon that read them itself would tell a user what they may not read (the first word of a closed
file's `#!` line, whether a closed file changed), and a file that blocks its reader (a FUSE mount, a hung
NFS home) would block the daemon. So a root daemon reads them in a child process running as the task's
owner, with a timeout; a daemon running as a user reads them in a worker thread. Either way only a digest
and the interpreter come back: the estimate cache's key is made by the caller, with the user in it, so
whatever a user makes their own child answer can only shape their own jobs' estimates.

Run as `python -I -m carma.server.jobfiles` it reads one user's jobs (JSON on stdin) and writes their
`JobFiles`: one child for all the jobs a user submitted at once, or a restarted daemon found queued.
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
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from carma.estimate.base import EstimateError
from carma.estimate.script import interpreter, parse_argv
from carma.server.spec import JobSpec
from carma.userfiles import open_for_reading

SCRIPT_BYTES = 16 << 20  # how much of the script file goes into the digest
SOURCE_DEPTH = 3  # how many folders below the script's its modules are looked for in
FOLDER_ENTRIES = 1000  # a folder with more entries holds data, not code
SCANNED = 20_000  # the most folder entries looked at for one job
SKIPPED = {"__pycache__", "node_modules", "site-packages", "build", "dist"}  # folders of no training code
NAMED_FILES = 64  # how many of a command's arguments are looked at as files it may read its settings from
SETTINGS_SUFFIXES = {".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".conf", ".py"}  # not logs or checkpoints
TIMEOUT_S = 30.0  # for the owner's child: a file that blocks its reader fails the estimate, not the daemon
ANSWER_BYTES = 64 << 10  # the most of the child's answer read


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


def read_as(jobs: Sequence[JobSpec], extra_groups: Sequence[int], timeout_s: float = TIMEOUT_S) -> list[JobFiles]:
    """Read the files of one owner's jobs in a child process running as that user (the first job's uid and gid,
    and `extra_groups`), as their tasks would find them; EstimateError when the child could not tell (it could
    not start, timed out)."""
    job = jobs[0]
    if any((other.uid, other.gid) != (job.uid, job.gid) for other in jobs):
        raise ValueError("the jobs of one owner are read together, never another's")
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
                user=job.uid,
                group=job.gid,
                extra_groups=list(extra_groups),
                start_new_session=True,
            )
        except OSError as e:
            raise EstimateError(f"could not start {sys.executable} as {job.user or job.uid}: {e}") from None
        try:
            child.communicate(json.dumps(asked).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # not yet waited for: its number is still its own
            with suppress(subprocess.TimeoutExpired):
                child.wait(timeout_s)
            raise EstimateError(f"reading the job's files as {job.user or job.uid} took over {timeout_s:g} s") from None
        out.seek(0)
        answer = _answer(out.read(ANSWER_BYTES * len(jobs)), len(jobs))
        if answer is None:
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - ANSWER_BYTES))
            lines = err.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {child.returncode}"
            raise EstimateError(f"reading the job's files as {job.user or job.uid} failed: {why}")
    return answer


def _answer(text: bytes, jobs: int) -> list[JobFiles] | None:
    """The child's answer for its `jobs`, if it is one (the child runs as the user, who may make it say anything)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return None
    if not isinstance(answer, list) or len(answer) != jobs:
        return None
    found = []
    for files in answer:
        python, digest = (files.get("python"), files.get("digest")) if isinstance(files, dict) else (None, None)
        if not (python is None or isinstance(python, str)) or not isinstance(digest, str):
            return None
        found.append(JobFiles(python, digest))
    return found


def _stamp(digest: hashlib._Hash, path: Path, name: Path) -> None:
    """Add a file's name, size and time to the digest (a file gone since it was listed adds nothing)."""
    with suppress(OSError):
        stat = path.stat()
        digest.update(f"{name} {stat.st_size} {stat.st_mtime_ns}".encode())


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
    answer = []
    for asked in json.load(sys.stdin):
        env = {} if asked["path"] is None else {"PATH": asked["path"]}
        job = JobSpec("", tuple(asked["argv"]), asked["workdir"], shell=asked["shell"], env=env)
        answer.append(asdict(read(job)))
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    _main()
