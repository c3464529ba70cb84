"""A simulated GPU server that runs a trace through the scheduling loop.

It implements the core's ports itself: a virtual clock, telemetry from its GPU model (1 Hz samples) and
an executor whose "processes" show on their GPUs after the workload's time to first kernel (with their
CUDA context and weights), allocate the rest of their memory after a warm-up (a CUDA out-of-memory exit
when an allocation does not fit), progress at a speed set by their co-runners, and exit.

Between events every GPU's state is constant, so the twin keeps a piecewise-constant timeline per GPU
and derives samples, energy and utilization from it exactly. The scheduling loop runs on the 1 Hz grid,
like the daemon, but only at instants where a decision could change: after an event, while a GPU's
monitor window still holds samples from before its last change, and when a TTFK grace window ends.

A workload named in `growing` has memory that grows during its run (LLM inference with a growing context,
training with growing sequences): from its need after the warm-up, linearly in its progress, to the given
peak at its end, one allocation every `GROWTH_STEP_S`; an allocation that does not fit ends it out of memory,
unless the scheduler's growth prediction (`carma.core.early`) restarted it first.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from carma.core.loop import SchedulingLoop
from carma.core.ports import GpuProcesses, TaskExit, TelemetryReading
from carma.core.scheduler import Scheduler, SpecError
from carma.core.types import GpuSample, Launch, ProcessExit, Reconfigure, Target, TargetId, Task, TaskId, TaskSpec
from carma.metrics.timeline import Segment
from carma.reasons import waiting_reason
from carma.sim.gpus import GpuType
from carma.sim.models import InterferenceModel, Load, PowerModel
from carma.traces.catalog import Workload
from carma.traces.loaders import Trace, TraceEntry
from carma.units import pluralize

# event priorities at equal times: task events first, then submissions, then the decision tick, then growth
_SEEN, _FULL, _FINISH, _SUBMIT, _TICK, _GROW = 0, 1, 2, 3, 4, 5
GROWTH_STEP_S = 10.0


class SimulationStalled(RuntimeError):
    """The simulation ran out of events with tasks still waiting: the server stayed idle and the scheduler
    would still not place them, so a scheduler setting can never be met (e.g. `min_free_mib` above what
    any GPU has) or the scheduler has a bug; never a trace's fault."""


@dataclass
class _SimGpu:
    index: int  # its position in the server (the twin's own handle)
    kind: GpuType
    id: TargetId  # the scheduler's name for it
    allocated: dict[TaskId, int] = field(default_factory=dict)  # processes shown on the GPU, with their memory
    running: set[TaskId] = field(default_factory=set)  # those past their warm-up, computing
    segments: list[Segment] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)

    @property
    def used_mib(self) -> int:
        return sum(self.allocated.values())


@dataclass
class _SimTask:
    workload: Workload
    load: Load
    gpus: tuple[int, ...] = ()
    attempt: int = 0  # the attempt running (a growth event of an earlier one is stale)
    version: int = 0  # bumped to invalidate scheduled events of an earlier attempt or rate
    remaining_s: float = 0.0  # solo-speed seconds of GPU work left
    rate: float = 0.0
    since: float = 0.0


