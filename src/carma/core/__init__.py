"""The decision core: pure Python, no I/O, no wall clock. Worlds drive it through `carma.core.ports`."""

from carma.core.blocked import Blocked
from carma.core.config import SchedulerConfig
from carma.core.loop import SchedulingLoop
from carma.core.placer import Placement, Placer
from carma.core.policies import POLICY_NAMES
from carma.core.risk import RiskConfig, RiskWeights
from carma.core.scheduler import Scheduler, SpecError
from carma.core.types import (
    Action,
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
    TaskSpec,
    TaskState,
)

__all__ = [
    "POLICY_NAMES",
    "Action",
    "Blocked",
    "ExitKind",
    "GpuSample",
    "Kill",
    "Launch",
    "MemoryNeed",
    "NeedKind",
    "Placement",
    "Placer",
    "ProcessExit",
    "RiskConfig",
    "RiskWeights",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingLoop",
    "SpecError",
    "Target",
    "TargetId",
    "TargetKind",
    "Task",
    "TaskSpec",
    "TaskState",
]
