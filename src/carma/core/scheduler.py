"""The CARMA scheduler: queues, need resolution, risk filter, placement and recovery, with no I/O.

A world feeds it submissions, GPU samples, the tasks seen on each GPU and process exits, each stamped
with the world's time; `decide(now)` returns the launches to carry out. The same object runs inside the
digital twin and inside the daemon.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from carma.core.config import Policy, SchedulerConfig
from carma.core.memory import RECOVERY_NEED, Estimator, resolve_need
from carma.core.monitor import MonitorWindow
from carma.core.policies import Candidate, RoundRobin, order
from carma.core.recovery import classify_exit, oom_message
from carma.core.risk import Risk
from carma.core.ttfk import TtfkTable
from carma.core.types import (
    ACTIVE_STATES,
    Attempt,
    ExitKind,
    GpuInfo,
    GpuSample,
    Launch,
    MemoryNeed,
    NeedKind,
    ProcessExit,
    Task,
    TaskId,
    TaskSpec,
    TaskState,
)
from carma.units import cut, inflect, pluralize

HEAD_OF_LINE = "behind the head of the queue (FIFO)"
UNDECIDED = "at the head of the queue, for the next placement decision"  # e.g. before the GPUs' first sample


@dataclass(frozen=True)
class GpuStatus:
    """What the scheduler knows of one GPU: its latest sample, risk, TTFK validity and tasks."""

    gpu: GpuInfo
    latest: GpuSample | None
    risk: Risk | None
    excluded: bool
    valid: bool
    awaiting_first_kernel: bool
    tasks: tuple[TaskId, ...]
    foreign: int
    held_mib: int = 0  # the needs known in MiB its tasks hold (`hold_known_needs`), allocated or not


RECOVERY_FIRST = "recovery queue has priority"
ESTIMATING = "waiting for its memory estimate"
REASON_CHARS = 300  # a failed task's reason is one line of `carma queue`: its log holds the rest


class SpecError(ValueError):
    """A task specification this server can never run."""


class Scheduler:
    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        config: SchedulerConfig | None = None,
        estimator: Estimator | None = None,
    ) -> None:
        if not gpus:
            raise ValueError("a scheduler needs at least one GPU")
        self.config = config or SchedulerConfig()
        self.estimator = estimator
        self.gpus: dict[int, GpuInfo] = {g.index: g for g in gpus}
        indices = sorted(self.gpus)
        # The memory, less the reserve, of the n-th largest GPU (index n - 1): the most an n-GPU task can have
        # (a one-GPU task any target's, a multi-GPU task whole GPUs': see `_for`).
        self._usable_mib = sorted((g.total_mib - self.config.reserve_mib for g in gpus), reverse=True)
        self._usable_whole_mib = sorted(
            (g.total_mib - self.config.reserve_mib for g in gpus if not g.exclusive), reverse=True
        )
        self._windows = {g: MonitorWindow(self.config.window_samples, self.config.risk.weights) for g in indices}
        self._ttfk = TtfkTable(indices, self.config.window_s)
        self._rr = RoundRobin(indices)
        self._tasks: dict[TaskId, Task] = {}
        self._queue: deque[TaskId] = deque()
        self._recovery: deque[TaskId] = deque()
        self._crashed: list[TaskId] = []  # OOM-crashed, awaiting the recovery scan
        self._on_gpu: dict[int, set[TaskId]] = {g: set() for g in indices}
        self._foreign: dict[int, int] = dict.fromkeys(indices, 0)
        self._needs: dict[TaskId, MemoryNeed] = {}
        self._blocked: dict[TaskId, str] = {}
        self._changed: set[TaskId] = set()  # tasks changed since the world last took the changes to persist
        self._next_id = 1

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
        self._queue.append(task.id)
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
            self._queue.append(task.id)
        elif task.state is TaskState.RECOVERING:
            self._recovery.append(task.id)
        elif task.state is TaskState.OOM_CRASHED:
            self._crashed.append(task.id)
        elif task.state in ACTIVE_STATES:
            attempt = task.current
            for gpu in attempt.gpus:
                self._on_gpu[gpu].add(task.id)
                self._ttfk.dispatched(gpu, task.id, attempt.dispatched_s)
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

    def cancel(self, task_id: TaskId, now: float) -> bool:
        """Cancel a task; True when its process is live and the world must kill it."""
        task = self.task(task_id)
        if task.terminal:
            return False
        if task.state in ACTIVE_STATES:
            task.cancel_requested = True
            self._changed.add(task_id)
            return True
        for queue in (self._queue, self._recovery):
            if task_id in queue:
                queue.remove(task_id)
        if task_id in self._crashed:
            self._crashed.remove(task_id)
        self._finish(task, TaskState.CANCELLED, now, "cancelled by request")
        return False

    def record_sample(self, sample: GpuSample) -> None:
        self._windows[sample.gpu].add(sample)

    def record_gpu_processes(self, gpu: int, tasks: Iterable[TaskId], foreign: int, now: float) -> None:
        """What a GPU's process list shows: carma tasks on it (first kernels) and other processes."""
        self._foreign[gpu] = foreign
        if foreign:  # someone else's process: the tasks here no longer run alone (an OOM may not be theirs)
            for task_id in self._on_gpu[gpu]:
                if not self._tasks[task_id].current.shared:
                    self._tasks[task_id].current.shared = True
                    self._changed.add(task_id)
        for task_id in tasks:
            if self._ttfk.seen(gpu, task_id, now):
                task = self._tasks[task_id]
                if task.state is TaskState.DISPATCHED:
                    task.state = TaskState.RUNNING
                    task.current.first_kernel_s = now
                    self._changed.add(task_id)

    def record_exit(self, task_id: TaskId, exit: ProcessExit, now: float) -> ExitKind | None:
        """A task's process ended; returns how it was classified (None for a task not running)."""
        task = self.task(task_id)
        if task.state not in ACTIVE_STATES:
            return None
        attempt = task.current
        kind = classify_exit(exit, killed_by_request=task.cancel_requested)
        attempt.ended_s = now
        attempt.outcome = kind
        self._changed.add(task_id)
        for gpu in attempt.gpus:
            self._on_gpu[gpu].discard(task_id)
        self._ttfk.ended(task_id)
        if kind is ExitKind.KILLED:
            self._finish(task, TaskState.CANCELLED, now, "cancelled by request")
        elif kind is ExitKind.SUCCESS:
            self._finish(task, TaskState.COMPLETED, now, "")
        elif kind is ExitKind.OOM:
            attempt.message = oom_message(exit)
            task.state = TaskState.OOM_CRASHED
            self._crashed.append(task_id)
        else:
            self._finish(task, TaskState.FAILED, now, _error_reason(exit))
        return kind

    # ----------------------------------------------------------------- decisions

    def decide(self, now: float) -> list[Launch]:
        """Recovery scan, then place queue heads (recovery queue first) until one must wait."""
        self._recovery_scan(now)
        self._blocked.clear()
        launches: list[Launch] = []
        while True:
            if self._recovery:
                task = self._tasks[self._recovery[0]]
                n = task.spec.gpus
                outgrown = self._outgrown(task)
                first_need = task.attempts[0].need  # what it was first placed with: a GPU must hold a known one
                # After running out alone, the largest idle GPUs that are larger than those it outgrew.
                idle = sorted(
                    (g for g in self._for(n, self._idle_gpus()) if self.gpus[g].total_mib > outgrown),
                    key=lambda g: -self.gpus[g].total_mib if outgrown else 0,
                )
                if first_need is not None:
                    idle = self._whole(idle, first_need, n)
                if len(idle) < n:
                    larger = f" larger than {outgrown} MiB" if outgrown else ""
                    waiting = self._waiting_whole(
                        n, first_need, larger, " (its need when first placed, with the margin)"
                    )
                    self._blocked[task.id] = f"recovery: {waiting}"
                    break
                launches.append(self._launch(task, idle[:n], RECOVERY_NEED, now, recovery=True))
                continue
            if not self._queue:
                break
            task = self._tasks[self._queue[0]]
            placement = self._place(task, now)
            if isinstance(placement, str):
                self._blocked[task.id] = placement
                break
            launches.append(self._launch(task, placement, self._needs.pop(task.id), now, recovery=False))
        return launches

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
        return list(self._queue)

    @property
    def recovery_queue(self) -> list[TaskId]:
        return list(self._recovery)

    def pending(self) -> bool:
        """Whether any task waits for a placement (or for the recovery scan)."""
        return bool(self._queue or self._recovery or self._crashed)

    def gpu_status(self, now: float) -> list[GpuStatus]:
        out = []
        for g, window in self._windows.items():
            risk = window.risk() if window.latest is not None else None
            out.append(
                GpuStatus(
                    gpu=self.gpus[g],
                    latest=window.latest,
                    risk=risk,
                    # a MIG instance is never collocated, so never filtered: its missing metrics (NVML has none
                    # per instance) are no risk
                    excluded=bool(
                        risk
                        and self.config.risk.enabled
                        and not self.gpus[g].exclusive
                        and risk.excluded(self.config.risk)
                    ),
                    valid=self._ttfk.valid(g, now),
                    awaiting_first_kernel=self._ttfk.awaiting(g),
                    tasks=tuple(sorted(self._on_gpu[g])),
                    foreign=self._foreign[g],
                    held_mib=self._held_mib(g) if self.config.hold_known_needs else 0,
                )
            )
        return out

    def waiting_reason(self, task_id: TaskId) -> str | None:
        """Why a waiting task was not placed at the last decision (by its state, not a scan of the queues:
        listing thousands of waiting tasks asks this of each)."""
        if task_id in self._blocked:
            return self._blocked[task_id]
        state = self._tasks[task_id].state if task_id in self._tasks else None
        if state is TaskState.RECOVERING:
            return UNDECIDED if self._recovery[0] == task_id else HEAD_OF_LINE  # a recovering task is in it
        if state is TaskState.QUEUED:
            if self._recovery:
                return RECOVERY_FIRST
            return UNDECIDED if self._queue[0] == task_id else HEAD_OF_LINE  # as a queued one is in this
        return None

    # ----------------------------------------------------------------- internals

    def _recovery_scan(self, now: float) -> None:
        for task_id in self._crashed:
            task = self._tasks[task_id]
            attempt = task.current
            relaunches = sum(1 for a in task.attempts if a.recovery)
            gpus = ",".join(map(str, attempt.gpus))
            outgrown = self._outgrown(task)
            n = task.spec.gpus
            if sum(self.gpus[g].total_mib > outgrown for g in self._for(n, list(self.gpus))) < n:
                reason = f"out of memory alone on GPU {gpus}: it needs more memory than the GPU has"
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
                self._recovery.append(task_id)
                self._changed.add(task_id)
        self._crashed.clear()

    def _outgrown(self, task: Task) -> int:
        """The memory (MiB) of the largest GPUs the task ran out of memory on while alone (0: none): a
        relaunch can only help on larger ones. Of a multi-GPU attempt's GPUs, the smallest counts."""
        return max(
            (
                min(self.gpus[g].total_mib if g in self.gpus else 0 for g in attempt.gpus)
                for attempt in task.attempts
                if attempt.outcome is ExitKind.OOM and not attempt.shared
            ),
            default=0,
        )

    def _whole_mib(self, need: MemoryNeed, n: int) -> int | None:
        """The memory (MiB, less the reserve) each GPU of an `n`-GPU task must have to hold it whole: its need
        known in MiB with the margin, or the n largest GPUs' for a need larger; None for a need not known."""
        return None if need.mib is None else min(need.mib + self.config.margin_mib, self._usable(n))

    def _waiting_whole(self, n: int, need: MemoryNeed | None, larger: str = "", whose: str = "") -> str:
        """Why a task waits for whole idle GPUs, with the memory each must hold when its need is known (and
        `whose` that is: a relaunch's is its first placement's, which its crash may have shown too small)."""
        required = None if need is None else self._whole_mib(need, n)
        can_hold = f" that can hold {required} MiB{whose}" if required is not None else ""
        return f"waiting for {pluralize(n, 'whole idle GPU')}{larger}{can_hold}"

    def _usable(self, n: int) -> int:
        """The most memory (MiB, less the reserve) each GPU of an `n`-GPU task can have."""
        return self._usable_mib[0] if n == 1 else self._usable_whole_mib[n - 1]

    def _shareable(self, gpu: int) -> bool:
        """Whether another task may join `gpu`: not a MIG instance, nor (with `exclusive_relaunch`) holding a
        relaunch after an OOM crash, which then keeps its GPUs to itself so that the crash cannot recur."""
        if self.gpus[gpu].exclusive:
            return False
        return not (self.config.exclusive_relaunch and any(self._tasks[t].current.recovery for t in self._on_gpu[gpu]))

    def _for(self, n: int, gpus: list[int]) -> list[int]:
        """The GPUs among `gpus` an `n`-GPU task may take: a process sees one MIG instance at most (CUDA
        enumerates a single one), so a multi-GPU task takes whole GPUs only."""
        return gpus if n == 1 else [g for g in gpus if not self.gpus[g].exclusive]

    def _whole(self, gpus: list[int], need: MemoryNeed, n: int) -> list[int]:
        """The GPUs among `gpus` an `n`-GPU task may have whole (`_whole_mib`): on a smaller one it would only
        run out of memory alone."""
        required = self._whole_mib(need, n)
        if required is None:
            return gpus
        return [g for g in gpus if self.gpus[g].total_mib - self.config.reserve_mib >= required]

    def _idle_gpus(self) -> list[int]:
        """GPUs with no task and no other process, that telemetry has reported at least once."""
        return [
            g
            for g, window in self._windows.items()
            if not self._on_gpu[g] and not self._foreign[g] and window.latest is not None
        ]

    def _free_mib(self, gpu: int, hold: bool = True) -> int:
        """What a new task may take on `gpu`, less the reserve: the memory telemetry shows free, and (with
        `hold_known_needs`, unless `hold` is False) no more than the needs known in MiB of the tasks on it leave,
        whether or not they have allocated them yet. Their margin is not held: what a task uses beyond its
        need shows as used."""
        latest = self._windows[gpu].latest
        free = latest.free_mib
        if hold and self.config.hold_known_needs:
            free = min(free, latest.total_mib - self._held_mib(gpu))
        return max(0, free - self.config.reserve_mib)

    def _held_mib(self, gpu: int) -> int:
        """The needs known in MiB of the tasks on `gpu` (per GPU, for a multi-GPU task): one too large for a
        GPU with the margin, placed on whole GPUs, is held too, or others join it once its window passes."""
        needs = (self._tasks[t].current.need for t in self._on_gpu[gpu])
        return sum(need.mib for need in needs if need is not None and need.mib is not None)

    def _candidates(self, gpus: list[int]) -> list[Candidate]:
        lug = self.config.policy is Policy.LUG
        return [Candidate(g, self._free_mib(g), self._lug_key(g) if lug else 0.0) for g in gpus]

    def _lug_key(self, gpu: int) -> float:
        """LUG ranks by SMACT risk; a GPU whose SMACT is unknown ranks last."""
        smact = self._windows[gpu].risk().smact
        return float("inf") if smact is None else smact

    def _place(self, task: Task, now: float) -> list[int] | str:
        """GPUs for the head task, or why it must wait."""
        cfg = self.config
        n = task.spec.gpus
        need = self._needs.get(task.id)
        if need is None:
            need = resolve_need(task, self.estimator, self._usable(n), cfg.margin_mib)
            if need is None:
                return ESTIMATING
            self._needs[task.id] = need
        idle = self._whole(self._for(n, self._idle_gpus()), need, n)
        if cfg.policy is Policy.EXCLUSIVE or need.kind is NeedKind.WHOLE_GPU:
            if len(idle) >= n:  # in the policy's order too (Exclusive's is the index)
                return [c.gpu for c in order(cfg.policy, self._candidates(idle), self._rr)[:n]]
            return self._waiting_whole(n, need)
        if cfg.prefer_idle and len(idle) >= n:
            return [c.gpu for c in order(cfg.policy, self._candidates(idle), self._rr)[:n]]
        shareable = [g for g in self._windows if self._shareable(g) and self._windows[g].latest is not None]
        gpus = [g for g in shareable if self._ttfk.valid(g, now)]
        if len(gpus) < n:
            return f"needs {pluralize(n, 'GPU')}; {len(gpus)} shareable and not awaiting a first kernel (TTFK)"
        if cfg.policy is not Policy.RR:
            known = need.kind is NeedKind.KNOWN
            required = need.mib + cfg.margin_mib if known else cfg.min_free_mib
            fitting = [g for g in gpus if self._free_mib(g) >= required]
            if len(fitting) < n:
                has = inflect(len(fitting), "has", "have")
                # free as `carma gpus` shows it: the reserve is taken off what telemetry reads
                parts = f"need {need.mib} + margin {cfg.margin_mib}" if known else f"min_free_mib {cfg.min_free_mib}"
                free = f"{required + cfg.reserve_mib} MiB free ({parts} + reserve {cfg.reserve_mib})"
                reason = f"needs {pluralize(n, 'GPU')} with {free}; {len(fitting)} {has} it"
                asides = []  # the GPUs with the memory that something else keeps from it
                if (held := sum(self._free_mib(g, hold=False) >= required for g in gpus) - len(fitting)) > 0:
                    show = inflect(held, "shows", "show")
                    asides.append(f"{held} more {show} it free, but their tasks' known needs hold it")
                if awaiting := sum(self._free_mib(g) >= required for g in shareable if g not in gpus):
                    has = inflect(
                        awaiting, "has it free, but awaits its task's", "have it free, but await their tasks'"
                    )
                    asides.append(f"{awaiting} more {has} first kernel (TTFK)")
                return reason + (f" ({'; '.join(asides)})" if asides else "")
            gpus = fitting
            if cfg.risk.enabled:
                risks = {g: self._windows[g].risk() for g in gpus}
                risky = [g for g in gpus if risks[g].excluded(cfg.risk)]
                gpus = [g for g in gpus if g not in risky]
                if len(gpus) < n:
                    passes = inflect(len(gpus), "passes", "pass")
                    reason = (
                        f"needs {pluralize(n, 'GPU')}; only {len(gpus)} with enough memory {passes} the risk filter"
                    )
                    return f"{reason} ({self._risky(risky, risks)})"
        return [c.gpu for c in order(cfg.policy, self._candidates(gpus), self._rr)[:n]]

    def _risky(self, gpus: list[int], risks: dict[int, Risk]) -> str:
        """Why `gpus` fail the risk filter, each by its scores (as `carma gpus` shows them), or for more than
        two (a line of `carma queue`) their indices."""
        if len(gpus) > 2:
            return f"GPUs {', '.join(map(str, gpus))}: `carma gpus` shows their risk"
        return "; ".join(f"GPU {g}: {risks[g].why(self.config.risk)}" for g in gpus)

    def _launch(self, task: Task, gpus: list[int], need: MemoryNeed, now: float, recovery: bool) -> Launch:
        (self._recovery if recovery else self._queue).popleft()
        shared = any(self._on_gpu[g] or self._foreign[g] for g in gpus)
        for g in gpus:
            for other in self._on_gpu[g]:
                self._tasks[other].current.shared = True
            self._on_gpu[g].add(task.id)
            self._ttfk.dispatched(g, task.id, now)
        attempt = Attempt(
            number=len(task.attempts) + 1,
            gpus=tuple(sorted(gpus)),
            dispatched_s=now,
            exclusive=not shared,
            recovery=recovery,
            need=need,
            shared=shared,
        )
        task.attempts.append(attempt)
        task.state = TaskState.DISPATCHED
        self._changed.add(task.id)
        if self.config.policy is Policy.RR and not recovery:
            self._rr.placed(gpus)
        return Launch(task.id, attempt.number, attempt.gpus, attempt.exclusive, recovery)

    def _finish(self, task: Task, state: TaskState, now: float, reason: str) -> None:
        task.state = state
        task.reason = reason
        task.ended_s = now
        self._needs.pop(task.id, None)
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
