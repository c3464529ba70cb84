"""How long a task is expected to run, from the daemon's history: the median run time (launch to exit, the
daemon's clock) of the earlier successful runs of the same command (argv, workdir, shell), as `--estimate
history` takes a need from them. It is the daemon's duration port for backfilling
(`carma.core.backfill.DurationOf`) and the horizon of the growth prediction on MIG instances
(`carma.core.early.Remaining`). A command never run to success has no expected duration: it is neither
backfilled nor restarted early.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from carma.core.types import ExitKind, Task, TaskId
from carma.server.spec import JobSpec
from carma.server.store import Store

Command = tuple[tuple[str, ...], str, bool]


class HistoryDurations:
    """Run times by command, read from the store incrementally (only attempts ended since the last read)."""

    def __init__(self, store: Store, jobs: Mapping[TaskId, JobSpec]) -> None:
        self._store = store
        self._jobs = jobs
        self._runs: dict[Command, list[float]] = {}
        self._since: float | None = None  # the latest end read so far
        self._at_since: set[tuple[object, object]] = set()  # the (task, attempt)s that ended then, counted

    def __call__(self, task: Task) -> float | None:
        """The task's expected run time, or None when no earlier run of its command succeeded."""
        job = self._jobs.get(task.id)
        if job is None:
            return None
        self._read()
        runs = self._runs.get((tuple(job.argv), job.workdir, job.shell))
        return statistics.median(runs) if runs else None

    def remaining(self, task: Task, now: float) -> float | None:
        """Seconds a running task has left by its expected run time (None: not known, or not running)."""
        attempt, expected = task.current, self(task)
        if attempt is None or expected is None:
            return None
        return max(0.0, expected - (now - attempt.dispatched_s))

    def _read(self) -> None:
        for run in self._store.history(self._since):
            key, ended = (run["task_id"], run["attempt"]), float(run["ended_s"])  # type: ignore[arg-type]
            if ended == self._since and key in self._at_since:
                continue  # read last time: the query takes the instant of the latest end again
            if self._since is None or ended > self._since:
                self._since, self._at_since = ended, set()
            self._at_since.add(key)
            if run["outcome"] == ExitKind.SUCCESS.value:
                command = (tuple(run["command"]), str(run["workdir"]), bool(run["shell"]))  # type: ignore[call-overload]
                self._runs.setdefault(command, []).append(float(run["exec_s"]))  # type: ignore[arg-type]
