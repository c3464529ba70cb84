"""Domain types of the decision core: tasks, their attempts, GPUs and telemetry samples.

Values that travel between the core and a world (specs, samples, actions, exits) are frozen;
`Task` and `Attempt` are the core's own mutable records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

TaskId = int


class TaskState(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"  # launched, awaiting its first kernel
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    OOM_CRASHED = "oom_crashed"  # the last attempt ran out of memory; about to be recovered or failed
    RECOVERING = "recovering"  # waiting in the recovery queue for whole idle GPUs
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED})
ACTIVE_STATES = frozenset({TaskState.DISPATCHED, TaskState.RUNNING})


class ExitKind(StrEnum):
    SUCCESS = "success"
    OOM = "oom"
    ERROR = "error"
    KILLED = "killed"


class NeedKind(StrEnum):
    KNOWN = "known"
    UNKNOWN = "unknown"  # recovery only: placed by the minimum-free precondition
    WHOLE_GPU = "whole_gpu"


@dataclass(frozen=True)
class MemoryNeed:
    kind: NeedKind
    mib: int | None = None
    source: str = ""


@dataclass(frozen=True)
class TaskSpec:
    """What a user asks for. `mem_mib` is the user's (or an oracle's) declared GPU memory need."""

    name: str
    gpus: int = 1
    mem_mib: int | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"task {self.name!r}: gpus must be at least 1, got {self.gpus}")
        if self.mem_mib is not None and self.mem_mib <= 0:
            raise ValueError(f"task {self.name!r}: memory need must be positive, got {self.mem_mib} MiB")


@dataclass(frozen=True)
class GpuInfo:
    """A placement target: a whole GPU, or a MIG instance (`exclusive`: one task at a time, no collocation)."""

    index: int
    name: str
    total_mib: int
    uuid: str = ""
    exclusive: bool = False


@dataclass(frozen=True)
class GpuSample:
    """One 1 Hz reading of one GPU. Utilization metrics are fractions in [0, 1]; None where the backend
    cannot read them (the risk rule then follows `RiskConfig.missing`, never a made-up zero)."""

    gpu: int
    t: float
    used_mib: int
    total_mib: int
    smact: float | None
    smocc: float | None
    drama: float | None
    power_w: float | None = None  # board power (None for a MIG instance: power is per GPU)
    energy_j: float | None = None  # the device's cumulative energy counter
    temperature_c: float | None = None

    @property
    def free_mib(self) -> int:
        return self.total_mib - self.used_mib


@dataclass(frozen=True)
class ProcessExit:
    """How a task's process ended, as a world observed it (exit status and the tail of its error log)."""

    exit_code: int | None
    log_tail: str = ""
    signal: int | None = None
    tail_is_output: bool = False  # the tail is of its standard output: it wrote no errors


@dataclass(frozen=True)
class Launch:
    """An action: start `task_id` (attempt `attempt`) on `gpus`."""

    task_id: TaskId
    attempt: int
    gpus: tuple[int, ...]
    exclusive: bool
    recovery: bool = False


@dataclass(frozen=True)
class Kill:
    """An action: stop `task_id`'s live attempt `attempt` (a cancel); its exit is reported as any other."""

    task_id: TaskId
    attempt: int


# What the core asks a world to do; the scheduling loop hands each to the executor by its type.
Action = Launch | Kill


@dataclass
class Attempt:
    number: int
    gpus: tuple[int, ...]
    dispatched_s: float
    exclusive: bool
    recovery: bool
    first_kernel_s: float | None = None
    ended_s: float | None = None
    outcome: ExitKind | None = None
    message: str = ""
    need: MemoryNeed | None = None
    shared: bool = False  # another task ran on one of its GPUs at some point during the attempt


@dataclass
class Task:
    id: TaskId
    spec: TaskSpec
    submit_s: float
    state: TaskState = TaskState.QUEUED
    attempts: list[Attempt] = field(default_factory=list)
    reason: str = ""  # why it failed or was cancelled
    cancel_requested: bool = False
    ended_s: float | None = None  # when it reached a terminal state

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES
