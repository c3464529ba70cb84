"""The daemon's history by command: what the earlier successful runs of the same command (its user, argv, workdir,
shell) showed, read from the store incrementally (only the attempts ended since the last read), so that the history
estimate of every waiting task at every scheduling step, and every expected duration, costs a lookup.

It answers three ports: the peak memory behind `--estimate history` (the server's default estimator); a task's
expected run time, the median of those runs' (launch to exit, the daemon's clock), which backfilling
(`carma.core.backfill.DurationOf`) and the growth prediction on MIG instances (`carma.core.early.Remaining`)
take; and its expected activity, the median SMACT, SMOCC and DRAMA of the runs it made alone on its GPUs (the
means telemetry saw while its processes were on them), which `warmup_risk` adds to a GPU's scores while the
task warms up (`carma.core.risk.ActivityOf`), and with their GRACT the load interference-aware pairing weighs
(`carma.core.policies.pair.PairingModel`, the twin's fitted interference model). A command never run to success
has none of them: it runs recovery only, is not backfilled, not restarted early, adds nothing to the risk
filter before it shows, and pairing cannot tell what it costs.

The user is part of the command: another user's runs of the same argv in the same directory (a shared
project folder) never shape a job's estimate, whose MPS memory limit a too low peak would turn into a crash,
nor its expected run time and activity.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from carma.core.risk import METRICS, Activity
from carma.core.types import ExitKind, Task, TaskId
from carma.server.spec import JobSpec
from carma.server.store import Store
from carma.sim.models import Load

Command = tuple[str, tuple[str, ...], str, bool]


def command_of(job: JobSpec) -> Command:
    return job.user, tuple(job.argv), job.workdir, job.shell


@dataclass
class Runs:
    """The successful runs of one command: their run times, the peaks observed (a run may have none), and the
    activity of those it made alone (shared runs show their co-runners' too), with their GRACT where the GPU
    gave it."""

    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    alone: list[Activity] = field(default_factory=list)
    gract: list[float] = field(default_factory=list)


class CommandHistory:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._runs: dict[Command, Runs] = {}
        self._since: float | None = None  # the latest end read so far
        self._at_since: set[tuple[object, object]] = set()  # the (task, attempt)s that ended then, counted
        self._read_after = -1  # the store's write count when last read: nothing can have ended since

    def runs(self, job: JobSpec) -> Runs:
        """The job's command's successful runs so far."""
        self._read()
        return self._runs.get(command_of(job), Runs())

    def _read(self) -> None:
        if self._store.writes == self._read_after:
            return
        self._read_after = self._store.writes
        for run in self._store.history(self._since):
            key, ended = (run["task_id"], run["attempt"]), float(run["ended_s"])  # type: ignore[arg-type]
            if ended == self._since and key in self._at_since:
                continue  # read last time: the query takes the instant of the latest end again
            if self._since is None or ended > self._since:
                self._since, self._at_since = ended, set()
            self._at_since.add(key)
            if run["outcome"] == ExitKind.SUCCESS.value:
                command = (str(run["user"]), tuple(run["command"]), str(run["workdir"]), bool(run["shell"]))  # type: ignore[call-overload]
                runs = self._runs.setdefault(command, Runs())
                runs.times.append(float(run["exec_s"]))  # type: ignore[arg-type]
                if run["peak_mib"]:
                    runs.peaks.append(int(run["peak_mib"]))  # type: ignore[call-overload]
                means = [run[f"{metric}_mean"] for metric in METRICS]
                if not run["shared"] and None not in means:
                    runs.alone.append(Activity(*map(float, means)))  # type: ignore[arg-type]
                    if run["gract_mean"] is not None:
                        runs.gract.append(float(run["gract_mean"]))  # type: ignore[arg-type]


class HistoryHints:
    """A task's expected run time and activity from its command's history (the daemon's duration and activity
    ports)."""

    def __init__(self, history: CommandHistory, jobs: Mapping[TaskId, JobSpec]) -> None:
        self._history = history
        self._jobs = jobs
        self._activity: dict[Command, tuple[int, Activity]] = {}  # per command: over how many runs, the medians
        self._gract: dict[Command, tuple[int, float]] = {}  # the same, of GRACT

    def duration(self, task: Task) -> float | None:
        """The run time its submitter declared, else the median run time of its command's successful runs; None
        when there is neither."""
        job = self._jobs.get(task.id)
        if job is not None and job.duration_s is not None:
            return job.duration_s
        times = self._history.runs(job).times if job is not None else []
        return statistics.median(times) if times else None

    def remaining(self, task: Task, now: float) -> float | None:
        """Seconds a running task has left by its expected run time (None: not known, or not running)."""
        attempt, expected = task.current, self.duration(task)
        if attempt is None or expected is None:
            return None
        return max(0.0, expected - (now - attempt.dispatched_s))

    def activity(self, task: Task) -> Activity | None:
        """Each metric's median over its command's successful runs alone on their GPUs; None without one."""
        job = self._jobs.get(task.id)
        alone = self._history.runs(job).alone if job is not None else []
        if not alone or job is None:
            return None
        command = command_of(job)
        counted, medians = self._activity.get(command, (0, None))
        if counted != len(alone) or medians is None:  # asked for each warming task at every decision
            medians = Activity(*(statistics.median(getattr(a, m) for a in alone) for m in METRICS))
            self._activity[command] = len(alone), medians
        return medians

    def load(self, task: Task) -> Load | None:
        """Its activity with the median GRACT of the same runs alone; None without one (a GPU that gives no
        GRACT: neither GPM nor DCGM)."""
        activity = self.activity(task)
        job = self._jobs.get(task.id)
        gract = self._history.runs(job).gract if job is not None else []
        if activity is None or not gract or job is None:
            return None
        command = command_of(job)
        counted, median = self._gract.get(command, (0, 0.0))
        if counted != len(gract):  # asked for each task on each candidate GPU at every placement
            median = statistics.median(gract)
            self._gract[command] = len(gract), median
        return Load(median, activity.smact, activity.smocc, activity.drama)
