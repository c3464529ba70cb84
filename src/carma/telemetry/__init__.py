"""GPU telemetry backends for the daemon: each GPU's reading now and the processes it holds.

A backend reports raw process ids; the daemon resolves them to carma tasks through the process tree
(the same way for fake GPUs and real ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from carma.core.types import GpuSample, Target, TargetId


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int


@dataclass(frozen=True)
class DeviceReading:
    sample: GpuSample
    processes: tuple[GpuProcess, ...]


class GpuBackend(Protocol):
    def gpus(self) -> Sequence[Target]:
        """The placement targets (whole GPUs, MIG instances), in the order users see them listed."""
        ...

    def read(self, now: float) -> Sequence[DeviceReading]:
        """One reading per target, in the order of `gpus`, stamped `now` (the daemon's clock)."""
        ...

    def missing(self) -> Mapping[TargetId, Sequence[str]]:
        """Per target, the profiling metrics the backend cannot read (reported, never faked)."""
        ...

    def refresh(self) -> None:
        """Discover the targets again: after a MIG reconfiguration, `gpus` lists the new layout."""
        ...

    def close(self) -> None: ...
