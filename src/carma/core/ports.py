"""The ports through which a world drives the core: a clock, telemetry, an executor, a journal and a
memory estimator.

The real world implements them with the wall clock, NVML/DCGM, subprocesses, SQLite and background
estimates; the digital twin with a virtual clock, a GPU model and recorded estimates. `SchedulingLoop` and
`Scheduler` are written against these protocols only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from carma.core.types import (
    GpuSample,
    Launch,
    MemoryNeed,
    ProcessExit,
    Reconfigure,
    Target,
    TargetId,
    Task,
    TaskId,
)


class Clock(Protocol):
    def now(self) -> float: ...


@dataclass(frozen=True)
class GpuProcesses:
    """One GPU's process list, resolved to the carma tasks it shows and a count of other processes."""

    tasks: frozenset[TaskId] = frozenset()
    foreign: int = 0
    used_mib: Mapping[TaskId, int] = field(default_factory=dict)  # each task's memory on it, where the world can tell


@dataclass(frozen=True)
class TelemetryReading:
    samples: Sequence[GpuSample] = ()  # new samples since the previous reading, oldest first
    processes: Mapping[TargetId, GpuProcesses] = field(default_factory=dict)


class Telemetry(Protocol):
    def gpus(self) -> Sequence[Target]:
        """The targets the world has now, in its order."""
        ...

    def read(self, now: float) -> TelemetryReading: ...


@dataclass(frozen=True)
class TaskExit:
    task_id: TaskId
    exit: ProcessExit
    ended_s: float


class Journal(Protocol):
    """Where a world persists task changes before acting on them (the daemon's store)."""

    def save(self, tasks: Sequence[Task]) -> None: ...


class Executor(Protocol):
    """Carries out the core's actions (`SchedulingLoop` hands each to the method for its kind) and reports
    the exits of the processes it started."""

    def launch(self, task: Task, launch: Launch) -> None: ...

    def kill(self, task_id: TaskId) -> None: ...

    def reconfigure(self, action: Reconfigure) -> None:
        """Destroy and create a MIG GPU's instances; afterwards `Telemetry.gpus` lists the new layout (an instance
        still being made is listed but not read, so no task is placed on it until it is). A world without
        dynamic MIG raises ValueError, one line."""
        ...

    def poll_exits(self) -> Sequence[TaskExit]: ...


class Estimator(Protocol):
    """A memory estimator: the task's need as the estimator sees it, or None while it is computing."""

    name: str  # shown in need sources and waiting reasons

    def need(self, task: Task) -> MemoryNeed | None: ...
