"""The daemon's state directory kept whole: no silent fresh start over earlier state, and a backup.

A database missing or empty beside earlier state (run dirs, task ids handed out, a backup) stops the start:
an empty server would drop every task without a word, hand their ids out again, and let a new task meet an
old one's run dir. A backup of the database is kept beside it, made at start and every `BACKUP_EVERY_S`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

from carma.server.faults import WORLD_FAULTS, FaultLog
from carma.server.paths import Paths
from carma.server.store import Store, StoreError, backup_path, recovery

log = logging.getLogger("carma.server")

BACKUP_EVERY_S = 6 * 3600.0
BACKUP_RETRY_S = 600.0  # after a backup that failed (a full disk, say)


def fresh(database: Path) -> str | None:
    """Says "missing" or "empty" for a database that holds nothing yet (no file, no bytes, no carma tables);
    None for one that holds something, or is not a database at all (opening it says what is wrong)."""
    if not os.path.lexists(database):
        return "missing"
    if not database.is_file():  # a directory, a FIFO (whose open would block): not probed here
        return None
    if database.stat().st_size == 0:
        return "empty"
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            tables = db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'tasks'").fetchone()[0]
    except sqlite3.DatabaseError:
        return None
    return None if tables else "empty"


def earlier_state(paths: Paths) -> str | None:
    """What in the state dir shows that a daemon kept tasks there before (None: nothing does). Tokens, the
    lock, fake GPUs and logs do not: a daemon that never took a task leaves those too."""
    if paths.tasks.is_dir() and any(paths.tasks.iterdir()):
        return f"the run dirs under {paths.tasks}"
    if paths.ids.exists() and paths.ids.read_text().strip() not in ("", "1"):
        return f"{paths.ids}, which says task ids were handed out"
    for left in (backup_path(paths.database), paths.database.with_name(paths.database.name + "-wal")):
        if left.exists():
            return str(left)
    return None


def first_free_id(paths: Paths) -> int:
    """The least task id whose run dir does not exist: a new task never meets an earlier one's files."""
    try:
        names = os.listdir(paths.tasks)
    except FileNotFoundError:
        return 1
    return 1 + max((int(name) for name in names if name.isdigit()), default=0)


def open_store(paths: Paths, *, readonly: bool = False, faults: FaultLog | None = None) -> Store:
    """The daemon's store, refused (StoreError, one line) when it is missing or empty beside earlier state,
    or damaged."""
    database = paths.database
    try:
        if (state := fresh(database)) and (earlier := earlier_state(paths)):
            raise StoreError(
                f"{database} is {state}, but {paths.home} holds earlier state ({earlier}): {recovery(database)}"
            )
        first_id = first_free_id(paths)
    except OSError as e:  # the state dir unreadable, say
        raise StoreError(f"{paths.home}: cannot read the state directory ({e.strerror or e})") from None
    return Store(database, ids=paths.ids, first_id=first_id, readonly=readonly, faults=faults)


def make_backup(database: Path, to: Path) -> None:
    """Copy `database` to `to` with SQLite's backup API (a consistent copy while the daemon writes); the
    copy replaces `to` only once whole, checked and on disk, so a failure keeps the last good backup. Raises
    StoreError for a database found damaged."""
    temporary = to.with_name(to.name + ".tmp")
    try:
        temporary.unlink(missing_ok=True)
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # tasks' environments: 0600
        with (
            closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as source,
            closing(sqlite3.connect(temporary)) as copy,
        ):
            source.backup(copy)
            problem = copy.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            raise StoreError(f"{database} is damaged (quick_check: {' '.join(problem.split())}): {to} was kept")
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, to)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class Backups:
    """The database's backup beside it, made at start and every `every_s` in a thread of its own (the API
    and the scheduling loop go on meanwhile); `step` starts a backup when one is due and reports how the
    last one went."""

    WHERE = "backing up the database"

    def __init__(self, database: Path, faults: FaultLog, every_s: float = BACKUP_EVERY_S) -> None:
        self.database = database
        self.path = backup_path(database)
        self._faults = faults
        self._every_s = every_s
        self._due = time.monotonic()  # at start
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def step(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                return
            self._thread, error, self._error = None, self._error, None
            if error is None:
                self._faults.cleared(self.WHERE)
            elif isinstance(error, StoreError):
                log.error("%s: %s", self.WHERE, error)
            else:
                self._faults.failed(self.WHERE, error)
            if error is not None:
                self._due = time.monotonic() + BACKUP_RETRY_S
        if self._thread is None and time.monotonic() >= self._due:
            self._due = time.monotonic() + self._every_s
            self._thread = threading.Thread(target=self._copy, name="carma-backup", daemon=True)
            self._thread.start()

    def _copy(self) -> None:
        try:
            make_backup(self.database, self.path)
        except (*WORLD_FAULTS, sqlite3.DatabaseError, StoreError) as e:
            self._error = e
