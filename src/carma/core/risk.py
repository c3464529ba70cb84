"""Collocation interference risk: per-metric scores over a monitor window and CARMA's exclusion rule, and
(carma's own, `warmup_risk`) the activity of tasks the window does not show yet added to the scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from carma.core.types import Task

METRICS = ("smact", "smocc", "drama")  # the metrics the risk rule reads


@dataclass(frozen=True)
class RiskWeights:
    """How the risk score mixes window statistics.

    The public CARMA code weighs mean 0.2, median 0.2, p95 0.3, p50 0.1 and EMA 0.2; its median and p50 are
    the same statistic, so the default folds them into median 0.3.
    """

    mean: float = 0.2
    median: float = 0.3
    p95: float = 0.3
    ema: float = 0.2

    def __post_init__(self) -> None:
        values = {"mean": self.mean, "median": self.median, "p95": self.p95, "ema": self.ema}
        if any(w < 0 for w in values.values()) or abs(sum(values.values()) - 1.0) > 1e-6:
            given = ", ".join(f"{name} {w:g}" for name, w in values.items())
            raise ValueError(
                f"risk weights must be non-negative and sum to 1, got {given} (sum {sum(values.values()):g})"
            )


@dataclass(frozen=True)
class RiskConfig:
    """A GPU is excluded from collocation when SMACT >= t and (SMOCC >= t or DRAMA >= t), on risk scores."""

    enabled: bool = True
    smact: float = 0.80
    smocc: float = 0.45
    drama: float = 0.40
    weights: RiskWeights = field(default_factory=RiskWeights)
    # when a GPU's telemetry lacks SMACT, SMOCC or DRAMA: "risky" keeps it out of collocation, "skip"
    # judges it by the metrics it has (no metric at all: not excluded)
    missing: str = "risky"

    def __post_init__(self) -> None:
        for name in METRICS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"risk threshold {name} must be a fraction in [0, 1], got {getattr(self, name):g}")
        if self.missing not in ("risky", "skip"):
            raise ValueError(f"risk missing must be 'risky' or 'skip', got {self.missing!r}")


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
class Activity:
    """What a task is expected to add to its GPU's SMACT, SMOCC and DRAMA once it computes (alone on a GPU)."""

    smact: float
    smocc: float
    drama: float


# A task's expected activity (the twin's catalog profile), or None when not known: a port, as durations are.
ActivityOf = Callable[[Task], Activity | None]
# How long after its first kernel a task's activity is still added to its GPU's scores, in monitor windows: by
# then the window's statistics (a p95, a median) show most of it.
WARMING_WINDOWS = 0.5


def with_expected(risk: Risk, expected: Sequence[Activity]) -> Risk:
    """The scores with the activity of tasks the window does not show yet added (a metric the GPU does not report
    stays unreported)."""

    def plus(score: float | None, metric: str) -> float | None:
        return None if score is None else score + sum(getattr(a, metric) for a in expected)

    return Risk(*(plus(getattr(risk, metric), metric) for metric in METRICS))


@dataclass(frozen=True)
class Exclusion:
    """Why the risk rule excludes a GPU: the metrics it has no reading of, or (metric, score, threshold) for
    each score at or over its threshold."""

    missing: tuple[str, ...] = ()
    over: tuple[tuple[str, float, float], ...] = ()
