"""The daemon's world: the decision core driven by the wall clock, real processes and a GPU backend.

One asyncio thread runs both the HTTP API and the scheduling loop, so the core is never touched
concurrently. On start the daemon restores every task from the store: waiting tasks rejoin their queue,
live processes are re-adopted, and exits that happened while it was down are read from the tasks'
exit-status files, so no task is lost or run twice.

Faults of the world (a full disk, no file descriptors left) never stop the scheduling loop: each part of a
step that meets one reports it (`FaultLog`, not once a second) and is tried again at the next step; the
journal catches up once it can write (`SchedulingLoop`). Requests that must write are refused meanwhile
(`StoreUnavailable`: 507 for a full disk), while the tasks already accepted are placed and ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

from carma.config import EstimateConfig
from carma.core.config import SchedulerConfig
from carma.core.early import EarlyRestarts
from carma.core.loop import JournalError, SchedulingLoop
from carma.core.mig.control import MigControl
from carma.core.mig.scheduling import MigConfig, mig_scheduler
from carma.core.scheduler import Scheduler, SpecError
from carma.core.types import ACTIVE_STATES, Launch, NeedKind, TargetId, Task, TaskId, TaskState
from carma.server import workdirs
from carma.server.adapters import BackendTelemetry, Journal, RunRecorder
from carma.server.archive import SampleArchive
from carma.server.estimates import Estimates, device_for
from carma.server.executor import ProcessExecutor, SpawnRecord
from carma.server.faults import WORLD_FAULTS, FaultLog, StoreUnavailable
from carma.server.history import HistoryHints
from carma.server.metrics import counted, decision_histogram
from carma.server.mig import MigManager
from carma.server.mps import MpsControl, MpsError, client_limits
from carma.server.paths import Paths
from carma.server.spec import JobSpec
from carma.server.state import Backups, open_store
from carma.server.store import Spawn, Store, StoredTask, no_space_left
from carma.sim.hints import pairing as hints_pairing
from carma.sim.models import calibrated_interference
from carma.telemetry import GpuBackend
from carma.units import pluralize

log = logging.getLogger("carma.server")

OBSERVATIONS_SAVE_S = 60.0  # how often what telemetry saw of live tasks is saved (wall seconds; and at a stop)
PEAK_SAVE_S = 5.0  # sooner when a live task's peak grew: a kill -9 lost the peak of tasks that ended meanwhile
FORGET_EVERY_S = 60.0  # how often ended tasks past their retention are looked for (the daemon's clock seconds)
WAITING_STATES = frozenset({TaskState.QUEUED, TaskState.RECOVERING, TaskState.OOM_CRASHED})
FORGET_BATCH = 500  # the most tasks forgotten in one scheduling step (their rows and log folders deleted)


def placements_held(store: Store) -> int:
    """How many stored tasks hold GPUs (dispatched or running): a restart must see those GPUs again."""
    return sum(stored.task.state in ACTIVE_STATES for stored in store.load())


def _check_declared(job: JobSpec, capacity_mib: int) -> None:
    """Refuse a declared memory need no GPU could hold (`capacity_mib`: the most each of the job's GPUs has),
    as sbatch refuses a request no node meets: placed on a whole GPU it would only run out of memory, and its
    relaunch would wait for a larger GPU that is not there. An estimate that large still gets a whole GPU."""
    if job.mem_mib is None or job.mem_mib <= capacity_mib:
        return
    has = "any GPU of this server has" if job.gpus == 1 else f"the {job.gpus} largest GPUs of this server have each"
    need, most = f"{job.mem_mib / 1024:.2f} GiB", f"{capacity_mib / 1024:.2f} GiB"
    if need == most:  # rounded alike ("40.00 GiB, more than ... 40.00 GiB"): the MiB say which is larger
        need, most = f"{job.mem_mib} MiB", f"{capacity_mib} MiB"
    raise SpecError(f"task {job.name!r} needs {need} of GPU memory per GPU, more than {has} ({most})")


class DaemonClock:
    """The scheduler's time base: wall-clock seconds, or sped up by `scale` for fake GPUs.

    The origin is persisted, so a restarted daemon's clock continues where the old one would be.
    """

    def __init__(self, scale: float, origin_wall: float, origin: float) -> None:
        if not 0 < scale < math.inf:
            raise ValueError(f"time scale must be positive and finite, got {scale}")
        self.scale = scale
        self._origin_wall = origin_wall
        self._origin = origin

    def now(self) -> float:
        return self.to_clock(time.time())

    def to_clock(self, wall_s: float) -> float:
        return self._origin + (wall_s - self._origin_wall) * self.scale


class Daemon:
    def __init__(
        self,
        paths: Paths,
        backend: GpuBackend,
        config: SchedulerConfig,
        time_scale: float = 1.0,
        extra_env: Mapping[str, str] | None = None,
        grace_s: float = 10.0,
        mps: MpsControl | None = None,
        estimate: EstimateConfig | None = None,
        keep_ended_s: float | None = None,
        mig: MigConfig | None = None,
        mig_control: MigControl | None = None,
        sharing: str | None = None,
    ) -> None:
        """`mig_control`: how MIG instances are made and destroyed, given with `mig.dynamic` (`--mig dynamic`);
        `sharing`: how tasks on one GPU share it, for the interference model of `pair` (fake GPUs: theirs; real
        ones: MPS under `mps`, else time-slicing)."""
        self.paths = paths
        self.keep_ended_s = keep_ended_s  # None: every task is kept
        self.backend = backend
        self.faults = FaultLog(log)
        self.store = open_store(paths, faults=self.faults)
        with self._starting():
            self.clock = self._clock(time_scale)
        self.mig = (
            MigManager(mig_control, self.store, backend.refresh, self.faults, self.clock.now, keep_ended_s)
            if mig_control
            else None
        )
        if self.mig is not None:
            with self._starting():
                for line in self.mig.start():
                    log.warning("%s", line)
        self.gpus = list(backend.gpus())
        if not self.gpus:  # GPUs in MIG mode list none until instances are made
            raise ValueError(
                "no GPU or MIG instance to run tasks on: a GPU in MIG mode has none until they are made (an admin "
                "makes them: nvidia-smi mig -cgi PROFILES -C; or --mig dynamic, and carma makes them as tasks need)"
            )
        with self._starting():
            stored = self.store.load()  # read once: checked against the GPUs here, restored below
            self._check_gpus(stored)
        # each task's job; an ended task's without its environment, which the store keeps (views read it there)
        self.jobs: dict[TaskId, JobSpec] = {}
        self.estimates = Estimates(
            self.store, self.jobs, device_for(self.gpus), run_as_owner=os.geteuid() == 0, config=estimate
        )
        hints = self.hints = HistoryHints(self.estimates.history, self.jobs)
        # a task's memory settles within CARMA's monitoring window after its first kernel: the growth fit leaves
        # that window out (the twin knows each job's own warm-up)
        settling = config.window_s
        if self.mig is not None:
            mig = mig or MigConfig("dynamic")
            early = EarlyRestarts(hints.remaining, lambda task: settling, instances=mig.predict)
            self.scheduler = mig_scheduler(
                self.gpus, config, self.estimates, self.mig.geometries, mig, early, hints.duration, hints.activity
            )
        else:
            early = EarlyRestarts(hints.remaining, lambda task: settling, instances=False)
            pairing = hints_pairing(calibrated_interference(), sharing or ("mps" if mps else "timeslice"), hints.load)
            self.scheduler = Scheduler(
                self.gpus,
                config,
                self.estimates,
                durations=hints.duration,
                pairing=pairing,
                early=early,
                activity=hints.activity,
            )
        self.mps = mps
        self.executor = ProcessExecutor(
            home=paths.home,
            jobs=self.jobs.__getitem__,
            to_clock=self.clock.to_clock,
            extra_env=extra_env,
            run_as_owner=os.geteuid() == 0,
            grace_s=grace_s,
            on_spawn=self._on_spawn,
            task_env=self._mps_env if mps else lambda task, launch: {},
            reconfigure=self.mig.reconfigure if self.mig is not None else None,
        )
        recorder = self.recorder = RunRecorder()
        self._observations_saved = time.monotonic()
        self._saved_peaks: dict[TaskId, int] = {}  # by `_save_observations`, to save a grown one soon
        self._forget_at = -math.inf  # the daemon's clock time of the next look for tasks to forget
        self._unrecorded: list[SpawnRecord] = []  # spawns the store failed to record, recorded at a later step
        self.backups = Backups(paths.database, self.faults)
        self.archive = SampleArchive(self.store)
        telemetry = BackendTelemetry(backend, self.executor.shim_pids, [recorder.observe, self.archive.observe])
        journal = self.journal = Journal(self.store, recorder, ended=self._keep_environments_stored)
        self.decision_seconds = decision_histogram()
        self.loop = SchedulingLoop(
            self.scheduler, self.clock, telemetry, self.executor, journal, self.decision_seconds.observe
        )
        self._draining = self.store.meta("draining", False) is True  # kept across restarts, as maintenance has one
        self.started = time.time()
        self.tcp: str | None = None  # the TCP address the API also listens on, if any (for the dashboard)
        self.tick = 0  # scheduling steps so far; live views wait for the next one
        self.closing = False
        self._ticked = asyncio.Event()
        with self._starting():
            self._restore(stored)

    # ----------------------------------------------------------------- set-up

    @contextmanager
    def _starting(self) -> Iterator[None]:
        """A start-up write that fails for lack of space stops the start with one line: started, the daemon
        could not record what it does."""
        try:
            yield
        except WORLD_FAULTS as e:
            if (full := no_space_left(self.paths.home, e)) is not None:
                self.store.close()
                raise full from None
            raise

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A request's write that the state cannot take now is refused as such (507 on a full disk)."""
        try:
            yield
        except (*WORLD_FAULTS, JournalError) as e:
            raise StoreUnavailable(self.paths.home, e.__cause__ if isinstance(e, JournalError) else e) from e

    def _clock(self, scale: float) -> DaemonClock:
        origin = self.store.meta("clock")
        if origin is None or origin["scale"] != scale:
            now = time.time()
            previous = DaemonClock(origin["scale"], origin["wall"], origin["clock"]).now() if origin else now
            origin = {"scale": scale, "wall": now, "clock": previous}
            self.store.set_meta("clock", origin)
        return DaemonClock(scale, origin["wall"], origin["clock"])

    @property
    def draining(self) -> bool:
        """No placements until `carma resume`, a restart between them included."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        with self._writing():
            self.store.set_meta("draining", value)
        self._draining = value

    def _check_gpus(self, stored_tasks: Sequence[StoredTask]) -> None:
        """A restarted daemon must see the targets its live placements are on. Others may come, go or change
        places: tasks and history are kept by target id, not by position."""
        uuids = [g.id for g in self.gpus]
        gone: dict[TargetId, list[TaskId]] = {}
        for stored in stored_tasks:
            if stored.task.state in ACTIVE_STATES and stored.task.current is not None:
                for target in stored.task.current.gpus:
                    if target not in uuids:
                        gone.setdefault(target, []).append(stored.task.id)
        if gone:
            held = "; ".join(f"{target} (task {', '.join(map(str, ids))})" for target, ids in gone.items())
            raise RuntimeError(
                f"GPUs that running tasks were placed on are gone since the last start: {held}; restore them or "
                "start with a new CARMA_HOME"
            )
        self.store.set_meta("gpus", uuids)

    def _restore(self, stored_tasks: Sequence[StoredTask]) -> None:
        for stored in stored_tasks:
            task = stored.task
            self.jobs[task.id] = stored.job if not task.terminal else replace(stored.job, env={})
            if task.state in WAITING_STATES:
                self._refuse_stale_run(task)
            if task.state in ACTIVE_STATES:
                self._readopt(task, stored.spawns.get(task.current.number))
            if task.state in ACTIVE_STATES and (seen := stored.observed.get(task.current.number)):
                self.recorder.resume(task.id, seen)
            ended = task.terminal
            self.scheduler.restore(task, self.clock.now())
            if task.terminal and not ended:
                log.warning("task %d failed: %s", task.id, task.reason)
            if task.state is TaskState.QUEUED:
                self.estimates.request(task.id, stored.job)

    def _keep_environments_stored(self, ended: Sequence[TaskId]) -> None:
        """Let go of the environments of ended tasks: the store keeps them (their owner's view reads them
        there), so a user's loop of submissions of 2 MB environments, each cancelled, grows the database only,
        never the daemon's memory."""
        for task_id in ended:
            if (job := self.jobs.get(task_id)) is not None and job.env:
                self.jobs[task_id] = replace(job, env={})

    def _refuse_stale_run(self, task: Task) -> None:
        """Fail a waiting task whose next attempt's run dir exists: that attempt ran, and the database does not
        know it (one restored from an older backup). Placed again it would meet the old run's files, and
        run a second time; its owner decides whether it should."""
        number = len(task.attempts) + 1
        run_dir = self.executor.run_dir(task.id, number)
        if not run_dir.exists():
            return
        task.state, task.ended_s = TaskState.FAILED, self.clock.now()
        task.reason = (
            f"attempt {number} ran without the database knowing (a database restored from an older backup?): "
            f"its files are in {run_dir}; submit the task again to run it again"
        )
        self.store.save([task])
        log.warning("task %d failed: %s", task.id, task.reason)

    def _readopt(self, task: Task, spawn: Spawn | None) -> None:
        attempt = task.current
        record = (
            SpawnRecord(task.id, attempt.number, spawn.pid, spawn.start_ticks, spawn.run_dir)
            if spawn
            else self.executor.recover_unrecorded(task.id, attempt.number)
        )
        if record is None:  # placed, but the daemon died before the process started: place it again
            task.attempts.pop()
            task.state = TaskState.RECOVERING if attempt.recovery else TaskState.QUEUED
            self.store.drop_attempt(task, attempt.number)
            return
        if spawn is None:
            self._on_spawn(record)
        self.executor.adopt(record)
        if task.cancel_requested:  # the old daemon's SIGTERM/SIGKILL escalation died with it
            self.executor.kill(task.id)

    def _mps_env(self, task: Task, launch: Launch) -> dict[str, str]:
        """An MPS client's variables with its limits; none on a MIG instance, which is never shared and which
        carma's one control daemon, started seeing every GPU, could not serve (CUDA enumerates one instance
        per process, MPS servers included)."""
        assert self.mps is not None
        if any(not self.scheduler.gpus[g].shareable for g in launch.gpus):
            return {}
        self._keep_mps_up()
        need = task.current.need
        known = need.mib if need is not None and need.kind is NeedKind.KNOWN else None
        margin = self.scheduler.config.margin_mib
        return {
            **self.mps.client_env(),
            **client_limits(known, margin, len(launch.gpus), self.jobs[task.id].mps_threads),
        }

    def _keep_mps_up(self) -> None:
        """Start carma's MPS control daemon again if it stopped (`carma mps stop`, a crash): a client that
        finds none runs without MPS, and so without its memory limit, silently."""
        assert self.mps is not None
        try:
            if not self.mps.status().running:
                log.warning("carma's MPS control daemon had stopped: starting it again")
                self.mps.start()
        except MpsError as e:
            log.error("MPS is unusable (%s): tasks run without it, and without their MPS memory limits", e)

    def _on_spawn(self, record: SpawnRecord) -> None:
        """Record a started attempt's process; kept to be recorded later when the store cannot write now (the
        shim's own record finds it again after a restart meanwhile)."""
        self._unrecorded.append(record)
        self._record_spawns()

    def _record_spawns(self) -> None:
        with self.faults.guard("recording started tasks"):
            while self._unrecorded:
                r = self._unrecorded[0]
                self.store.record_spawn(r.task_id, r.attempt, Spawn(r.pid, r.start_ticks, r.run_dir))
                self._unrecorded.pop(0)

    # ----------------------------------------------------------------- running

    @property
    def interval_wall_s(self) -> float:
        """Wall seconds between steps: one telemetry sample per GPU per scheduler second."""
        return self.scheduler.config.sample_interval_s / self.clock.scale

    def step(self) -> None:
        """One scheduling step. Each part stands alone: a fault of the world in one (a full disk, no file
        descriptors) is reported and that part tried again next step, and the others go on."""
        with self.faults.guard("collecting memory estimates"):
            self.estimates.collect()
        with self.faults.guard("the scheduling step"):
            self.loop.step(place=not self.draining)
        if self.loop.behind:
            self.faults.failed("saving task changes", self.journal.fault)
        else:
            self.faults.cleared("saving task changes")
        if self._unrecorded:
            self._record_spawns()
        since = time.monotonic() - self._observations_saved
        if since >= OBSERVATIONS_SAVE_S or (since >= PEAK_SAVE_S and self._peaks_grew()):
            self._save_observations()
        if self.keep_ended_s is not None and (now := self.clock.now()) >= self._forget_at:
            with self.faults.guard("forgetting ended tasks"):
                self._forget_ended(now)
        self.backups.step()

    def _forget_ended(self, now: float) -> None:
        """Forget the tasks that ended longer ago than the retention (`[server] keep_ended_days`): their
        rows, logs and history go; the metrics' counters keep what they counted."""
        assert self.keep_ended_s is not None
        self._forget_at = now + FORGET_EVERY_S
        cutoff = now - self.keep_ended_s
        old = [t for t in self.scheduler.tasks if t.terminal and t.ended_s is not None and t.ended_s < cutoff]
        if not old:
            return
        if len(old) > FORGET_BATCH:  # a retention set on a server of years: a batch per step, not one long stop
            old, self._forget_at = old[:FORGET_BATCH], now
        ids = [t.id for t in old]
        self.estimates.forget(self.store.forget(ids, counted(old)))
        self.scheduler.forget(ids)
        for task_id in ids:
            del self.jobs[task_id]
            self.estimates.drop(task_id)
            self.executor.remove_runs(task_id)
        log.info("forgot %s that ended over %g day(s) ago (ids %d to %d)", pluralize(len(ids), "task"),
                 self.keep_ended_s / 86400, min(ids), max(ids))  # fmt: skip

    def _save_observations(self) -> None:
        """Keep what telemetry saw of the live tasks so far: a restart goes on from it, and a task that ends
        while no daemon runs still has its peak in the history."""
        self._observations_saved = time.monotonic()
        live = self.recorder.live()
        for task_id, seen in live.items():
            self.store.record_observation(task_id, self.scheduler.task(task_id).current.number, seen)
        self._saved_peaks = {task_id: seen.peak_mib for task_id, seen in live.items()}

    def _peaks_grew(self) -> bool:
        """Whether a live task's peak is above the one saved last (or it has one for the first time)."""
        return any(peak > self._saved_peaks.get(task_id, -1) for task_id, peak in self.recorder.peaks().items())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.step()
            self.tick += 1
            self._wake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_wall_s)
        self.end_streams()

    async def wait_tick(self, seen: int) -> int:
        """The step count once it is past `seen` (at once if it already is), or as soon as the daemon closes."""
        while self.tick <= seen and not self.closing:
            await self._ticked.wait()
        return self.tick

    def end_streams(self) -> None:
        """Let live streams end (the daemon stops): the API server waits for open responses to finish."""
        self.closing = True
        self._wake()

    def _wake(self) -> None:
        self._ticked.set()
        self._ticked = asyncio.Event()

    def close(self) -> None:
        self._save_observations()
        self.estimates.close()
        self.backend.close()
        self.store.close()

    # ----------------------------------------------------------------- requests

    def submit(self, job: JobSpec, default_estimate: bool = True, workdir_checked: bool = False) -> Task:
        """Validate, persist, then queue a job (raises SpecError or ValueError on a spec it cannot run, and
        StoreUnavailable when it cannot be recorded now). A job with neither a need nor an estimator gets the
        server's default estimator, unless `default_estimate` is off (`--estimate none`)."""
        self.check(job, workdir_checked)
        default = self.estimates.config.default
        if default_estimate and job.mem_mib is None and job.estimator is None and default != "none":
            job = replace(job, estimator=default)  # recovery only is the fallback
        now = self.clock.now()  # one time for the store and the queue: a restart read a later one back
        with self._writing():
            task_id = self.store.add(job, now)
        self.jobs[task_id] = job
        task = self.loop.submit(job.task_spec(), task_id, now)  # queued before anything else can fail
        self.estimates.request(task_id, job)
        return task

    def check(self, job: JobSpec, workdir_checked: bool = False) -> None:
        """Raise SpecError for a job this server could never run, keeping nothing (a dry run's whole answer).
        `workdir_checked`: its working directory was, off the event loop (`carma.server.workdirs`)."""
        self.scheduler.check(job.task_spec())
        _check_declared(job, self.scheduler.capacity_mib(job.gpus))
        if job.mps_threads is not None and self.mps is None:  # it was taken, and went nowhere
            raise SpecError("an MPS thread percentage applies to a server started with --mps, and this one was not")
        if not workdir_checked and (problem := workdirs.problem(job.workdir)):
            raise SpecError(f"working directory {job.workdir!r} {problem}")

    def no_task(self, task_id: TaskId) -> str:
        """Why there is no task with that id: it never was, or it ended and the retention forgot it."""
        if not 0 < task_id < self.store.next_id:
            return f"no task with id {task_id}"
        kept = f" over {self.keep_ended_s / 86400:g} day(s) ago" if self.keep_ended_s is not None else ""
        return f"no task with id {task_id}: it ended{kept} and was forgotten ([server] keep_ended_days)"

    def cancel(self, *task_ids: TaskId) -> list[Task]:
        """Cancel tasks together (`SchedulingLoop.cancel`); the tasks after it."""
        with self._writing():
            self.loop.cancel(*task_ids)
        tasks = [self.scheduler.task(task_id) for task_id in task_ids]
        for task in tasks:
            if task.state is TaskState.CANCELLED:  # it left the queue: its estimate, if under way, is not needed
                self.estimates.drop(task.id)
        return tasks
