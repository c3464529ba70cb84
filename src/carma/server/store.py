"""The daemon's durable state: one SQLite file in WAL mode.

Every accepted task is inserted before it is acknowledged, and every state change and placement is
written (`save`, the core's Journal port) before the daemon acts on it. Commits are synchronous (FULL),
so an acknowledged task survives the daemon being killed and the machine losing power.

A file that is not a sound database stops the open with a `StoreError`, one line naming the file, SQLite's
complaint and how to recover. Task ids are also kept in a small file beside the database (`ids`), so that
a database replaced (restored from a backup, say) never hands out an id again. What is only a cache or an
archive (estimates, GPU samples, what telemetry saw) is written on a best-effort basis: while the disk is
full those writes are reported and dropped, never raised into the scheduling loop.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from carma.core.risk import METRICS
from carma.core.types import Attempt, ExitKind, MemoryNeed, NeedKind, TargetId, Task, TaskId, TaskState
from carma.estimate.base import Estimate
from carma.server.faults import FaultLog, no_space, one_line
from carma.server.spec import JobSpec

log = logging.getLogger("carma.server")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    id INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    uid INTEGER NOT NULL,
    user TEXT NOT NULL,
    submit_s REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    ended_s REAL
);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state);
CREATE TABLE IF NOT EXISTS attempts (
    task_id INTEGER NOT NULL REFERENCES tasks (id),
    number INTEGER NOT NULL,
    gpus TEXT NOT NULL,
    dispatched_s REAL NOT NULL,
    exclusive INTEGER NOT NULL,
    recovery INTEGER NOT NULL,
    first_kernel_s REAL,
    ended_s REAL,
    outcome TEXT,
    message TEXT NOT NULL DEFAULT '',
    need TEXT,
    shared INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    start_ticks INTEGER,
    run_dir TEXT,
    peak_mib INTEGER,
    smact_mean REAL,
    smocc_mean REAL,
    drama_mean REAL,
    observed_samples INTEGER,
    restart_mib INTEGER,
    gract_mean REAL,
    PRIMARY KEY (task_id, number)
);
CREATE INDEX IF NOT EXISTS attempts_ended ON attempts (ended_s);  -- the history read since its last end
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    task_id INTEGER NOT NULL,
    state TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_task ON events (task_id);
CREATE TABLE IF NOT EXISTS estimates (
    fingerprint TEXT PRIMARY KEY,
    method TEXT NOT NULL,
    device TEXT NOT NULL,
    peak_bytes INTEGER NOT NULL,
    breakdown TEXT NOT NULL,
    seconds REAL NOT NULL,
    t REAL NOT NULL,
    notes TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS task_estimates (
    task_id INTEGER PRIMARY KEY REFERENCES tasks (id),
    fingerprint TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gpu_samples (
    gpu TEXT NOT NULL,
    t REAL NOT NULL,
    used_mib INTEGER NOT NULL,
    total_mib INTEGER NOT NULL,
    smact REAL,
    smocc REAL,
    drama REAL,
    power_w REAL,
    energy_j REAL,
    temperature_c REAL,
    PRIMARY KEY (t, gpu)
);
CREATE TABLE IF NOT EXISTS mig_reconfigurations (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    gpu TEXT NOT NULL,
    destroyed TEXT NOT NULL,
    created TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS mig_reconfigurations_t ON mig_reconfigurations (t);  -- the timeline's window
"""
# columns added since the first release, for databases that predate them
ADDED_COLUMNS = {
    "attempts": {
        "peak_mib": "INTEGER",
        "smact_mean": "REAL",
        "smocc_mean": "REAL",
        "drama_mean": "REAL",
        "observed_samples": "INTEGER",
        "restart_mib": "INTEGER",
        "gract_mean": "REAL",
    },
    "estimates": {"notes": "TEXT NOT NULL DEFAULT '[]'"},
}
SCHEMA_VERSION = 2  # 2: attempts and samples name their targets by id (1: by the GPU's index at the time)
SERIES_FIELDS = ("used_mib", "total_mib", "smact", "smocc", "drama", "power_w", "energy_j", "temperature_c")
MERGED = {  # how samples merge into a longer step (`Reads.gpu_series`); avg leaves out what is missing
    "used_mib": "max",
    "total_mib": "max",
    "smact": "avg",
    "smocc": "avg",
    "drama": "avg",
    "power_w": "avg",
    "energy_j": "min",  # a counter: its reading at the step's time, its first sample
    "temperature_c": "max",
}


