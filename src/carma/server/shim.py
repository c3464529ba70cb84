"""The per-task supervisor: `python -m carma.server.shim RUN_DIR [--shell] -- ARGV...` (Linux only).

The executor starts it in a new session, so the shim leads the task's session and process group and the
daemon can signal the whole task with one `killpg`. The shim outlives the daemon: it records its identity
in `shim.json` before starting the task, and the task's exit in `exit.json` when it ends, so a restarted
daemon can re-adopt a running task or learn how it ended while nobody watched.

Environment and user are the shim's own (the executor sets them); the task inherits them. The shim enters
the task's working directory itself (`--workdir`), as the user: a root daemon's `chdir` before the switch to
the user would put the task inside a folder the user could never reach, below a parent closed to them.
SIGTERM and SIGINT only mark the shim as cancelled: the same group signal reaches the task, and the shim must
survive it to record the exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from carma.server import proctree
from carma.userfiles import hand_to_owner, open_for_reading, owners_of

SHIM_FILE = "shim.json"
EXIT_FILE = "exit.json"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
ABANDONED = "abandoned"  # key of the marker the daemon leaves in place of shim.json (see `claim`)
ADMITS = "admits"  # the marker's key naming the one launch that may take the run dir over (see `claim`)
RECORD_BYTES = 64 << 10  # a record is a few hundred bytes: a larger file is none
LAUNCHED_AT = "CARMA_LAUNCHED_AT"  # the task's environment variable: the Unix time the daemon launched it


def _write_temp(path: Path, data: dict[str, object]) -> Path:
    """Write `data` to a fresh, uniquely named file beside `path` (never through a planted symlink). A root
    daemon's record in a task's run dir is the run dir owner's, as the shim's own are: the shim, as that user,
    reads only such records (and could not read root's)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            hand_to_owner(f.fileno(), path.parent)
            json.dump(data, f)
    except BaseException:  # a full disk: no half-written temporary file left behind
        os.unlink(tmp)
        raise
    return Path(tmp)


def write_json_atomically(path: Path, data: dict[str, object]) -> None:
    """Write `path` whole or not at all (temp file + rename), so a reader never sees half a record."""
    os.replace(_write_temp(path, data), path)


def claim(path: Path, data: dict[str, object], launch: str | None = None) -> bool:
    """Create `path` with `data` atomically, unless it already exists.

    The shim and a restarting daemon race for shim.json: the shim to record that it started the task, the
    daemon to mark an attempt it gave up on as abandoned. Exactly one wins, so a task the daemon
    considers never started cannot start later. The daemon places such a task again in the same run dir,
    and lets that new launch in: the marker then admits its `launch` token, which a late shim of the
    abandoned launch does not have.
    """
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        if launch is None or (read_json(path) or {}).get(ADMITS) != launch:
            return False
        os.replace(tmp, path)  # one launch holds the token: nobody else replaces the marker
        return True
    finally:
        tmp.unlink(missing_ok=True)


def read_json(
    path: Path, raising: Collection[int] = (), owners: Collection[int] | None = None
) -> dict[str, object] | None:
    """A record file, or None when it is missing, unreadable, not a plain file of the run dir's owner (or of
    `owners`; the daemon may read it as root: see `carma.userfiles`; never half-written: written atomically)
    or not a record (over `RECORD_BYTES`, as a sparse file of a terabyte a task can make for nothing; nested
    past the parser's depth), except for an OSError whose errno is in `raising`. Linked twice is allowed:
    `claim` links its record in place before removing the temporary name."""
    try:
        with open_for_reading(path, owners_of(path.parent) if owners is None else owners, single_link=False) as f:
            text = f.read(RECORD_BYTES + 1)
        data = json.loads(text) if len(text) <= RECORD_BYTES else None
    except OSError as e:
        if e.errno in raising:
            raise
        return None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def parse_args(args: list[str]) -> argparse.Namespace:
    """Split `RUN_DIR [--shell] [--launch TOKEN] [--unset NAME]... -- ARGV...`; everything after `--` is the
    task's, untouched (`argv`)."""
    parser = argparse.ArgumentParser(prog="python -m carma.server.shim", description="Run and record one task.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--shell", action="store_true", help="run ARGV joined by spaces through /bin/sh -c")
    parser.add_argument("--launch", help="this launch's token, which an abandoned run dir's marker may admit")
    parser.add_argument("--workdir", help="the directory to run the task in (entered as the user)")
    parser.add_argument("--unset", action="append", default=[], help="a variable to keep out of the task's environment")
    if "--" not in args or args.index("--") == len(args) - 1:
        parser.error("the task's command must follow '--'")
    cut = args.index("--")
    options = parser.parse_args(args[:cut])
    options.argv = args[cut + 1 :]
    return options


def command(argv: list[str], shell: bool) -> list[str]:
    """The argv to execute: the task's own, or one shell command line made of its words."""
    return ["/bin/sh", "-c", " ".join(argv)] if shell else argv


def record_exit(run_dir: Path, exit_code: int | None, sig: int | None) -> None:
    """Write exit.json; on a full disk say so and go on: the shim's own exit status still tells the daemon
    (its parent) how the task ended, where an exception made a task that succeeded read as failed."""
    try:
        write_json_atomically(run_dir / EXIT_FILE, {"exit_code": exit_code, "signal": sig, "ended_at": time.time()})
    except OSError as e:  # unbuffered: a line left in sys.stderr's buffer would fail again at exit (status 120)
        with contextlib.suppress(OSError):
            os.write(2, f"carma: could not record how the task ended: {e.strerror}\n".encode())


def run(
    run_dir: Path, argv: list[str], launch: str | None = None, unset: Sequence[str] = (), workdir: str | None = None
) -> int:
    """Start the task (in `workdir`, in the shim's environment less `unset`), wait for it, record how it ended;
    return the shim's own exit status."""
    cancelled = []
    for signum in (signal.SIGTERM, signal.SIGINT):  # a handler, not SIG_IGN: exec resets handlers only
        signal.signal(signum, lambda sig, _frame: cancelled.append(sig))
    me = {"pid": os.getpid(), "start_ticks": proctree.start_ticks(os.getpid()), "started_at": time.time()}
    if not claim(run_dir / SHIM_FILE, me, launch):
        print("carma: the daemon abandoned this attempt before it started; not running it", file=sys.stderr)
        return 1
    if cancelled:  # cancelled before the task existed: the group signal had nobody else to reach
        record_exit(run_dir, None, cancelled[0])
        return 128 + cancelled[0]
    with open(run_dir / STDOUT_FILE, "ab") as out, open(run_dir / STDERR_FILE, "ab") as err:
        try:
            if workdir is not None:
                os.chdir(workdir)
        except OSError as exc:
            err.write(f"carma: cannot enter the working directory {workdir!r}: {exc.strerror}\n".encode())
            record_exit(run_dir, 126, None)
            return 126
        try:
            env = {name: value for name, value in os.environ.items() if name not in unset}
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            directory = isinstance(exc, PermissionError) and "/" in argv[0] and os.path.isdir(argv[0])
            why = "it is a directory" if directory else exc.strerror  # Linux says only EACCES
            err.write(f"carma: cannot run {argv[0]!r}: {why}\n".encode())
            record_exit(run_dir, code, None)
            return code
    returncode = child.wait()
    if returncode < 0:
        record_exit(run_dir, None, -returncode)
    else:
        record_exit(run_dir, returncode, None)
    end_stragglers()
    return returncode if returncode >= 0 else 128 - returncode


def end_stragglers() -> None:
    """Kill what the task left running in its group (background processes holding GPU memory, say).

    The task has ended and its exit is recorded; anything still in the group would keep resources the
    scheduler now considers free. `killpg` reaches them atomically, and the shim with them.
    """
    if proctree.group_members(os.getpgrp()) - {os.getpid()}:
        os.killpg(os.getpgrp(), signal.SIGKILL)


def main(args: list[str] | None = None) -> int:
    options = parse_args(sys.argv[1:] if args is None else args)
    return run(options.run_dir, command(options.argv, options.shell), options.launch, options.unset, options.workdir)


if __name__ == "__main__":
    sys.exit(main())
