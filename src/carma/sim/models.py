"""The twin's physical models: how collocated tasks slow each other, and GPU power.

First constants, each argued in docs/twin-model.md from the thesis (SYSTEM.md section 4) and the CARMA
paper; the calibration issue replaces them with models fitted on measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carma.sim.gpus import GpuType


@dataclass(frozen=True)
class Load:
    """A task's solo utilization of one GPU (fractions in [0, 1])."""

    smact: float
    smocc: float
    drama: float


@dataclass(frozen=True)
class SharingModel:
    """Slowdown of n co-running tasks: demand beyond capacity is shared, plus a per-co-runner overhead.

    slowdown = max(1, sum(SMACT) / sm_capacity, sum(DRAMA) / dram_capacity) * (1 + overhead * (n - 1))
    """

    name: str
    sm_capacity: float
    dram_capacity: float
    overhead: float

    def slowdown(self, loads: Sequence[Load]) -> float:
        n = len(loads)
        if n <= 1:
            return 1.0
        demand = max(
            1.0,
            sum(x.smact for x in loads) / self.sm_capacity,
            sum(x.drama for x in loads) / self.dram_capacity,
        )
        return demand * (1.0 + self.overhead * (n - 1))


SHARING_MODELS = {
    "mps": SharingModel("mps", sm_capacity=1.0, dram_capacity=1.0, overhead=0.04),
    "timeslice": SharingModel("timeslice", sm_capacity=0.9, dram_capacity=1.0, overhead=0.10),
}


@dataclass(frozen=True)
class PowerModel:
    """Board power rises from idle with SM activity, sublinearly: idle + (max - idle) * SMACT ** exponent."""

    exponent: float = 0.6

    def __post_init__(self) -> None:
        if self.exponent <= 0:
            raise ValueError("power exponent must be positive")

    def power_w(self, gpu: GpuType, smact: float) -> float:
        return gpu.idle_w + (gpu.max_w - gpu.idle_w) * min(1.0, smact) ** self.exponent