@dataclass(frozen=True)
class Spawn:
    """The process of an attempt, as the executor recorded it."""

    pid: int
    start_ticks: int
    run_dir: str


OBSERVED = (*METRICS, "gract")  # the means an `Observation` keeps: the risk rule's metrics, the interference model's


@dataclass(frozen=True)
class Observation:
    """What the telemetry saw of an attempt: its processes' peak GPU memory, the metrics it ran under."""

    peak_mib: int
    smact_mean: float | None
    smocc_mean: float | None
    drama_mean: float | None
    samples: int = 0  # the samples the means are over: a restarted daemon goes on averaging from there
    gract_mean: float | None = None


@dataclass(frozen=True)
class Reconfiguration:
    """A MIG reconfiguration as the timeline shows it: when it ended, on which GPU, the instances (`profile@start`)
    it destroyed and created, `done`, `refused` (a step the GPU refused: `reason` says which) or `interrupted` (the
    daemon stopped midway; its next start ended it consistent, as `reason` says)."""

    t_s: float
    gpu: TargetId
    destroyed: tuple[str, ...]
    created: tuple[str, ...]
    outcome: str
    reason: str | None = None


@dataclass(frozen=True)
class StoredTask:
    task: Task
    job: JobSpec
    spawns: dict[int, Spawn]  # attempt number -> its process
    observed: dict[int, Observation]  # attempt number -> what telemetry saw of it (so far, for a live one)


class StoreError(Exception):
    """The database cannot be used: one line naming the file, what is wrong, and what to do."""


def backup_path(path: Path) -> Path:
    """Where the periodic backup of the database at `path` is kept."""
    return path.with_name(path.name + ".backup")


def recovery(path: Path) -> str:
    """What to do about a database that cannot be used: restore the backup if there is one (its -wal and -shm
    files go first: SQLite would replay them onto the restored file), else start over in a new state dir."""
    home, backup = path.parent, backup_path(path)
    again = f"or move {home} aside (mv {home} {home}.old) to start with no tasks"
    if not backup.is_file():
        return f"restore it from a backup of yours, {again}"
    return f"restore the backup (rm -f {path}-wal {path}-shm && cp {backup} {path}), {again}"


def damaged(path: Path, problem: str) -> StoreError:
    problem = " ".join(problem.split())  # SQLite's checks answer on several lines
    return StoreError(f"{path}: {problem}: {recovery(path)}; `carma server --check` verifies it")


def opening_failed(path: Path, exc: BaseException) -> StoreError:
    """The one line for a database that fails to open: full disk, no access, or damage."""
    if (full := no_space_left(path.parent, exc)) is not None:
        return full
    if isinstance(exc, PermissionError) or getattr(exc, "sqlite_errorname", "") == "SQLITE_CANTOPEN":
        return StoreError(
            f"{path}: cannot open it ({one_line(exc)}): the daemon's user must be able to read and write it"
        )
    if isinstance(exc, OSError | sqlite3.OperationalError):  # locked, an I/O error: not the file's content
        return StoreError(f"{path}: {one_line(exc)}")
    return damaged(path, f"the database is damaged ({one_line(exc)})")


def no_space_left(home: Path, exc: BaseException) -> StoreError | None:
    """The one line for a start that failed for lack of space under `home` (None if it was not that): the
    daemon does not start, as it could not record what it does."""
    if not (no_space(exc) or _no_room(home)):
        return None
    return StoreError(f"no space left under {home} ({one_line(exc)}): free some, then start again")


