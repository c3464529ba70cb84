"""The CARMA scheduler: queues, need resolution, placement and recovery, with no I/O.

A world feeds it submissions, GPU samples, the tasks seen on each GPU and process exits, each stamped
with the world's time; `decide(now)` returns the actions to carry out. The same object runs inside the
digital twin and inside the daemon. Where a task goes is the placer's answer (`carma.core.placer`), which
task is offered to it the queue discipline's (`carma.core.queue`); a task's waiting reason is kept as
structure (`carma.core.blocked`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from carma.core.backfill import DurationOf, EasyBackfill
from carma.core.blocked import Blocked, Estimating, Preparing
from carma.core.config import SchedulerConfig
from carma.core.early import EarlyRestarts, Outgrowing
from carma.core.growth import Prediction
from carma.core.memory import RECOVERY_NEED, resolve_need
from carma.core.monitor import MonitorWindow
from carma.core.placer import Placement, Placer, for_tasks_of, outgrown_mib
from carma.core.policies import POLICIES
from carma.core.policies.pair import PairingModel
from carma.core.ports import Estimator
from carma.core.queue import QueueDiscipline, Queues, StrictFifo
from carma.core.recovery import classify_exit, oom_message
from carma.core.risk import WARMING_WINDOWS, Activity, ActivityOf, Risk, with_expected
from carma.core.ttfk import TtfkTable
from carma.core.types import (
    ACTIVE_STATES,
    Action,
    Attempt,
    ExitKind,
    GpuSample,
    Kill,
    Launch,
    MemoryNeed,
    NeedKind,
    ProcessExit,
    Target,
    TargetId,
    TargetKind,
    Task,
    TaskId,
    TaskSpec,
    TaskState,
)
from carma.core.view import View
from carma.units import cut, pluralize


@dataclass(frozen=True)
class GpuStatus:
    """What the scheduler knows of one GPU: its latest sample, risk, TTFK validity and tasks."""

    gpu: Target
    latest: GpuSample | None
    risk: Risk | None
    excluded: bool
    valid: bool
    awaiting_first_kernel: bool
    tasks: tuple[TaskId, ...]
    foreign: int
    held_mib: int = 0  # the needs known in MiB its tasks hold (`hold_known_needs`), allocated or not
    growth_mib: int = 0  # what its tasks are predicted to allocate yet, held too (`predict_growth`)


REASON_CHARS = 300  # a failed task's reason is one line of the queue's listing: its log holds the rest
PREDICTED = "predicted peak before an early restart"  # the source of a relaunch's need after one


class PlacerPort(Protocol):
    """What the scheduler asks of a placer (`carma.core.placer.Placer`, or one wrapping it, as the dynamic MIG
    placer does)."""

    def place(self, task: Task, need: MemoryNeed, view: View) -> Placement | Blocked: ...

    def room_mib(self, target: Target) -> int:
        """The most memory a task on `target` can ever be given (what a need and an OOM are measured against)."""
        ...

    def relaunch_need(self, task: Task, need: MemoryNeed) -> MemoryNeed:
        """What a relaunch after an OOM crash is placed with (`need`: whole idle GPUs), as the placer sizes it."""
        ...

    def ended(self, task_id: TaskId) -> None:
        """`task_id` reached a terminal state: a placer forgets what it kept for it."""
        ...


class SpecError(ValueError):
    """A task specification this server can never run."""


class Scheduler:
    def __init__(
        self,
        targets: Sequence[Target],
        config: SchedulerConfig | None = None,
        estimator: Estimator | None = None,
        discipline: QueueDiscipline | None = None,
        placer: Callable[[Placer], PlacerPort] | None = None,
        durations: DurationOf | None = None,
        pairing: PairingModel | None = None,
        early: EarlyRestarts | None = None,
        activity: ActivityOf | None = None,
    ) -> None:
        """`placer` wraps the whole-GPU placer the configuration makes (dynamic MIG: `carma.core.mig.placer`).
        `durations` (how long a task is expected to run) lets `backfill` pass a waiting head; `pairing` (the
        world's interference model) lets the `pair` policy rank GPUs; without them neither has an effect.
        `early` restarts a task alone on a MIG instance before it outgrows it (`carma.core.early`). `activity`
        (what a task adds to its GPU's SMACT, SMOCC and DRAMA once it computes) lets `warmup_risk` count the
        tasks still warming up in the risk filter."""
        if not targets:
            raise ValueError("a scheduler needs at least one GPU")
        self.config = config or SchedulerConfig()
        self.estimator = estimator
        # The targets in the server's order (ties in every policy go to the earliest); a topology change
        # keeps the order of those that stay.
        self.gpus: dict[TargetId, Target] = {}
        self._windows: dict[TargetId, MonitorWindow] = {}
        self._ttfk = TtfkTable(self.config.window_s)
        self._on_gpu: dict[TargetId, set[TaskId]] = {}
        self._foreign: dict[TargetId, int] = {}
        self._usable_mib: list[int] = []
        self._usable_whole_mib: list[int] = []
        self.policy = POLICIES[self.config.policy]()
        whole = Placer(self.config, self.policy)
        self.placer: PlacerPort = whole if placer is None else placer(whole)
        self.discipline: QueueDiscipline
        self._tasks: dict[TaskId, Task] = {}
        self._queues = Queues()
        self._crashed: list[TaskId] = []  # OOM-crashed, awaiting the recovery scan
        self._needs: dict[TaskId, MemoryNeed] = {}  # resolved once, at the head of the queue, until placed
        self._blocked: dict[TaskId, Blocked] = {}
        self._changed: set[TaskId] = set()  # tasks changed since the world last took the changes to persist
        self.early = early
        self._growth: dict[TargetId, int] = {}  # by shared GPU: the growth its tasks are predicted to still allocate
        self._next_id = 1
        self._view = _SchedulerView(self, pairing, activity if self.config.warmup_risk else None)
        self._activity = activity
        if discipline is None and self.config.backfill and durations is not None:
            discipline = EasyBackfill(self._view, self.task, durations, self._leaves_room)
        self.discipline = discipline or StrictFifo()
        for target in targets:
            self.add_target(target)

    # ----------------------------------------------------------------- topology

    def add_target(self, target: Target) -> None:
        """A target joins the server (at start, a MIG instance created, a node's GPU); it is no candidate until
        telemetry has read it."""
        if target.id in self.gpus:
            raise ValueError(f"target {target.id} is already known")
        self.gpus[target.id] = target
        self._windows[target.id] = MonitorWindow(self.config.window_samples, self.config.risk.weights)
        self._ttfk.add(target.id)
        self._on_gpu[target.id] = set()
        self._foreign[target.id] = 0
        self._capacity_changed()

    def remove_target(self, target_id: TargetId, now: float) -> None:
        """A target leaves the server. Only an idle one may be removed (a MIG reconfiguration touches idle
        instances only): a task on it is the world's to end first, and its exit frees the target. Waiting tasks
        the smaller server can no longer run fail, as after a restart with fewer GPUs."""
        if target_id not in self.gpus:
            raise ValueError(f"no target {target_id}")
        if self._on_gpu[target_id]:
            tasks = ", ".join(map(str, sorted(self._on_gpu[target_id])))
            raise ValueError(f"target {target_id} runs task(s) {tasks}: only an idle target can be removed")
        if len(self.gpus) == 1:
            raise ValueError("a scheduler needs at least one GPU: the last target cannot be removed")
        del self.gpus[target_id], self._windows[target_id], self._on_gpu[target_id], self._foreign[target_id]
        self._ttfk.remove(target_id)
        self._capacity_changed()
        for task_id in [*self._queues.main, *self._queues.recovery, *self._crashed]:
            task = self._tasks[task_id]
            try:
                self.check(task.spec)
            except SpecError as e:
                self._queues.drop(task_id)
                if task_id in self._crashed:
                    self._crashed.remove(task_id)
                self._finish(task, TaskState.FAILED, now, f"{e} since a GPU left it")

    def sync_targets(self, targets: Sequence[Target], now: float) -> None:
        """Match the world's targets after its topology changed (a MIG reconfiguration): new ones join, in the
        world's order, and idle ones it no longer lists leave. One that still runs a task stays until its exit
        frees it (a reconfiguration only destroys idle instances)."""
        listed = {t.id for t in targets}
        for target in targets:
            if target.id not in self.gpus:
                self.add_target(target)
        for gone in [g for g in self.gpus if g not in listed and not self._on_gpu[g]]:
            self.remove_target(gone, now)

    def _capacity_changed(self) -> None:
        """The memory, less the reserve, of the n-th largest target (index n - 1): the most an n-GPU task can have
        (a one-GPU task any target's, a multi-GPU task whole GPUs': see `for_tasks_of`); needs resolved against
        the old capacities are resolved again."""
        reserve = self.config.reserve_mib
        self._usable_mib = sorted((self.placer.room_mib(g) - reserve for g in self.gpus.values()), reverse=True)
        self._usable_whole_mib = sorted(
            (g.total_mib - reserve for g in self.gpus.values() if g.kind is TargetKind.GPU), reverse=True
        )
        self._needs.clear()

    # ----------------------------------------------------------------- inputs from a world

    def check(self, spec: TaskSpec) -> None:
        """Raise SpecError for a task this server can never run (a world checks before it keeps the task)."""
        if spec.gpus > len(self.gpus):
            raise SpecError(f"task {spec.name!r} needs {spec.gpus} GPUs but this server has {len(self.gpus)}")
        if spec.gpus > 1 and spec.gpus > len(self._usable_whole_mib):
            raise SpecError(
                f"task {spec.name!r} needs {spec.gpus} GPUs but this server has {len(self._usable_whole_mib)} whole "
                "one(s): a process sees one MIG instance at most, so a MIG instance takes one-GPU tasks only"
            )

    def capacity_mib(self, n: int) -> int:
        """The memory (MiB) each GPU of an `n`-GPU task has at most: the largest GPU's, or MIG instance's, for
        one GPU; the n-th largest whole GPU's for more (see `_for`)."""
        return self._usable(n) + self.config.reserve_mib

    def submit(self, spec: TaskSpec, now: float, task_id: TaskId | None = None) -> Task:
        """Queue a task; a world that numbers tasks itself (the daemon's store) passes the id."""
        self.check(spec)
        task_id = self._next_id if task_id is None else task_id
        if task_id in self._tasks:
            raise ValueError(f"task id {task_id} is already taken")
        task = Task(id=task_id, spec=spec, submit_s=now)
        self._next_id = max(self._next_id, task_id + 1)
        self._tasks[task.id] = task
        self._queues.main.append(task.id)
        self._changed.add(task.id)
        return task

    def restore(self, task: Task, now: float) -> None:
        """Take back a task a world persisted (after a restart), in its state; call in submission order.

        Waiting tasks rejoin their queue; a dispatched or running attempt holds its GPUs again, with its
        TTFK bookkeeping as it was. A waiting task this server can no longer run (restarted with fewer GPUs)
        fails: at the head of its queue it stopped the scheduling loop, at every start.
        """
        if task.id in self._tasks:
            raise ValueError(f"task id {task.id} is already taken")
        self._tasks[task.id] = task
        self._next_id = max(self._next_id, task.id + 1)
        if task.state in (TaskState.QUEUED, TaskState.RECOVERING, TaskState.OOM_CRASHED):
            try:
                self.check(task.spec)
            except SpecError as e:
                self._finish(task, TaskState.FAILED, now, f"{e} since it restarted")
                return
        if task.state is TaskState.QUEUED:
            self._queues.main.append(task.id)
        elif task.state is TaskState.RECOVERING:
            self._queues.recovery.append(task.id)
        elif task.state is TaskState.OOM_CRASHED:
            self._crashed.append(task.id)
        elif task.state in ACTIVE_STATES:
            attempt = _current(task)
            # a target gone since (a GPU removed while the server was down) holds nothing: the task's exit
            # still comes from the world that started it
            for gpu in (g for g in attempt.gpus if g in self.gpus):
                self._on_gpu[gpu].add(task.id)
                self._ttfk.dispatched(gpu, task.id, attempt.dispatched_s, self._closes(attempt.need))
                # a multi-GPU task's first kernel is kept for the task, not per GPU: each of its GPUs waits to
                # see it again in the next process list, rather than counting as seen where it never was
                if attempt.first_kernel_s is not None and len(attempt.gpus) == 1:
                    self._ttfk.seen(gpu, task.id, attempt.first_kernel_s)

    def forget(self, task_ids: Iterable[TaskId]) -> None:
        """Drop ended tasks a world no longer keeps (its retention): they hold no GPU and wait for nothing."""
        ids = list(task_ids)
        for task_id in ids:
            if not self.task(task_id).terminal:
                raise ValueError(f"task {task_id} has not ended: only ended tasks can be forgotten")
        for task_id in ids:
            del self._tasks[task_id]
            self._changed.discard(task_id)

    def take_changes(self) -> list[Task]:
        """Tasks changed since the last call, in id order: what a world persists before acting."""
        changed = [self._tasks[t] for t in sorted(self._changed)]
        self._changed.clear()
        return changed

    def cancel(self, task_id: TaskId, now: float) -> list[Action]:
        """Cancel a task: a waiting one ends now; a live one is to be killed (the action returned), and ends
        when its exit is reported."""
        task = self.task(task_id)
        if task.terminal:
            return []
        if task.state in ACTIVE_STATES:
            task.cancel_requested = True
            self._changed.add(task_id)
            return [Kill(task_id, _current(task).number)]
        self._queues.drop(task_id)
        if task_id in self._crashed:
            self._crashed.remove(task_id)
        self._finish(task, TaskState.CANCELLED, now, "cancelled by request")
        return []

    def record_sample(self, sample: GpuSample) -> None:
        window = self._windows.get(sample.gpu)
        if window is not None:  # else a sample taken before its target left
            window.add(sample)
            early = self.early
            if early is not None and early.instances and not self.gpus[sample.gpu].shareable:
                on = self._on_gpu[sample.gpu]
                task = self._tasks[next(iter(on))] if len(on) == 1 else None  # alone on it: its reading is the task's
                attempt = None if task is None else _current(task)
                if task and attempt and attempt.first_kernel_s is not None and sample.t >= attempt.first_kernel_s:
                    early.observe(task, attempt.number, sample.t, sample.used_mib)

    def record_gpu_processes(
        self,
        gpu: TargetId,
        tasks: Iterable[TaskId],
        foreign: int,
        now: float,
        used_mib: Mapping[TaskId, int] | None = None,
    ) -> None:
        """What a target's process list shows: carma tasks on it (first kernels) and other processes; `used_mib`,
        where the world can tell, the memory each task's processes hold on it (a shared GPU's growth series)."""
        if gpu not in self.gpus:
            return  # a reading taken before the target left
        self._foreign[gpu] = foreign
        if foreign:  # someone else's process: the tasks here no longer run alone (an OOM may not be theirs)
            for task_id in self._on_gpu[gpu]:
                attempt = _current(self._tasks[task_id])
                if not attempt.shared:
                    attempt.shared = True
                    self._changed.add(task_id)
        for task_id in tasks:
            if self._ttfk.seen(gpu, task_id, now):
                task = self._tasks[task_id]
                if task.state is TaskState.DISPATCHED:
                    task.state = TaskState.RUNNING
                    _current(task).first_kernel_s = now
                    self._changed.add(task_id)
        early = self.early
        if early is not None and self.config.predict_growth and used_mib and self.gpus[gpu].shareable:
            for task_id, mib in used_mib.items():
                grower = self._tasks.get(task_id)
                current = None if grower is None else grower.current
                # one series per task: a multi-GPU task's from its first GPU
                if grower and current and grower.state is TaskState.RUNNING and current.gpus[0] == gpu:
                    early.observe(grower, current.number, now, mib)

    def record_exit(self, task_id: TaskId, exit: ProcessExit, now: float) -> ExitKind | None:
        """A task's process ended; returns how it was classified (None for a task not running)."""
        task = self.task(task_id)
        if task.state not in ACTIVE_STATES:
            return None
        attempt = _current(task)
        kind = classify_exit(exit, killed_by_request=task.cancel_requested)
        if self.early is not None:
            self.early.forget(task_id)
        now = max(now, attempt.dispatched_s)  # a world's end time from a file the task could write: never before
        if attempt.restart_mib is not None and kind is ExitKind.SUCCESS:  # it ended before its stop reached it
            attempt.restart_mib, attempt.message = None, ""
        elif attempt.restart_mib is not None and kind is not ExitKind.KILLED:  # its stop: relaunched on its peak
            kind = ExitKind.OOM
        attempt.ended_s = now
        attempt.outcome = kind
        self._changed.add(task_id)
        for gpu in attempt.gpus:
            self._on_gpu.get(gpu, set()).discard(task_id)
        self._ttfk.ended(task_id)
        if kind is ExitKind.KILLED:
            self._finish(task, TaskState.CANCELLED, now, "cancelled by request")
        elif kind is ExitKind.SUCCESS:
            self._finish(task, TaskState.COMPLETED, now, "")
        elif kind is ExitKind.OOM:
            if attempt.restart_mib is None:
                attempt.message = oom_message(exit)
            task.state = TaskState.OOM_CRASHED
            self._crashed.append(task_id)
        else:
            self._finish(task, TaskState.FAILED, now, _error_reason(exit))
        return kind

    # ----------------------------------------------------------------- decisions

    def decide(self, now: float) -> list[Action]:
        """Recovery scan, then offer waiting tasks to the placer (as the queue discipline orders them, the
        recovery queue first) until the discipline stops; returns the actions to carry out."""
        self._recovery_scan(now)
        self._blocked.clear()
        view = self._view
        view.now = now
        actions: list[Action] = self._early_restarts(now)

        def attempt(task_id: TaskId, avoid: frozenset[TargetId] = frozenset()) -> Placement | Blocked:
            task = self._tasks[task_id]
            recovery = task.state is TaskState.RECOVERING
            need = self.relaunch_need(task) if recovery else self._need(task)
            if need is None:
                self._blocked[task_id] = Estimating()  # not ready: the disciplines pass it (`first_waiting`)
                return self._blocked[task_id]
            view.placing, view.avoid = task, avoid
            outcome = self.placer.place(task, need, view)
            view.avoid = frozenset()
            if isinstance(outcome, Placement):
                actions.append(self._launch(task, outcome, need, now, recovery))
                view.placed()
            else:
                if isinstance(outcome, Preparing):  # it waits for what the world is asked to prepare for it
                    actions.extend(outcome.actions)
                self._blocked[task_id] = outcome
            return outcome

        view.offering(True)
        try:
            self.discipline.offer(self._queues, attempt)
        finally:
            view.offering(False)
        return actions

    def next_timer(self, now: float) -> float | None:
        """When a decision could change by time alone (a GPU leaving its TTFK grace window)."""
        return self._ttfk.next_expiry(now)

    # ----------------------------------------------------------------- queries

    def task(self, task_id: TaskId) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise KeyError(f"no task with id {task_id}") from None

    @property
    def tasks(self) -> list[Task]:
        return list(self._tasks.values())

    @property
    def queue(self) -> list[TaskId]:
        return list(self._queues.main)

    @property
    def recovery_queue(self) -> list[TaskId]:
        return list(self._queues.recovery)

    def position(self, target: TargetId) -> int | None:
        """Where `target` is in the server's order (None for one not, or no longer, there)."""
        return self._view.position(target) if target in self.gpus else None

    def shown(self, target: TargetId) -> int | str:
        """A target as users name it: its position in the server's list (`carma gpus`), its id once it has left."""
        position = self.position(target)
        return target if position is None else position

    def pending(self) -> bool:
        """Whether any task waits for a placement (or for the recovery scan)."""
        return bool(self._queues.main or self._queues.recovery or self._crashed)

    def gpu_status(self, now: float) -> list[GpuStatus]:
        """Each GPU as decisions see it: its risk with the activity of the tasks warming up on it
        (`warmup_risk`) too."""
        out = []
        self._view.now = now
        for g, window in self._windows.items():
            risk = self._view.risk(g) if window.latest is not None else None
            out.append(
                GpuStatus(
                    gpu=self.gpus[g],
                    latest=window.latest,
                    risk=risk,
                    # a MIG instance is never collocated, so never filtered: its missing metrics (NVML has none
                    # per instance) are no risk
                    excluded=bool(
                        risk and self.config.risk.enabled and self.gpus[g].shareable and risk.excluded(self.config.risk)
                    ),
                    valid=self._ttfk.valid(g, now),
                    awaiting_first_kernel=self._ttfk.awaiting(g),
                    tasks=tuple(sorted(self._on_gpu[g])),
                    foreign=self._foreign[g],
                    held_mib=self._held_mib(g)[0] if self.config.hold_known_needs else 0,
                    growth_mib=self._growth.get(g, 0),
                )
            )
        return out

    def blocked(self, task_id: TaskId) -> Blocked | None:
        """Why a waiting task was not placed at the last decision (by its state, not a scan of the queues:
        listing thousands of waiting tasks asks this of each); None for a task that does not wait."""
        if task_id in self._blocked:
            return self._blocked[task_id]
        task = self._tasks.get(task_id)
        return None if task is None else self.discipline.waiting(task, self._queues)

    # ----------------------------------------------------------------- internals

    def _recovery_scan(self, now: float) -> None:
        for task_id in self._crashed:
            task = self._tasks[task_id]
            attempt = _current(task)
            relaunches = sum(1 for a in task.attempts if a.recovery)
            gpus = ",".join(str(self.shown(g)) for g in attempt.gpus)
            outgrown = outgrown_mib(task, self.gpus)
            n = task.spec.gpus
            room = self.placer.room_mib
            if sum(room(self.gpus[g]) > outgrown for g in for_tasks_of(n, list(self.gpus), self.gpus)) < n:
                on_mig = any(self.gpus[g].kind is TargetKind.MIG for g in attempt.gpus)
                reason = (
                    f"out of memory alone on MIG instance {gpus}: it needs more memory than any instance here holds"
                    if on_mig
                    else f"out of memory alone on GPU {gpus}: it needs more memory than the GPU has"
                )
                self._finish(task, TaskState.FAILED, now, f"{reason} ({attempt.message})")
            elif relaunches >= self.config.max_relaunches:
                reason = (
                    f"out of memory again after {pluralize(relaunches, 'relaunch', 'relaunches')} (limit reached)"
                    if relaunches
                    else "out of memory, and OOM relaunches are off (max_relaunches = 0)"
                )
                self._finish(task, TaskState.FAILED, now, f"{reason} ({attempt.message})")
            else:
                task.state = TaskState.RECOVERING
                self._queues.recovery.append(task_id)
                self._changed.add(task_id)
        self._crashed.clear()

    def _early_restarts(self, now: float) -> list[Action]:
        """Kill the tasks predicted to outgrow where they run (alone on a MIG instance, or beside co-runners on a
        shared GPU); their exits relaunch them. Sets each shared GPU's predicted growth for this decision."""
        self._growth.clear()
        early = self.early
        if early is None:
            return []
        found: list[Outgrowing] = []
        for g, target in self.gpus.items():
            on = self._on_gpu[g]
            if target.shareable:
                if not self.config.predict_growth or on.isdisjoint(early.moving):
                    continue  # nothing on it has grown since its warm-up: most GPUs, at most decisions
            elif not early.instances or len(on) != 1:
                continue
            tasks = [self._tasks[t] for t in sorted(on)]
            stopping = any(_current(t).restart_mib is not None for t in tasks)
            running = [
                t
                for t in tasks
                if t.state is TaskState.RUNNING and not t.cancel_requested and _current(t).restart_mib is None
            ]
            if not running:
                continue
            if target.shareable:
                found += self._shared_growth(g, running, now, stopping)
            elif self._may_relaunch(running[0]):
                (task,) = running
                room = self.placer.room_mib(target)
                outgrowing = early.check(task, _current(task).number, target.total_mib, room, now)
                found += [outgrowing] if outgrowing else []
        kills: list[Action] = []
        for outgrowing in found:
            task = self._tasks[outgrowing.task_id]
            attempt = _current(task)
            attempt.restart_mib = math.ceil(outgrowing.prediction.peak_mib)
            attempt.message = outgrowing.message
            self._changed.add(task.id)  # persisted before the stop: a restarted world still relaunches it
            kills.append(Kill(outgrowing.task_id, outgrowing.attempt))
        return kills

    def _may_relaunch(self, task: Task) -> bool:
        """Whether a stop would be answered by a relaunch (`max_relaunches`): otherwise it would end the task."""
        return sum(1 for a in task.attempts if a.recovery) < self.config.max_relaunches

    def _shared_growth(self, gpu: TargetId, running: list[Task], now: float, stopping: bool) -> list[Outgrowing]:
        """The growth predicted on a shared GPU: what its growing tasks may still allocate (the band's top), held
        against new tasks (`_free_mib`) beyond the needs they hold already while their memory rises (`rising`: not
        for a step long past); a wrong hold only delays a placement.
        When what they are expected to allocate (the fitted line) will not fit in what the GPU shows free, the
        task that grows most is restarted now, as its crash would be answered (through recovery), unless it would
        not fit the GPU alone either; a wrong restart costs a healthy task its work, so the band does not decide
        it, nor a step its memory has not repeated (`EarlyRestarts.lasting`), and while a task on the GPU is
        `stopping` its memory is not free yet: no second task is stopped for it. Co-runners are taken to hold what
        they hold now until it ends."""
        early, latest = self.early, self._windows[gpu].latest
        if early is None or latest is None:
            return []
        grows: list[tuple[float, Task, Prediction]] = []  # expected growth, the task, its prediction
        held = 0.0
        for task in running:
            prediction = early.predicted(task, _current(task).number, now)
            now_mib = early.latest_mib(task.id)
            if prediction is None or now_mib is None or not early.rising(task.id):
                continue
            need = _current(task).need
            holds = (need.held_mib(self.config.margin_mib) if self.config.hold_known_needs and need else None) or 0
            held += max(0.0, prediction.peak_mib - max(now_mib, holds))
            grows.append((max(0.0, prediction.trend_mib - now_mib), task, prediction))
        self._growth[gpu] = math.ceil(held)
        grows = [grown for grown in grows if early.lasting(grown[1].id)]
        if stopping or sum(more for more, _, _ in grows) <= latest.free_mib:
            return []
        stoppable = [grown for grown in grows if self._may_relaunch(grown[1])]
        if not stoppable:
            return []
        _, task, prediction = max(stoppable, key=lambda grown: grown[0])
        alone = len(self._on_gpu[gpu]) == 1 and not self._foreign[gpu]
        if alone or prediction.trend_mib > self.placer.room_mib(self.gpus[gpu]):
            return []  # nothing a restart could make room for: it runs out alone, as without a prediction
        beside = latest.free_mib + (early.latest_mib(task.id) or 0.0)
        where = f"it can have on GPU {self.shown(gpu)} beside its co-runners"
        return [Outgrowing(task.id, _current(task).number, prediction, int(beside), where)]

    def relaunch_need(self, task: Task) -> MemoryNeed:
        """A relaunch's need: whole idle GPUs, as after any out-of-memory crash (the placer's size of it: the next
        larger MIG instance), unless the task was stopped on a prediction; then its predicted peak, held where it
        runs next (a larger MIG instance, or a GPU with that much free)."""
        peak = _current(task).restart_mib
        if peak is None:
            return self.placer.relaunch_need(task, RECOVERY_NEED)
        if peak + self.config.margin_mib > self._usable(task.spec.gpus):
            return MemoryNeed(NeedKind.WHOLE_GPU, peak, f"{PREDICTED}, more than a GPU has with the margin")
        return MemoryNeed(NeedKind.KNOWN, peak, PREDICTED)

    def _need(self, task: Task) -> MemoryNeed | None:
        """The head task's need, resolved once and kept until it is placed; None while its estimate is not
        ready."""
        need = self._needs.get(task.id)
        if need is None:
            need = resolve_need(task, self.estimator, self._usable(task.spec.gpus), self.config.margin_mib)
            if need is not None:
                self._needs[task.id] = need
        return need

    def _leaves_room(self, head: Task, gpu: TargetId, staying: Sequence[Task]) -> bool:
        """Whether `head` could be placed on shared `gpu` beside `staying` (backfilling's `LeavesRoom`): its need
        and the margin fit in the GPU's memory beside the needs they hold, and their expected activity together
        passes the risk rule. Never where a need or an activity is not known, nor beside another process or a
        relaunch kept alone (`exclusive_relaunch`), nor for a relaunch, nor where tasks do not share GPUs or each
        task placed closes its GPU for a window (CARMA's TTFK rule: `ttfk_unknown_only` off)."""
        head_need = self._needs.get(head.id)
        if head_need is None or head_need.kind is not NeedKind.KNOWN or head_need.mib is None or not self._activity:
            return False
        if not (self.policy.shares and self.config.ttfk_unknown_only) or head.state is TaskState.RECOVERING:
            return False
        if not self.gpus[gpu].shareable or self._foreign[gpu]:
            return False
        if self.config.exclusive_relaunch and self._view.holds_relaunch(gpu):
            return False
        held, activities = 0, list[Activity]()
        for task in staying:
            need = task.current.need if task.id in self._on_gpu[gpu] and task.current else self._need(task)
            mib = need.held_mib(self.config.margin_mib) if need and need.kind is NeedKind.KNOWN else None
            activity = self._activity(task)
            if mib is None or activity is None:
                return False
            held += mib
            activities.append(activity)
        if held + head_need.mib + self.config.margin_mib > self.gpus[gpu].total_mib - self.config.reserve_mib:
            return False
        return not (
            self.config.risk.enabled and with_expected(Risk(0.0, 0.0, 0.0), activities).excluded(self.config.risk)
        )

    def _usable(self, n: int) -> int:
        """The most memory (MiB, less the reserve) each GPU of an `n`-GPU task can have."""
        return self._usable_mib[0] if n == 1 else self._usable_whole_mib[n - 1]

    def _free_mib(self, gpu: TargetId, hold: bool = True) -> int:
        """What a new task may take on `gpu`, less the reserve: the memory telemetry shows free, and (with
        `hold_known_needs`, unless `hold` is False) no more than the needs known in MiB of the tasks on it leave,
        whether or not they have allocated them yet, nor what its tasks are predicted to grow by (`early`). Their
        margin is not held (but for a partial need's): what a task uses beyond its need shows as used. The needs
        of tasks within their TTFK window are also taken from the memory shown free, which may not show them yet:
        beside memory no need holds (a relaunch's, a task's of unknown need) the needs held alone would let open
        warm-ups place tasks into memory that is not there."""
        latest = self._windows[gpu].latest
        assert latest is not None, "a GPU telemetry never read is no candidate"
        free = latest.free_mib
        if hold and self.config.hold_known_needs:
            held, unshown = self._held_mib(gpu)
            free = min(free - unshown, latest.total_mib - held)
        if hold:
            free -= self._growth.get(gpu, 0)
        return max(0, free - self.config.reserve_mib)

    def _held_mib(self, gpu: TargetId) -> tuple[int, int]:
        """The needs known in MiB of the tasks on `gpu` (per GPU, for a multi-GPU task), a partial one with its
        margin: one too large for a GPU with the margin, placed on whole GPUs, is held too, or others join it
        once its window passes. Second, those of tasks not yet seen a window ago (with CARMA's TTFK rule, none
        is when a task is placed beside them)."""
        held = unshown = 0
        settled = self._view.now - self.config.window_s  # seen by then: its memory shows
        for t in self._on_gpu[gpu]:
            a = self._tasks[t].current
            mib = a.need.held_mib(self.config.margin_mib) if a is not None and a.need is not None else None
            if a is None or mib is None:
                continue
            held += mib
            if a.first_kernel_s is None or a.first_kernel_s > settled:
                unshown += mib
        return held, unshown

    def _launch(self, task: Task, placement: Placement, need: MemoryNeed, now: float, recovery: bool) -> Launch:
        self._queues.take(task.id, recovery)
        self._needs.pop(task.id, None)
        gpus = placement.gpus
        shared = any(self._on_gpu[g] or self._foreign[g] for g in gpus)
        for g in gpus:
            for other in self._on_gpu[g]:
                joined = _current(self._tasks[other])
                if not joined.shared:  # saved: a restart took a co-runner's run for one alone, in its history
                    joined.shared = True
                    self._changed.add(other)
            self._on_gpu[g].add(task.id)
            self._ttfk.dispatched(g, task.id, now, self._closes(need))
        attempt = Attempt(
            number=len(task.attempts) + 1,
            gpus=tuple(sorted(gpus, key=self._view.position)),
            dispatched_s=now,
            exclusive=not shared,
            recovery=recovery,
            need=need,
            shared=shared,
        )
        task.attempts.append(attempt)
        task.state = TaskState.DISPATCHED
        self._changed.add(task.id)
        if not recovery:
            self.policy.placed(gpus)
        return Launch(task.id, attempt.number, attempt.gpus, attempt.exclusive, recovery)

    def _closes(self, need: MemoryNeed | None) -> bool:
        """Whether a task placed with `need` closes its GPUs for its TTFK window: always, but with
        `ttfk_unknown_only` a need known in MiB, held (`hold_known_needs`, which it requires), leaves them open to
        further tasks, which fit beside what it holds."""
        known = need is not None and need.kind is NeedKind.KNOWN and need.mib is not None
        return not (self.config.ttfk_unknown_only and known)

    def _finish(self, task: Task, state: TaskState, now: float, reason: str) -> None:
        task.state = state
        task.reason = reason
        task.ended_s = now
        self._needs.pop(task.id, None)
        self.placer.ended(task.id)
        self._changed.add(task.id)


def _error_reason(exit: ProcessExit) -> str:
    """The exit and the last line of the log's tail, that line cut to `REASON_CHARS` (the log has it whole)."""
    last = cut(next((line.strip() for line in reversed(exit.log_tail.splitlines()) if line.strip()), ""), REASON_CHARS)
    if exit.signal is not None:
        status = f"killed by signal {exit.signal}"
    elif exit.exit_code is not None:
        status = f"exit code {exit.exit_code}"
    else:  # it never started (the last line says why), or vanished unobserved
        return last or "ended without an exit status"
    if not last:
        return status
    return f"{status} (its last output: {last})" if exit.tail_is_output else f"{status}: {last}"


def _current(task: Task) -> Attempt:
    """A placed task's latest attempt."""
    attempt = task.current
    assert attempt is not None, f"task {task.id} was never placed"
    return attempt


class _SchedulerView:
    """The scheduler's bookkeeping as the placer reads it (`carma.core.view.View`), live: a placement made
    in a decision shows in the answers for the next task offered. One per scheduler, moved to each
    decision's time (a decision is a tight loop: it binds what it reads once). While a decision offers tasks
    (`offering`), a GPU's free memory and risk are worked out once and kept until a task is placed, the only
    change in the meantime: backfilling offers every waiting task."""

    def __init__(self, scheduler: Scheduler, pairing: PairingModel | None, activity: ActivityOf | None) -> None:
        self.now = 0.0
        self.placing: Task | None = None  # the task offered to the placer
        self.avoid: frozenset[TargetId] = frozenset()  # targets it may not take (held for the head: backfilling)
        self._pairing = pairing
        self._activity = activity
        self._warming_s = WARMING_WINDOWS * scheduler.config.window_s
        self.gpus: Mapping[TargetId, Target] = scheduler.gpus  # in the server's order: ties go to the earliest
        self._free_mib = scheduler._free_mib
        self._free: dict[tuple[TargetId, bool], int] | None = None  # while offering: the answers so far
        self._risks: dict[TargetId, Risk] | None = None
        self.usable_mib = scheduler._usable
        self._windows = scheduler._windows
        self._on_gpu = scheduler._on_gpu
        self._foreign = scheduler._foreign
        self._tasks = scheduler._tasks
        self._ttfk = scheduler._ttfk

    def position(self, gpu: TargetId) -> int:
        """Where `gpu` is in the server's order."""
        return list(self.gpus).index(gpu)

    def idle_gpus(self) -> list[TargetId]:
        on_gpu, foreign, windows, avoid = self._on_gpu, self._foreign, self._windows, self.avoid
        return [
            g
            for g in self.gpus
            if not on_gpu[g] and not foreign[g] and windows[g].latest is not None and g not in avoid
        ]

    def reported_gpus(self) -> list[TargetId]:
        windows, avoid = self._windows, self.avoid
        return [g for g in self.gpus if windows[g].latest is not None and g not in avoid]

    def holds_relaunch(self, gpu: TargetId) -> bool:
        return any(_current(self._tasks[t]).recovery for t in self._on_gpu[gpu])

    def valid(self, gpu: TargetId) -> bool:
        return self._ttfk.valid(gpu, self.now)

    def offering(self, started: bool) -> None:
        """A decision starts (or ends) offering tasks: answers are kept (or no longer)."""
        self._free, self._risks = ({}, {}) if started else (None, None)

    def placed(self) -> None:
        """A task was placed: the GPUs' free memory and risk change."""
        if self._free is not None and self._risks is not None:
            self._free.clear()
            self._risks.clear()

    def free_mib(self, gpu: TargetId, hold: bool = True) -> int:
        if self._free is None:
            return self._free_mib(gpu, hold)
        if (gpu, hold) not in self._free:
            self._free[gpu, hold] = self._free_mib(gpu, hold)
        return self._free[gpu, hold]

    def risk(self, gpu: TargetId) -> Risk:
        if self._risks is None:
            return self._risk(gpu)
        if gpu not in self._risks:
            self._risks[gpu] = self._risk(gpu)
        return self._risks[gpu]

    def _risk(self, gpu: TargetId) -> Risk:
        risk = self._windows[gpu].risk()
        if self._activity is None:
            return risk
        tasks = self._tasks
        warming = self._ttfk.warming(gpu, self.now, self._warming_s)
        expected = [a for t in warming if (a := self._activity(tasks[t])) is not None]
        return with_expected(risk, expected) if expected else risk

    def tasks_on(self, gpu: TargetId) -> list[Task]:
        return [self._tasks[t] for t in sorted(self._on_gpu[gpu])]

    def pairing_cost(self, gpu: TargetId) -> float | None:
        if self._pairing is None or self.placing is None:
            return None
        return self._pairing(self.placing, self.tasks_on(gpu))
