"""The decision core: pure Python, no I/O, no wall clock. Worlds drive it through `carma.core.ports`.

Its names are imported on first use: a process that needs only `carma.core.types` (every task's shim, a fake
job) starts without loading the scheduler.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_NAMES = {  # each module of the core and the names it gives the package
    "blocked": ("Blocked",),
    "config": ("SchedulerConfig",),
    "loop": ("SchedulingLoop",),
    "placer": ("Placement", "Placer"),
    "policies": ("POLICY_NAMES",),
    "risk": ("RiskConfig", "RiskWeights"),
    "scheduler": ("Scheduler", "SpecError"),
    "types": (
        "Action",
        "ExitKind",
        "GpuSample",
        "Kill",
        "Launch",
        "MemoryNeed",
        "NeedKind",
        "ProcessExit",
        "Target",
        "TargetId",
        "TargetKind",
        "Task",
        "TaskSpec",
        "TaskState",
    ),
}
_HOMES = {name: module for module, names in _NAMES.items() for name in names}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