def _no_room(directory: Path) -> bool:
    """Whether `directory`'s file system has (almost) no space left: SQLite reports some writes that failed
    for lack of space as a "disk I/O error"."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < 1 << 20


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`, whole or not at all, and durably (a crash leaves the old or the new)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk keeps no half-written file
        raise


class Reads:
    """The queries that answer requests, on the daemon's connection (a `Store`) or on one of their own
    (`Store.apart`), which a thread may use while the daemon writes."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def history(self, since_s: float | None = None, limit: int | None = None) -> list[dict[str, object]]:
        """Ended attempts, oldest first: the runs' observed memory and metrics (for refits and estimates); the
        newest `limit` of them with a limit. Of each job only what a run is listed with is read: not its
        environment, which may hold megabytes."""
        rows = self._db.execute(
            """SELECT a.task_id, a.number, json_extract(t.job, '$.name'), json_extract(t.job, '$.user'),
                      json_extract(t.job, '$.argv'), json_extract(t.job, '$.workdir'), json_extract(t.job, '$.shell'),
                      json_extract(t.job, '$.mem_mib'), t.state, a.gpus, a.dispatched_s, a.first_kernel_s, a.ended_s,
                      a.outcome, a.need, a.shared, a.peak_mib, a.smact_mean, a.smocc_mean, a.drama_mean, a.gract_mean
               FROM attempts a JOIN tasks t ON t.id = a.task_id
               WHERE a.ended_s IS NOT NULL AND a.ended_s >= ?
               ORDER BY a.ended_s DESC, a.task_id DESC, a.number DESC LIMIT ?""",
            (since_s if since_s is not None else float("-inf"), -1 if limit is None else limit),
        ).fetchall()
        out = []
        for row in reversed(rows):
            (task_id, number, name, user, argv, workdir, shell, mem_mib, state, gpus, start, first, end, outcome, need,
             shared, peak, smact, smocc, drama, gract) = row  # fmt: skip
            placed = _need(need)
            out.append(
                {
                    "task_id": task_id,
                    "attempt": number,
                    "name": name,
                    "user": user,
                    "command": json.loads(argv),
                    "workdir": workdir,
                    "shell": bool(shell),
                    "state": state,
                    "outcome": outcome,
                    "gpus": json.loads(gpus),
                    "mem_mib": mem_mib,
                    "need_mib": placed.mib if placed else None,  # the memory it was placed with
                    "need": placed.kind.value if placed else None,
                    "need_source": placed.source if placed else None,
                    "dispatched_s": start,
                    "first_kernel_s": first,
                    "ended_s": end,
                    "exec_s": end - start,
                    "shared": bool(shared),  # another task or process was on its GPUs at some point
                    "peak_mib": peak,
                    "smact_mean": smact,
                    "smocc_mean": smocc,
                    "drama_mean": drama,
                    "gract_mean": gract,
                }
            )
        return out

    def gpu_series(
        self, since_s: float, until_s: float | None = None, step_s: float | None = None
    ) -> dict[TargetId, dict[str, list]]:
        """Per target, the archived samples in [since_s, until_s] as columns: {"t": [...], "used_mib": [...],
        ...}; with `step_s`, merged into steps of that many seconds as the archive merges samples into buckets
        (the most memory used, mean activity and power, the highest temperature), each at the time of its first
        bucket, with the energy counter as it read then."""
        window = (since_s, until_s if until_s is not None else float("inf"))
        if step_s is None:
            query = (
                f"SELECT gpu, t, {', '.join(SERIES_FIELDS)} FROM gpu_samples WHERE t >= ? AND t <= ? ORDER BY t, gpu"
            )
            rows = self._db.execute(query, window)
        else:
            merged = ", ".join(f"{MERGED[f]}({f})" for f in SERIES_FIELDS)
            query = f"""SELECT gpu, min(t), {merged} FROM gpu_samples WHERE t >= ? AND t <= ?
                        GROUP BY gpu, CAST(t / ? AS INTEGER) ORDER BY 2, gpu"""
            rows = self._db.execute(query, (*window, step_s))
        out: dict[TargetId, dict[str, list]] = {}
        for gpu, t, *values in rows:
            series = out.setdefault(gpu, {"t": [], **{f: [] for f in SERIES_FIELDS}})
            series["t"].append(t)
            for field, value in zip(SERIES_FIELDS, values, strict=True):
                series[field].append(value)
        return out


