"""Collocation interference risk: per-metric scores over a monitor window and CARMA's exclusion rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carma.core.config import RiskConfig, RiskWeights

METRICS = ("smact", "smocc", "drama")  # the metrics the risk rule reads


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (the pandas/NumPy default)."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("quantile of an empty window")
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def ema_last(values: Sequence[float]) -> float:
    """Last value of an exponential moving average with the window-aware alpha = 2 / (W + 1)."""
    alpha = 2.0 / (len(values) + 1.0)
    ema = values[0]
    for x in values[1:]:
        ema = alpha * x + (1.0 - alpha) * ema
    return ema


def risk_score(values: Sequence[float], weights: RiskWeights) -> float:
    """Weighted mix of mean, median, p95 and EMA: a level that also reacts to tails and recent change."""
    ordered = sorted(values)
    mean = sum(ordered) / len(ordered)
    return (
        weights.mean * mean
        + weights.median * quantile(ordered, 0.5)
        + weights.p95 * quantile(ordered, 0.95)
        + weights.ema * ema_last(values)
    )


@dataclass(frozen=True)
class Risk:
    """Risk scores per metric; None for a metric the GPU's telemetry does not provide."""

    smact: float | None
    smocc: float | None
    drama: float | None

    def excluded(self, config: RiskConfig) -> bool:
        """CARMA's rule: compute saturated and either the SMs are full or memory bandwidth is busy.

        With a metric missing, `config.missing` decides: "risky" excludes the GPU; "skip" applies the rule
        to the metrics there are (without SMACT, a GPU is never excluded).
        """
        if None in (self.smact, self.smocc, self.drama) and config.missing == "risky":
            return True
        if self.smact is None or self.smact < config.smact:
            return False
        return (self.smocc or 0.0) >= config.smocc or (self.drama or 0.0) >= config.drama

    def exclusion(self, config: RiskConfig) -> Exclusion:
        """Why an excluded GPU is (`excluded` is true): the metrics missing, when they count as risky, else
        the scores at or over their thresholds."""
        if config.missing == "risky" and (missing := tuple(m for m in METRICS if getattr(self, m) is None)):
            return Exclusion(missing=missing)
        over = tuple(
            (metric, value, getattr(config, metric))
            for metric in METRICS
            if (value := getattr(self, metric)) is not None and value >= getattr(config, metric)
        )
        return Exclusion(over=over)


@dataclass(frozen=True)
class Exclusion:
    """Why the risk rule excludes a GPU: the metrics it has no reading of, or (metric, score, threshold) for
    each score at or over its threshold."""

    missing: tuple[str, ...] = ()
    over: tuple[tuple[str, float, float], ...] = ()
