"""The power model's exponent, fitted on the thesis's energy table and checked on its held-out half.

Thesis Table 4.2 gives the GPU energy of one epoch of ResNet26/CIFAR-10 (batch 32) run alone and as 2,
3 and 7 identical copies, under naive sharing and MPS. For n copies the twin predicts

    E_n / E_1 = slowdown_n * P(SMACT_n) / P(SMACT_1),   SMACT_n = min(1, n * SMACT_1 / slowdown_n)

with slowdown_n from the interference model and P the power model (datasheet idle and maximum power).
The exponent is fitted on the MPS rows; the naive rows are the check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from carma.calibration.fitting import fit_mae
from carma.sim.gpus import GpuType
from carma.sim.models import InterferenceModel, Load, PowerModel

SHARING_OF_MODE = {"mps": "mps", "naive": "timeslice"}


@dataclass(frozen=True)
class EnergyRow:
    mode: str
    tasks: int
    measured: float  # E_n / E_1
    predicted: float


def predicted_ratio(
    model: InterferenceModel, power: PowerModel, gpu: GpuType, load: Load, n: int, sharing: str
) -> float:
    slowdown = model.slowdowns([load] * n, sharing)[0]
    smact_n = min(1.0, n * load.smact / slowdown)
    return slowdown * power.power_w(gpu, smact_n) / power.power_w(gpu, load.smact)


def measured_ratios(rows: Sequence[Mapping[str, str]]) -> dict[tuple[str, int], float]:
    energy = {(r["mode"], int(r["tasks"])): float(r["energy_kj"]) for r in rows}
    return {(mode, n): e / energy[(mode, 1)] for (mode, n), e in energy.items() if n > 1}


def fit_exponent(
    model: InterferenceModel, gpu: GpuType, load: Load, measured: Mapping[tuple[str, int], float]
) -> float:
    mps = [(n, ratio) for (mode, n), ratio in measured.items() if mode == "mps"]
    X = np.array([[n] for n, _ in mps], dtype=float)
    y = np.array([ratio for _, ratio in mps])

    def predict(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        if theta[0] <= 0:
            return np.full(len(X), np.inf)
        power = PowerModel(exponent=float(theta[0]))
        return np.array([predicted_ratio(model, power, gpu, load, int(n), "mps") for (n,) in X])

    return float(fit_mae(predict, (0.8,), X, y)[0])


def energy_check(
    model: InterferenceModel, power: PowerModel, gpu: GpuType, load: Load, measured: Mapping[tuple[str, int], float]
) -> list[EnergyRow]:
    return [
        EnergyRow(mode, n, ratio, predicted_ratio(model, power, gpu, load, n, SHARING_OF_MODE[mode]))
        for (mode, n), ratio in sorted(measured.items())
        if mode in SHARING_OF_MODE
    ]