class TwinServer:
    """Clock, Telemetry and Executor of a simulated server, plus the event loop that drives them."""

    def __init__(
        self,
        gpus: Sequence[GpuType],
        scheduler_factory: Callable[[list[Target]], Scheduler],
        interference: InterferenceModel,
        sharing: str,
        power: PowerModel,
        fragmentation: float,
        oracle_memory: bool,
        growing: Mapping[str, int] | None = None,
    ) -> None:
        self._gpus = [_SimGpu(i, kind, target_id(i)) for i, kind in enumerate(gpus)]
        self._growing = dict(growing or {})  # workload name -> its memory at the end of its run
        self._index = {g.id: g.index for g in self._gpus}
        self._interference = interference
        self._sharing = sharing
        self._power = power
        self._fragmentation = fragmentation
        self._oracle_memory = oracle_memory
        self._now = 0.0
        self._events: list[tuple[float, int, int, object, int]] = []
        self._seq = 0
        self._ticks: set[float] = set()
        self._tasks: dict[TaskId, _SimTask] = {}
        self._exits: list[TaskExit] = []
        self._last_read = -math.inf
        self._last_change = [-math.inf] * len(self._gpus)
        scheduler: Scheduler = scheduler_factory(self.gpus())
        self.loop = SchedulingLoop(scheduler, self, self, self)
        self._interval = scheduler.config.sample_interval_s
        self._window = scheduler.config.window_samples
        for gpu in self._gpus:
            self._record(gpu)

    # ----------------------------------------------------------------- Clock

    def now(self) -> float:
        return self._now

    # ----------------------------------------------------------------- Telemetry

    def gpus(self) -> list[Target]:
        return [Target(g.id, g.kind.name, g.kind.total_mib) for g in self._gpus]

    def read(self, now: float) -> TelemetryReading:
        first = max(self._last_read + self._interval, now - (self._window - 1) * self._interval)
        k0 = math.ceil(first / self._interval - 1e-9)
        k1 = math.floor(now / self._interval + 1e-9)
        self._last_read = k1 * self._interval
        samples = [self._sample(g, k * self._interval) for k in range(k0, k1 + 1) for g in self._gpus]
        processes = {g.id: GpuProcesses(frozenset(g.allocated), used_mib=dict(g.allocated)) for g in self._gpus}
        return TelemetryReading(samples, processes)

    def _sample(self, gpu: _SimGpu, t: float) -> GpuSample:
        seg = gpu.segments[bisect_right(gpu.starts, t) - 1]
        return GpuSample(gpu.id, t, seg.used_mib, gpu.kind.total_mib, seg.smact, seg.smocc, seg.drama, seg.power_w)

    def workload(self, task_id: TaskId) -> Workload:
        """The workload of a submitted task: its trace entry's."""
        return self._tasks[task_id].workload

    def left_s(self, task_id: TaskId) -> float | None:
        """The seconds a computing task has left at its speed now (None before it computes): what a history of
        earlier runs would say, here known exactly."""
        sim = self._tasks[task_id]
        if not sim.rate:
            return None
        return max(0.0, sim.remaining_s - sim.rate * (self._now - sim.since)) / sim.rate

    # ----------------------------------------------------------------- Executor

    def launch(self, task: Task, launch: Launch) -> None:
        sim = self._tasks[task.id]
        sim.version += 1
        sim.attempt = launch.attempt
        sim.gpus = tuple(self._index[g] for g in launch.gpus)
        self._push(self._now + sim.workload.ttfk_s, _SEEN, task.id, sim.version)

    def kill(self, task_id: TaskId) -> None:
        sim = self._tasks[task_id]
        sim.version += 1
        self._end(task_id, ProcessExit(exit_code=None, signal=9, log_tail="Killed"))

    def reconfigure(self, action: Reconfigure) -> None:
        """Whole GPUs have no MIG layout to change (the dynamic MIG twin is `carma.sim.migtwin`)."""
        raise ValueError(f"GPU {action.gpu} is not a dynamic MIG GPU: simulate with --mig dynamic")

    def poll_exits(self) -> list[TaskExit]:
        exits, self._exits = self._exits, []
        return exits

    # ----------------------------------------------------------------- running a trace

    def run(self, trace: Trace) -> None:
        for entry in trace.entries:
            self._push(entry.submit_s, _SUBMIT, entry, 0)
        while self._events:
            t, kind, _, payload, version = heapq.heappop(self._events)
            self._now = t
            if kind == _TICK:
                self._ticks.discard(t)
                self.loop.step()
                self._schedule_next_tick()
                continue
            if kind == _SUBMIT:
                self._submit(payload)
            elif kind == _GROW:
                self._grow(payload)
            elif self._tasks[payload].version != version:
                continue  # stale: the attempt was killed or its rate changed
            elif kind == _SEEN:
                self._seen(payload)
            elif kind == _FULL:
                self._full(payload)
            else:
                self._end(payload, ProcessExit(exit_code=0))
            self._tick_at(self._next_grid(t))
        scheduler = self.loop.scheduler
        stuck = [t for t in scheduler.tasks if not t.terminal]
        if stuck:
            names = ", ".join(f"{t.id}:{t.spec.name}({t.state})" for t in stuck[:5])
            why = next((reason for t in stuck if (reason := waiting_reason(scheduler, t.id))), "no reason given")
            raise SimulationStalled(
                f"{pluralize(len(stuck), 'task')} never finished on the idle server: {names}; the scheduler says: "
                f"{why} (check the [scheduler] settings)"
            )

    @property
    def timelines(self) -> list[list[Segment]]:
        return [g.segments for g in self._gpus]

    # ----------------------------------------------------------------- events

    def _push(self, t: float, kind: int, payload: object, version: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload, version))

    def _next_grid(self, t: float) -> float:
        """The first loop instant on the 1 Hz grid at or after `t` (never before: no decision in the past)."""
        return max(t, math.ceil(t / self._interval) * self._interval)

    def _tick_at(self, t: float) -> None:
        if t not in self._ticks:
            self._ticks.add(t)
            self._push(t, _TICK, None, 0)

    def _schedule_next_tick(self) -> None:
        sched = self.loop.scheduler
        if not sched.pending():
            return
        horizon = self._window * self._interval
        if any(self._now < change + horizon for change in self._last_change):
            self._tick_at(self._now + self._interval)
            return
        timer = sched.next_timer(self._now)
        if timer is not None:
            self._tick_at(self._next_grid(timer))

    def _submit(self, entry: TraceEntry) -> None:
        workload = entry.workload
        mem = workload.mem_mib if self._oracle_memory else None
        try:
            task = self.loop.submit(TaskSpec(workload.name, workload.gpus, mem))
        except SpecError as e:  # a task this server can never run: the trace's line, not just the task's name
            raise SpecError(f"{entry.where}: {e}" if entry.where else str(e)) from None
        load = Load(workload.gract, workload.smact, workload.smocc, workload.drama)
        self._tasks[task.id] = _SimTask(workload, load)

    def _allocate(self, task_id: TaskId, total_mib: int) -> bool:
        """Grow the task's allocation to `total_mib` on each of its GPUs, or end it out of memory.

        A request fails when it exceeds the free memory less the fragmentation allowance, a share of what
        the co-runners hold.
        """
        sim = self._tasks[task_id]
        for g in sim.gpus:
            gpu = self._gpus[g]
            own = gpu.allocated.get(task_id, 0)
            others = gpu.used_mib - own
            request = total_mib - own
            free = gpu.kind.total_mib - gpu.used_mib
            if request > free - self._fragmentation * others:
                self._end(task_id, _oom_exit(g, request, gpu.kind.total_mib, free))
                return False
        for g in sim.gpus:
            self._gpus[g].allocated[task_id] = total_mib
        return True

    def _seen(self, task_id: TaskId) -> None:
        """The process shows on its GPUs with its CUDA context and weights."""
        sim = self._tasks[task_id]
        if self._allocate(task_id, sim.workload.mem_first_mib):
            for g in sim.gpus:
                self._record(self._gpus[g])
            self._push(self._now + sim.workload.warmup_s, _FULL, task_id, sim.version)

    def _full(self, task_id: TaskId) -> None:
        """Warm-up done: the task holds all its memory and computes."""
        sim = self._tasks[task_id]
        if not self._allocate(task_id, sim.workload.mem_mib):
            return
        w = sim.workload
        sim.remaining_s = w.solo_s - w.ttfk_s - w.warmup_s
        sim.since = self._now
        sim.rate = 0.0  # not progressing until _reschedule gives it a speed
        for g in sim.gpus:
            self._gpus[g].running.add(task_id)
        self._reschedule(sim.gpus)
        if w.name in self._growing:
            self._push(self._now + GROWTH_STEP_S, _GROW, (task_id, sim.attempt), 0)

    def _grow(self, payload: object) -> None:
        """A growing task allocates its memory at its progress so far, and grows again a step later."""
        assert isinstance(payload, tuple)
        task_id, attempt = payload
        sim = self._tasks[task_id]
        if sim.attempt != attempt or not sim.gpus or task_id not in self._gpus[sim.gpus[0]].running:
            return  # that attempt has ended
        w = sim.workload
        work_s = w.solo_s - w.ttfk_s - w.warmup_s
        left_s = sim.remaining_s - sim.rate * (self._now - sim.since)
        done = min(1.0, max(0.0, 1 - left_s / work_s)) if work_s > 0 else 1.0
        if self._allocate(task_id, round(w.mem_mib + (self._growing[w.name] - w.mem_mib) * done)):
            for g in sim.gpus:
                self._record(self._gpus[g])
            self._push(self._now + GROWTH_STEP_S, _GROW, payload, 0)

    def _end(self, task_id: TaskId, exit: ProcessExit) -> None:
        sim = self._tasks[task_id]
        self._exits.append(TaskExit(task_id, exit, self._now))
        shown = [g for g in sim.gpus if task_id in self._gpus[g].allocated]
        for g in shown:
            del self._gpus[g].allocated[task_id]
            self._gpus[g].running.discard(task_id)
        self._reschedule(shown)
        self._tick_at(self._next_grid(self._now))

    # ----------------------------------------------------------------- the GPU model

    def _slowdowns(self, gpu: _SimGpu) -> dict[TaskId, float]:
        tasks = sorted(gpu.running)
        loads = [self._tasks[t].load for t in tasks]
        return dict(zip(tasks, self._interference.slowdowns(loads, self._sharing), strict=True))

    def _reschedule(self, changed: Sequence[int]) -> None:
        """Recompute speeds after the tasks on `changed` GPUs changed, and those GPUs' timelines."""
        slowdowns = {g: self._slowdowns(self._gpus[g]) for g in changed}
        touched = set(changed)
        for task_id in {t for g in changed for t in self._gpus[g].running}:
            sim = self._tasks[task_id]
            for g in sim.gpus:
                if g not in slowdowns:
                    slowdowns[g] = self._slowdowns(self._gpus[g])
            rate = 1.0 / max(slowdowns[g][task_id] for g in sim.gpus)
            if rate == sim.rate:
                continue
            sim.remaining_s -= sim.rate * (self._now - sim.since)
            sim.since = self._now
            sim.rate = rate
            sim.version += 1
            touched.update(sim.gpus)
            self._push(self._now + max(0.0, sim.remaining_s) / rate, _FINISH, task_id, sim.version)
        for g in touched:
            self._record(self._gpus[g])

    def _record(self, gpu: _SimGpu) -> None:
        smact = smocc = drama = 0.0
        for task_id in gpu.running:
            sim = self._tasks[task_id]
            smact += sim.load.smact * sim.rate
            smocc += sim.load.smocc * sim.rate
            drama += sim.load.drama * sim.rate
        smact, smocc, drama = min(1.0, smact), min(1.0, smocc), min(1.0, drama)
        seg = Segment(
            self._now,
            smact,
            smocc,
            drama,
            gpu.used_mib,
            self._power.power_w(gpu.kind, smact),
            len(gpu.allocated),
        )
        if gpu.segments and gpu.segments[-1].t == self._now:
            gpu.segments[-1] = seg
        else:
            gpu.segments.append(seg)
            gpu.starts.append(self._now)
        self._last_change[gpu.index] = self._now


def target_id(index: int) -> TargetId:
    """The id of the twin's GPU at `index` (a simulated GPU's UUID)."""
    return f"SIM-GPU-{index}"


def target_index(target: TargetId) -> int:
    """The index of the twin's GPU `target` names, or of the GPU that holds the MIG instance it names
    (`SIM-GPU-0/3g.20gb@4`: 0)."""
    return int(target.removeprefix("SIM-GPU-").partition("/")[0])


def _oom_exit(gpu: int, need_mib: int, total_mib: int, free_mib: int) -> ProcessExit:
    """The error a PyTorch training script prints when an allocation does not fit."""
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. "
        f"Tried to allocate {need_mib / 1024:.2f} GiB. GPU {gpu} has a total capacity of "
        f"{total_mib / 1024:.2f} GiB of which {max(free_mib, 0)} MiB is free."
    )
    return ProcessExit(exit_code=1, log_tail=f"Traceback (most recent call last):\n{message}\n")
