"""Domain types of the decision core: tasks, their attempts, placement targets and telemetry samples.

Values that travel between the core and a world (specs, samples, actions, exits) are frozen;
`Task` and `Attempt` are the core's own mutable records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

TaskId = int
TargetId = str  # a placement target's stable identity: the GPU's UUID, or the MIG instance's


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
    """What a task is taken to need on each of its GPUs. A `partial` need is an estimate that leaves out memory
    of a kind it names but cannot size (xMem on a multi-GPU job: NCCL's buffers, DataParallel's reduction):
    the task holds its margin with it, so that what it leaves out is not placed into by others."""

    kind: NeedKind
    mib: int | None = None
    source: str = ""
    partial: bool = False

    def held_mib(self, margin_mib: int) -> int | None:
        """The memory the task holds on each GPU with this need (`hold_known_needs`); None when not known."""
        if self.mib is None:
            return None
        return self.mib + margin_mib if self.partial else self.mib


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


class TargetKind(StrEnum):
    GPU = "gpu"  # a whole GPU
    MIG = "mig"  # a MIG instance: its own memory and compute slices, one CUDA device to a process


@dataclass(frozen=True)
class Target:
    """Where a task can be placed. Its `id` outlives restarts and reconfigurations (the store keys attempts,
    samples and history by it), unlike its position in a server's list, which changes when a MIG layout or a
    node's GPUs change."""

    id: TargetId
    name: str  # the model, e.g. "NVIDIA A100-SXM4-40GB" or "A100-40GB 3g.20gb"
    total_mib: int
    kind: TargetKind = TargetKind.GPU
    parent: TargetId = ""  # the GPU a MIG instance is carved from ("" for a whole GPU: its own parent)
    node: str = ""  # the host it is on ("" for this server)
    compute: int = 0  # streaming multiprocessors (a GPU) or compute slices (a MIG instance); 0: not known
    shareable: bool = True  # whether tasks may be collocated on it (a MIG instance: one task at a time)
    slot: MigSlot | None = None  # a MIG instance's profile and first memory slice on its parent

    @property
    def gpu(self) -> TargetId:
        """The physical GPU it belongs to (energy and board power are read per physical GPU)."""
        return self.parent or self.id


@dataclass(frozen=True)
class GpuSample:
    """One 1 Hz reading of one target (`gpu` is its id). Utilization metrics are fractions in [0, 1]; None
    where the backend cannot read them (the risk rule then follows `RiskConfig.missing`, never a made-up
    zero)."""

    gpu: TargetId
    t: float
    used_mib: int
    total_mib: int
    smact: float | None
    smocc: float | None
    drama: float | None
    power_w: float | None = None  # board power (None for a MIG instance: power is per GPU)
    energy_j: float | None = None  # the device's cumulative energy counter
    temperature_c: float | None = None
    gract: float | None = None  # the share of time any kernel ran (DCGM GRACT): the interference model's input

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
    """An action: start `task_id` (attempt `attempt`) on the targets `gpus`."""

    task_id: TaskId
    attempt: int
    gpus: tuple[TargetId, ...]
    exclusive: bool
    recovery: bool = False


@dataclass(frozen=True)
class Kill:
    """An action: stop `task_id`'s live attempt `attempt` (a cancel); its exit is reported as any other."""

    task_id: TaskId
    attempt: int


@dataclass(frozen=True, order=True)
class MigSlot:
    """Where a MIG instance sits on its GPU: its profile (as nvidia-smi names it) and first memory slice."""

    profile: str
    start: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True)
class Reconfigure:
    """An action: on the MIG GPU `gpu`, destroy the idle instances `destroy`, then create `create` (a partition
    plan's steps, in order). The instances created join the server as targets once the world lists them."""

    gpu: TargetId
    destroy: tuple[MigSlot, ...]
    create: tuple[MigSlot, ...]

    @property
    def steps(self) -> int:
        """Instances destroyed plus created: what its duration scales with."""
        return len(self.destroy) + len(self.create)


# What the core asks a world to do; the scheduling loop hands each to the executor by its type.
Action = Launch | Kill | Reconfigure


@dataclass
class Attempt:
    number: int
    gpus: tuple[TargetId, ...]
    dispatched_s: float
    exclusive: bool
    recovery: bool
    first_kernel_s: float | None = None
    ended_s: float | None = None
    outcome: ExitKind | None = None
    message: str = ""
    need: MemoryNeed | None = None
    shared: bool = False  # another task ran on one of its GPUs at some point during the attempt
    restart_mib: int | None = None  # stopped to restart early: the peak predicted, which its relaunch holds

    @property
    def out_of_memory(self) -> bool:
        """Whether it crashed out of memory: an early restart is relaunched as one, but was stopped before it could."""
        return self.outcome is ExitKind.OOM and self.restart_mib is None

    @property
    def restarted_early(self) -> bool:
        return self.outcome is ExitKind.OOM and self.restart_mib is not None


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
