"""The decision core: pure Python, no I/O, no wall clock. Worlds drive it through `carma.core.ports`."""

from carma.core.config import Policy, RiskConfig, RiskWeights, SchedulerConfig
from carma.core.loop import SchedulingLoop
from carma.core.scheduler import Scheduler, SpecError
from carma.core.types import (
    ExitKind,
    GpuInfo,
    GpuSample,
    Launch,
    MemoryNeed,
    NeedKind,
    ProcessExit,
    Task,
    TaskSpec,
    TaskState,
)

__all__ = [
    "ExitKind",
    "GpuInfo",
    "GpuSample",
    "Launch",
    "MemoryNeed",
    "NeedKind",
    "Policy",
    "ProcessExit",
    "RiskConfig",
    "RiskWeights",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingLoop",
    "SpecError",
    "Task",
    "TaskSpec",
    "TaskState",
]
