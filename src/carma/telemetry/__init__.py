"""GPU telemetry backends for the daemon: each GPU's reading now and the processes it holds.

A backend reports raw process ids; the daemon resolves them to carma tasks through the process tree
(the same way for fake GPUs and real ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from carma.core.types import GpuInfo, GpuSample


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int


@dataclass(frozen=True)
class DeviceReading:
    sample: GpuSample
    processes: tuple[GpuProcess, ...]


class GpuBackend(Protocol):
    def gpus(self) -> Sequence[GpuInfo]: ...

    def read(self, now: float) -> Sequence[DeviceReading]:
        """One reading per GPU, in index order, stamped `now` (the daemon's clock)."""
        ...

    def missing(self) -> Mapping[int, Sequence[str]]:
        """Per GPU index, the profiling metrics the backend cannot read (reported, never faked)."""
        ...

    def close(self) -> None: ...
