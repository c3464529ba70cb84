"""From busy time (GRACT, nvidia-smi's utilization) to the DCGM metrics SMACT and SMOCC.

Lucid records only nvidia-smi utilization; CARMA's risk rule reads SMACT and SMOCC. GPUMemNet's 2,000
training runs record all three, and show SMACT trailing utilization: short kernels keep the engine
busy without filling the SMs. The relation is fitted there:
    SMACT = clip(slope * (GRACT - offset), 0, 1),   SMOCC = scale * SMACT ** power.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from carma.calibration.fitting import fit_mae


@dataclass(frozen=True)
class UtilizationRelation:
    slope: float
    offset: float
    smocc_scale: float
    smocc_power: float
    smact_mae: float = 0.0
    smocc_mae: float = 0.0
    runs: int = 0

    def smact(self, gract: float) -> float:
        return float(min(1.0, max(0.0, self.slope * (gract - self.offset))))

    def smocc(self, smact: float) -> float:
        return self.smocc_scale * smact**self.smocc_power

    def gract(self, smact: float) -> float:
        """The busy time that goes with a measured SMACT (inverse of `smact` on its rising part)."""
        return min(1.0, smact / self.slope + self.offset)


def _smact(theta: np.ndarray, g: np.ndarray) -> np.ndarray:
    return np.clip(theta[0] * (g - theta[1]), 0.0, 1.0)


def _smocc(theta: np.ndarray, s: np.ndarray) -> np.ndarray:
    return theta[0] * np.abs(s) ** theta[1]


def fit_relation(gract: Sequence[float], smact: Sequence[float], smocc: Sequence[float]) -> UtilizationRelation:
    g, s, o = (np.asarray(v, dtype=float) for v in (gract, smact, smocc))
    to_smact = fit_mae(_smact, (1.0, 0.1), g, s)
    to_smocc = fit_mae(_smocc, (0.5, 1.5), s, o)
    return UtilizationRelation(
        slope=float(to_smact[0]),
        offset=float(to_smact[1]),
        smocc_scale=float(to_smocc[0]),
        smocc_power=float(to_smocc[1]),
        smact_mae=float(np.mean(np.abs(_smact(to_smact, g) - s))),
        smocc_mae=float(np.mean(np.abs(_smocc(to_smocc, s) - o))),
        runs=len(g),
    )
