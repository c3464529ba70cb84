"""The twin's physical models: how collocated tasks slow each other, and GPU power.

Their parameters are fitted or cited in `sim/data/twin_params.json`, written by `carma twin calibrate`
(see docs/twin-model.md and docs/fidelity.md for the data and the errors).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from carma.sim.gpus import GpuType

SHARING_MODES = ("mps", "timeslice")


@dataclass(frozen=True)
class Load:
    """A task's solo activity on one GPU, as fractions in [0, 1].

    `gract` is the share of time the GPU is busy with the task's kernels (DCGM GRACT, what nvidia-smi
    reports as utilization); SMACT, SMOCC and DRAMA are the DCGM profiling metrics.
    """

    gract: float
    smact: float
    smocc: float
    drama: float


@dataclass(frozen=True)
class InterferenceModel:
    """Per-task slowdown of tasks sharing a GPU.

    Time-slicing (fitted on Lucid's measured pairs): a task's kernels wait whenever they collide with a
    co-runner's, so  slowdown_i = 1 + a * g_i**p * (sum of the co-runners' g)**q.
    MPS runs kernels of different processes concurrently: of the time-slicing excess only the share
    `mps_share` remains (thesis Table 4.4), but the tasks together cannot exceed the SMs or the memory
    bandwidth (slowdown >= sum of SMACT, sum of DRAMA), and MPS never does worse than time-slicing.
    """

    a: float
    p: float
    q: float
    mps_share: float

    def timeslice(self, loads: Sequence[Load]) -> list[float]:
        total = sum(x.gract for x in loads)
        return [1.0 + self.a * x.gract**self.p * max(0.0, total - x.gract) ** self.q for x in loads]

    def slowdowns(self, loads: Sequence[Load], sharing: str) -> list[float]:
        shared = self.timeslice(loads)
        if sharing == "timeslice" or len(loads) < 2:
            return shared
        bound = max(1.0, sum(x.smact for x in loads), sum(x.drama for x in loads))
        return [min(s, max(1.0 + self.mps_share * (s - 1.0), bound)) for s in shared]

    def rise(self, joining: Load, others: Sequence[Load], sharing: str) -> float:
        """How much `joining` raises the summed slowdowns of a GPU's tasks `others` (1.0 on an idle GPU): the
        cost interference-aware pairing ranks GPUs by."""
        before = sum(self.slowdowns(others, sharing)) if others else 0.0
        return sum(self.slowdowns([*others, joining], sharing)) - before


@dataclass(frozen=True)
class PowerModel:
    """Board power from idle (no kernels) to the board limit: idle + (max - idle) * SMACT ** exponent."""

    exponent: float

    def __post_init__(self) -> None:
        if self.exponent <= 0:
            raise ValueError("power exponent must be positive")

    def power_w(self, gpu: GpuType, smact: float) -> float:
        return gpu.idle_w + (gpu.max_w - gpu.idle_w) * min(1.0, smact) ** self.exponent


@cache
def twin_params() -> dict[str, Any]:
    """The calibrated parameters shipped with carma (`carma twin calibrate` regenerates them)."""
    return json.loads((resources.files("carma.sim") / "data" / "twin_params.json").read_text())


def calibrated_interference() -> InterferenceModel:
    ts, mps = twin_params()["timeslice"], twin_params()["mps"]
    return InterferenceModel(a=ts["a"], p=ts["p"], q=ts["q"], mps_share=mps["share"])


def calibrated_power() -> PowerModel:
    return PowerModel(exponent=twin_params()["power"]["exponent"])
