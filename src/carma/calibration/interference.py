"""Fitting and validating the interference model on Lucid's measured pairs.

Each measured pair gives two points: a job's collocated speed (relative to solo) against its own busy
time g_i and its co-runner's g_j. The time-slicing model predicts 1 / (1 + a * g_i**p * g_j**q).
Validation holds out whole model pairings (every configuration of, say, ResNet18 + VGG together) and
compares held-out error with two baselines: no interference (speed 1) and a proportional share of
utilization (speed min(1, 1 / (g_i + g_j))).

Lucid ran its pairs as two ordinary processes on one GPU (no MPS daemon in its profiling code), so the
fit is the time-slicing model. MPS keeps a share of its excess, derived from the thesis's one pair
measured both ways (DLRM + ResNet152, Table 4.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from carma.calibration.fitting import fit_mae, grouped_folds
from carma.calibration.sources import LucidPair
from carma.calibration.utilization import UtilizationRelation
from carma.sim.models import InterferenceModel, Load


@dataclass(frozen=True)
class PairPoints:
    own: np.ndarray  # g_i
    other: np.ndarray  # g_j
    speed: np.ndarray
    groups: list[str]

    @property
    def X(self) -> np.ndarray:
        return np.column_stack([self.own, self.other])


def pair_points(pairs: Sequence[LucidPair]) -> PairPoints:
    own, other, speed, groups = [], [], [], []
    for pair in pairs:
        for me, you, s in ((pair.first, pair.second, pair.speed_first), (pair.second, pair.first, pair.speed_second)):
            own.append(me.gract)
            other.append(you.gract)
            speed.append(s)
            groups.append(pair.group)
    return PairPoints(np.array(own), np.array(other), np.array(speed), groups)


def timeslice_speed(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    a, p, q = theta
    return 1.0 / (1.0 + a * np.abs(X[:, 0]) ** p * np.abs(X[:, 1]) ** q)


BASELINES = {
    "no interference (speed 1.0)": lambda X: np.ones(len(X)),
    "proportional share of utilization": lambda X: np.minimum(1.0, 1.0 / np.maximum(X[:, 0] + X[:, 1], 1e-9)),
}
_START = (0.5, 1.0, 1.0)


MIN_PAIRINGS = 5  # validation's folds: a fit on fewer model pairings is one `twin validate` cannot check


def _enough_pairings(points: PairPoints) -> None:
    pairings = sorted(set(points.groups))
    if len(pairings) < MIN_PAIRINGS:
        measured = ", ".join(pairings[:3]) + (", ..." if len(pairings) > 3 else "")
        raise ValueError(
            f"{len(pairings)} model {'pairing' if len(pairings) == 1 else 'pairings'} measured ({measured}); the "
            f"interference fit needs at least {MIN_PAIRINGS}, as its validation holds each out in turn"
        )


def fit_timeslice(points: PairPoints) -> tuple[float, float, float]:
    """The time-slicing parameters; refused from too few model pairings or when they are no slowdown (a
    co-runner, or a busier one, making a job faster), which the twin would otherwise be given as measured."""
    _enough_pairings(points)
    a, p, q = (float(v) for v in fit_mae(timeslice_speed, _START, points.X, points.speed))
    if min(a, p, q) < 0:
        raise ValueError(
            f"the interference fit is no slowdown (a={a:.3g}, p={p:.3g}, q={q:.3g}: a job sharing its GPU, or "
            "sharing it with a busier co-runner, would run faster); check the pairs' speeds, or measure more pairings"
        )
    return a, p, q


@dataclass(frozen=True)
class Validation:
    folds: int
    groups: int
    points: int
    model_mae: float
    baseline_mae: dict[str, float]
    fold_mae: list[float]
    in_sample_mae: float


def cross_validate(points: PairPoints, folds: int = 5, seed: int = 0) -> Validation:
    """Grouped k-fold: each fold's model is fitted without any pair of the held-out model pairings. The full
    fit comes first: it refuses data too thin to validate before the folds are fitted."""
    full = np.array(fit_timeslice(points))
    X, y = points.X, points.speed
    held_out = np.empty_like(y)
    fold_mae = []
    for test in grouped_folds(points.groups, folds, seed):
        theta = fit_mae(timeslice_speed, _START, X[~test], y[~test])
        held_out[test] = timeslice_speed(theta, X[test])
        fold_mae.append(float(np.mean(np.abs(held_out[test] - y[test]))))
    return Validation(
        folds=folds,
        groups=len(set(points.groups)),
        points=len(y),
        model_mae=float(np.mean(np.abs(held_out - y))),
        baseline_mae={name: float(np.mean(np.abs(f(X) - y))) for name, f in BASELINES.items()},
        fold_mae=fold_mae,
        in_sample_mae=float(np.mean(np.abs(timeslice_speed(full, X) - y))),
    )


@dataclass(frozen=True)
class PairCheck:
    """The thesis's DLRM + ResNet152 pair: measured time increases against the model's."""

    workload: str
    naive_measured: float
    naive_predicted: float
    mps_measured: float
    mps_predicted: float


def mps_share(pair_rows: Sequence[dict[str, str]]) -> float:
    """The share of time-slicing's excess slowdown that remains under MPS, from the pair measured both ways."""
    naive = sum(float(r["naive_increase"]) for r in pair_rows)
    return sum(float(r["mps_increase"]) for r in pair_rows) / naive


def check_thesis_pair(
    model: InterferenceModel, pair_rows: Sequence[dict[str, str]], relation: UtilizationRelation
) -> list[PairCheck]:
    loads = []
    for row in pair_rows:
        smact = float(row["smact"])
        loads.append(Load(gract=relation.gract(smact), smact=smact, smocc=relation.smocc(smact), drama=0.0))
    naive = model.slowdowns(loads, "timeslice")
    mps = model.slowdowns(loads, "mps")
    return [
        PairCheck(row["workload"], float(row["naive_increase"]), n - 1, float(row["mps_increase"]), m - 1)
        for row, n, m in zip(pair_rows, naive, mps, strict=True)
    ]