class Store(Reads):
    """The database at `path`. `ids` is the file that keeps the next task id beside it, and `first_id` the
    least id it may hand out (above the run dirs already on disk); `readonly` opens it to look only, for a
    check while a daemon may run."""

    def __init__(
        self,
        path: Path,
        *,
        ids: Path | None = None,
        first_id: TaskId = 1,
        readonly: bool = False,
        faults: FaultLog | None = None,
    ) -> None:
        self.path = path
        self._ids = ids
        self._faults = faults or FaultLog(log)
        self.writes = 0  # transactions committed: a reader that caches what it read reads again only after one
        try:
            self._db = self._connect(path, readonly)
            problem = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                self._db.close()
                raise damaged(path, f"the database is damaged (quick_check: {problem})")
            if not readonly:
                self._db.executescript(SCHEMA)
                self._migrate()
            self._states: dict[TaskId, str] = dict(self._db.execute("SELECT id, state FROM tasks"))
            newest = self._db.execute("SELECT max(id) FROM tasks").fetchone()[0] or 0
            kept = int(self.meta("next_id", 1))  # type: ignore[call-overload]
        except (sqlite3.DatabaseError, OSError) as e:
            raise opening_failed(path, e) from None
        # ids are never handed out twice: not those of forgotten tasks (`next_id` in the database), nor those
        # of tasks whose database was replaced (the ids file, the run dirs)
        self._next_id = max(newest + 1, kept, self._kept_id(), first_id)

    @staticmethod
    def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open for good
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise StoreError(f"{path} is {kind}, not a database: move it aside, then {recovery(path)}")
        if readonly:
            return sqlite3.connect(
                f"{path.absolute().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
            )
        # the daemon's alone: tasks' environments live here. SQLite gives its -wal and -shm files the
        # database's mode; the chmods take access away from others in files made before this rule (and
        # never give any: a file made unreadable stays so, and is reported)
        path.touch(mode=0o600)
        for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if file.exists() and (mode := stat.S_IMODE(file.stat().st_mode)) & 0o077:
                file.chmod(mode & 0o700)
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        return db

    def _kept_id(self) -> TaskId:
        if self._ids is None or not self._ids.exists():
            return 1
        text = self._ids.read_text().strip()
        if not text.isdigit():
            raise StoreError(f"{self._ids}: not a task id ({text[:20]!r}): write the next task id into it")
        return int(text)

    def check(self) -> str:
        """SQLite's full integrity check ("ok" when sound), for `carma server --check`."""
        return "; ".join(row[0] for row in self._db.execute("PRAGMA integrity_check(5)"))

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        self.writes += 1

    @contextmanager
    def _best_effort(self, what: str) -> Iterator[None]:
        """For writes the daemon can go without (caches, archives): a failure to write is reported, not
        raised, so that a full disk never stops the scheduling loop over them."""
        with self._faults.guard(f"saving {what}"):
            yield

    def _migrate(self) -> None:
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        if int(self.meta("schema", 1)) < 2:  # type: ignore[call-overload]
            with self._transaction() as db:
                _name_targets(db, self.meta("gpus", []))  # type: ignore[arg-type]
                self._set_meta(db, "schema", SCHEMA_VERSION)

    def close(self) -> None:
        self._db.close()

    # ----------------------------------------------------------------- writing

    def add(self, job: JobSpec, submit_s: float) -> TaskId:
        """Record a newly accepted job as queued; returns its id."""
        task_id = self._next_id
        if self._ids is not None:  # before the task: an id the file does not cover is never handed out
            write_atomically(self._ids, f"{task_id + 1}\n")
        with self._transaction() as db:
            db.execute(
                "INSERT INTO tasks (id, job, uid, user, submit_s, state) VALUES (?, ?, ?, ?, ?, ?)",
                (task_id, json.dumps(asdict(job)), job.uid, job.user, submit_s, TaskState.QUEUED.value),
            )
            db.execute("INSERT INTO events (t, task_id, state) VALUES (?, ?, ?)", (submit_s, task_id, "queued"))
        self._next_id += 1
        self._states[task_id] = TaskState.QUEUED.value
        return task_id

    def save(self, tasks: Sequence[Task], observed: Mapping[tuple[TaskId, int], Observation] | None = None) -> None:
        """Persist the tasks' states and attempts (the core's Journal port), and what telemetry saw of
        attempts (by task and attempt number); one transaction."""
        states: dict[TaskId, str] = {}
        with self._transaction() as db:
            for task in tasks:
                db.execute(
                    "UPDATE tasks SET state = ?, reason = ?, cancel_requested = ?, ended_s = ? WHERE id = ?",
                    (task.state.value, task.reason, int(task.cancel_requested), task.ended_s, task.id),
                )
                for a in task.attempts:
                    db.execute(
                        """INSERT INTO attempts (task_id, number, gpus, dispatched_s, exclusive, recovery,
                               first_kernel_s, ended_s, outcome, message, need, shared, restart_mib)
                           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                           ON CONFLICT (task_id, number) DO UPDATE SET first_kernel_s = excluded.first_kernel_s,
                               ended_s = excluded.ended_s, outcome = excluded.outcome, message = excluded.message,
                               shared = excluded.shared, restart_mib = excluded.restart_mib""",
                        (
                            task.id,
                            a.number,
                            json.dumps(a.gpus),
                            a.dispatched_s,
                            int(a.exclusive),
                            int(a.recovery),
                            a.first_kernel_s,
                            a.ended_s,
                            a.outcome.value if a.outcome else None,
                            a.message,
                            json.dumps(asdict(a.need)) if a.need else None,
                            int(a.shared),
                            a.restart_mib,
                        ),
                    )
                if self._states.get(task.id) != task.state.value:
                    states[task.id] = task.state.value
                    t = _last_time(task)
                    db.execute(
                        "INSERT INTO events (t, task_id, state, detail) VALUES (?, ?, ?, ?)",
                        (t, task.id, task.state.value, _event_detail(task)),
                    )
            for (task_id, attempt), seen in (observed or {}).items():
                self._observe(db, task_id, attempt, seen)
        self._states.update(states)  # once written: a save that failed writes its events when it is retried

    def record_spawn(self, task_id: TaskId, attempt: int, spawn: Spawn) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE attempts SET pid = ?, start_ticks = ?, run_dir = ? WHERE task_id = ? AND number = ?",
                (spawn.pid, spawn.start_ticks, spawn.run_dir, task_id, attempt),
            )

    def record_observation(self, task_id: TaskId, attempt: int, seen: Observation) -> None:
        """Keep what telemetry saw of a live attempt so far (best effort: it is saved again later)."""
        with self._best_effort("what telemetry saw of running tasks"), self._transaction() as db:
            self._observe(db, task_id, attempt, seen)

    @staticmethod
    def _observe(db: sqlite3.Connection, task_id: TaskId, attempt: int, seen: Observation) -> None:
        db.execute(
            """UPDATE attempts SET peak_mib = ?, smact_mean = ?, smocc_mean = ?, drama_mean = ?, gract_mean = ?,
               observed_samples = ? WHERE task_id = ? AND number = ?""",
            (
                *(seen.peak_mib, seen.smact_mean, seen.smocc_mean, seen.drama_mean, seen.gract_mean),
                seen.samples,
                task_id,
                attempt,
            ),
        )

    def add_gpu_samples(
        self, rows: Sequence[tuple[TargetId, float, dict[str, float | None]]], keep_after_s: float
    ) -> None:
        """Archive (gpu, t, values) rows, and forget those from before `keep_after_s`."""
        columns = ", ".join(SERIES_FIELDS)
        marks = ", ".join("?" for _ in SERIES_FIELDS)
        with self._best_effort("the GPU sample archive"), self._transaction() as db:
            db.executemany(
                f"INSERT OR REPLACE INTO gpu_samples (gpu, t, {columns}) VALUES (?, ?, {marks})",
                [(gpu, t, *(values[f] for f in SERIES_FIELDS)) for gpu, t, values in rows],
            )
            db.execute("DELETE FROM gpu_samples WHERE t < ?", (keep_after_s,))

    def end_reconfiguration(self, r: Reconfiguration, keep_after_s: float | None, journal: str) -> None:
        """Keep a journaled MIG reconfiguration and clear its journal (the meta key `journal`) in one transaction:
        a daemon killed between the two would find it still journaled at its next start and keep it twice."""
        with self._transaction() as db:
            self._add_reconfiguration(db, r, keep_after_s)
            self._set_meta(db, journal, None)

    @staticmethod
    def _add_reconfiguration(db: sqlite3.Connection, r: Reconfiguration, keep_after_s: float | None) -> None:
        db.execute(
            "INSERT INTO mig_reconfigurations (t, gpu, destroyed, created, outcome, reason) VALUES (?, ?, ?, ?, ?, ?)",
            (r.t_s, r.gpu, json.dumps(r.destroyed), json.dumps(r.created), r.outcome, r.reason),
        )
        if keep_after_s is not None:
            db.execute("DELETE FROM mig_reconfigurations WHERE t < ?", (keep_after_s,))

    def add_estimate(self, fingerprint: str, estimate: Estimate, t: float) -> None:
        """Keep a job's memory estimate, so the same job is not estimated again (after a restart too; best
        effort: one not kept is made again)."""
        with self._best_effort("memory estimates"), self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO estimates (fingerprint, method, device, peak_bytes, breakdown, seconds, t, "
                "notes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (fingerprint, estimate.method, estimate.device, estimate.peak_bytes,
                 json.dumps(asdict(estimate.breakdown)), estimate.seconds, t, json.dumps(estimate.notes)),
            )  # fmt: skip

    def estimate(self, fingerprint: str) -> Estimate | None:
        row = self._db.execute(
            "SELECT method, device, peak_bytes, breakdown, seconds, notes FROM estimates WHERE fingerprint = ?",
            (fingerprint,),
        ).fetchone()
        if row is None:
            return None
        method, device, peak, breakdown, seconds, notes = row
        data = {"method": method, "device": device, "peak_bytes": peak}
        try:  # an earlier release kept what a capture child wrote unchecked: such a row is made again
            return Estimate.checked({**data, "breakdown": json.loads(breakdown), "notes": json.loads(notes)}, seconds)
        except ValueError:
            return None

    def link_estimate(self, task_id: TaskId, fingerprint: str) -> None:
        """Remember which estimate a task's placement uses, for `carma show` after a restart too; written
        only when it changed (a restart asks again for every queued task)."""
        if self._linked(task_id) == fingerprint:
            return
        with self._best_effort("memory estimates"), self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO task_estimates VALUES (?, ?)", (task_id, fingerprint))

    def task_estimate(self, task_id: TaskId) -> Estimate | None:
        fingerprint = self._linked(task_id)
        return None if fingerprint is None else self.estimate(fingerprint)

    def _linked(self, task_id: TaskId) -> str | None:
        row = self._db.execute("SELECT fingerprint FROM task_estimates WHERE task_id = ?", (task_id,)).fetchone()
        return None if row is None else row[0]

    def drop_attempt(self, task: Task, number: int) -> None:
        """Forget a placement whose process never started (the daemon died in between)."""
        with self._transaction() as db:
            db.execute("DELETE FROM attempts WHERE task_id = ? AND number = ?", (task.id, number))
        self.save([task])

    def forget(self, task_ids: Sequence[TaskId], counted: Mapping[str, int]) -> list[str]:
        """Delete ended tasks: their rows in every table, and the estimates no task left uses (their
        fingerprints are returned). What they counted is added to `forgotten()`, so the metrics' counters
        never go down; one transaction."""
        totals = Counter(self.forgotten()) + Counter(counted)
        unused = "SELECT fingerprint FROM estimates WHERE fingerprint NOT IN (SELECT fingerprint FROM task_estimates)"
        with self._transaction() as db:
            for table in ("events", "task_estimates", "attempts"):
                db.executemany(f"DELETE FROM {table} WHERE task_id = ?", [(i,) for i in task_ids])
            db.executemany("DELETE FROM tasks WHERE id = ?", [(i,) for i in task_ids])
            dropped = [fingerprint for (fingerprint,) in db.execute(unused)]
            db.executemany("DELETE FROM estimates WHERE fingerprint = ?", [(f,) for f in dropped])
            self._set_meta(db, "forgotten", dict(totals))
            self._set_meta(db, "next_id", self._next_id)
        for task_id in task_ids:
            self._states.pop(task_id, None)
        return dropped

    @property
    def next_id(self) -> TaskId:
        return self._next_id

    def forgotten(self) -> dict[str, int]:
        """What the tasks forgotten so far counted (by `forget`'s caller's keys)."""
        return dict(self.meta("forgotten", {}))  # type: ignore[call-overload]

    def set_meta(self, key: str, value: object) -> None:
        with self._transaction() as db:
            self._set_meta(db, key, value)

    @staticmethod
    def _set_meta(db: sqlite3.Connection, key: str, value: object) -> None:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    # ----------------------------------------------------------------- reading

    def meta(self, key: str, default: object = None) -> object:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @contextmanager
    def apart(self) -> Iterator[Reads]:
        """The reads on a connection of their own, for a thread, while the daemon writes on its own."""
        db = self._connect(self.path, readonly=True)
        try:
            yield Reads(db)
        finally:
            db.close()

    def reconfigurations(self, since_s: float) -> list[Reconfiguration]:
        """The MIG reconfigurations that ended at `since_s` or later, oldest first."""
        rows = self._db.execute(
            "SELECT t, gpu, destroyed, created, outcome, reason FROM mig_reconfigurations WHERE t >= ? ORDER BY t, id",
            (since_s,),
        )
        return [
            Reconfiguration(t, gpu, tuple(json.loads(destroyed)), tuple(json.loads(created)), outcome, reason)
            for t, gpu, destroyed, created, outcome, reason in rows
        ]

    def environment(self, task_id: TaskId) -> dict[str, str]:
        """The environment a task was submitted with (the daemon keeps ended tasks' here only)."""
        row = self._db.execute("SELECT job FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return dict(_job(row[0]).env) if row else {}

    def load(self) -> list[StoredTask]:
        """Every task with its job and attempts, in submission order (to restore the scheduler); a row that
        cannot be read raises StoreError."""
        try:
            return self._load()
        except (sqlite3.DatabaseError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise damaged(self.path, f"a task cannot be read ({type(e).__name__}: {one_line(e)})") from None

    def _load(self) -> list[StoredTask]:
        attempts: dict[TaskId, list[tuple[Attempt, Spawn | None, Observation | None]]] = {}
        rows = self._db.execute("SELECT * FROM attempts ORDER BY task_id, number")
        columns = [d[0] for d in rows.description]  # by name: a database not migrated yet (`--check`) lacks some
        for row in rows:
            attempt = dict(zip(columns, row, strict=True))
            attempts.setdefault(attempt["task_id"], []).append(_attempt(attempt))
        out = []
        for task_id, job, _, _, submit_s, state, reason, cancel, ended_s in self._db.execute(
            "SELECT * FROM tasks ORDER BY id"
        ):
            rows = attempts.get(task_id, [])
            task = Task(
                task_id,
                _job(job).task_spec(),
                submit_s,
                TaskState(state),
                [a for a, _, _ in rows],
                reason,
                bool(cancel),
                ended_s,
            )
            spawns = {a.number: s for a, s, _ in rows if s is not None}
            observed = {a.number: o for a, _, o in rows if o is not None}
            out.append(StoredTask(task, _job(job), spawns, observed))
        return out


def _job(text: str) -> JobSpec:
    data = json.loads(text)
    return JobSpec(**{**data, "argv": tuple(data["argv"])})


def _need(text: str | None) -> MemoryNeed | None:
    if not text:
        return None
    data = json.loads(text)
    return MemoryNeed(NeedKind(data["kind"]), data["mib"], data["source"], data.get("partial", False))


def _attempt(row: Mapping[str, Any]) -> tuple[Attempt, Spawn | None, Observation | None]:
    """An attempt's row, by column name; a column added since (`ADDED_COLUMNS`) may be missing."""
    attempt = Attempt(
        number=row["number"],
        gpus=tuple(json.loads(row["gpus"])),
        dispatched_s=row["dispatched_s"],
        exclusive=bool(row["exclusive"]),
        recovery=bool(row["recovery"]),
        first_kernel_s=row["first_kernel_s"],
        ended_s=row["ended_s"],
        outcome=ExitKind(row["outcome"]) if row["outcome"] else None,
        message=row["message"],
        need=_need(row["need"]),
        shared=bool(row["shared"]),
        restart_mib=row.get("restart_mib"),
    )
    spawn = Spawn(row["pid"], row["start_ticks"], row["run_dir"]) if row["pid"] is not None else None
    seen = row.get("peak_mib")
    means = {f"{m}_mean": row.get(f"{m}_mean") for m in OBSERVED}
    observed = Observation(seen, **means, samples=row.get("observed_samples") or 0) if seen is not None else None
    return attempt, spawn, observed


def _name_targets(db: sqlite3.Connection, uuids: Sequence[str]) -> None:
    """Name the GPUs of a first-release database by id: its attempts and samples give the GPU's index, which
    `uuids` (the GPUs its daemon last started with, in index order) turns into that GPU's UUID. An index
    beyond them (none in a database the daemon wrote) keeps a name that says what it was."""

    def target(index: int) -> TargetId:
        return uuids[index] if 0 <= index < len(uuids) else f"gpu-index-{index}"

    for task_id, number, gpus in db.execute("SELECT task_id, number, gpus FROM attempts").fetchall():
        named = [target(g) if isinstance(g, int) else g for g in json.loads(gpus)]
        db.execute(
            "UPDATE attempts SET gpus = ? WHERE task_id = ? AND number = ?", (json.dumps(named), task_id, number)
        )
    rows = db.execute("SELECT rowid, gpu FROM gpu_samples WHERE typeof(gpu) = 'integer'").fetchall()
    for rowid, gpu in rows:
        db.execute("UPDATE gpu_samples SET gpu = ? WHERE rowid = ?", (target(gpu), rowid))


def _last_time(task: Task) -> float:
    if task.ended_s is not None:
        return task.ended_s
    a = task.current
    if a is None:
        return task.submit_s
    return a.ended_s or a.first_kernel_s or a.dispatched_s


def _event_detail(task: Task) -> str:
    a = task.current
    if task.state is TaskState.DISPATCHED and a:
        return f"attempt {a.number} on GPU {','.join(a.gpus)}" + (" (recovery)" if a.recovery else "")
    if task.state is TaskState.OOM_CRASHED and a:
        return a.message
    return task.reason
