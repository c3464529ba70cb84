"""Least-absolute-error fitting and grouped cross-validation, shared by every fitted model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _minimize():
    try:
        from scipy.optimize import minimize
    except ImportError:
        raise ImportError("calibration needs SciPy: pip install 'carma-gpu[calibrate]'") from None
    return minimize


def fit_mae(predict: Predict, x0: Sequence[float], X: np.ndarray, y: np.ndarray, restarts: int = 4) -> np.ndarray:
    """Parameters minimizing the mean absolute error of `predict(params, X)` against y.

    Nelder-Mead from x0 and from scaled copies of it: the error surface of a power law is flat in places,
    and a few restarts make the result independent of one unlucky start.
    """
    minimize = _minimize()

    def loss(theta: np.ndarray) -> float:
        pred = predict(theta, X)
        return float(np.mean(np.abs(pred - y))) if np.all(np.isfinite(pred)) else np.inf

    best = None
    for k in range(restarts):
        start = np.asarray(x0, dtype=float) * (1.0 + 0.3 * k)
        result = minimize(loss, start, method="Nelder-Mead", options={"maxiter": 6000, "xatol": 1e-6, "fatol": 1e-9})
        if best is None or result.fun < best.fun:
            best = result
    return best.x


def grouped_folds(groups: Sequence[str], k: int, seed: int = 0) -> list[np.ndarray]:
    """Test masks of k folds that keep every group (e.g. a pair of models) whole in one fold."""
    names = sorted(set(groups))
    if len(names) < k:
        raise ValueError(f"{len(names)} groups cannot make {k} folds")
    order = np.random.default_rng(seed).permutation(names)
    labels = np.asarray(groups)
    return [np.isin(labels, order[i::k]) for i in range(k)]
