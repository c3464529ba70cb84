"""Scheduler configuration with CARMA's defaults (SYSTEM.md section 1; the CARMA paper, sections 2.3-2.6)."""

from __future__ import annotations

from dataclasses import dataclass, field

from carma.core.policies import POLICY_NAMES

MIN_SAMPLE_INTERVAL_S = 0.1  # NVML's utilization counters update every 1/6 s to 1 s
MAX_SAMPLE_INTERVAL_S = 60.0  # the first sample, which a placement needs, comes after one interval
MAX_WINDOW_SAMPLES = 3600  # an hour of 1-second samples; every decision and risk score reads the whole window


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
        for name in ("smact", "smocc", "drama"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"risk threshold {name} must be a fraction in [0, 1], got {getattr(self, name):g}")
        if self.missing not in ("risky", "skip"):
            raise ValueError(f"risk missing must be 'risky' or 'skip', got {self.missing!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "magm"  # a registered policy's name (`carma.core.policies`)
    risk: RiskConfig = field(default_factory=RiskConfig)
    window_samples: int = 30  # monitor window length, in samples
    sample_interval_s: float = 1.0
    margin_mib: int = 2048  # added to a known memory need (fragmentation safety margin)
    min_free_mib: int = 2048  # free memory a GPU needs for a task of unknown need
    reserve_mib: int = 512  # subtracted from the latest free memory before any decision
    max_relaunches: int = 3  # OOM relaunches before a task fails
    # CARMA's reference implementation dispatches to fully idle GPUs whenever enough are free, and only
    # collocates (by the policy) when they are not.
    prefer_idle: bool = True
    # A relaunch after an OOM crash starts on whole idle GPUs; others may join them once its TTFK window has
    # passed (CARMA's reference), or, with this set, not until it ends: no recurrence from a neighbour, at
    # the cost of collocation (on trace 1's first 30 tasks on fake GPUs: 2 more crashes elsewhere, +10%).
    exclusive_relaunch: bool = False
    # A task placed with a need known in MiB holds it on its GPUs: another task fits only in what telemetry
    # shows free and those needs leave (carma's own; CARMA's reference reads the free memory alone, so a task
    # whose memory grows after its TTFK window, a data loader starting say, can be collocated into an OOM).
    hold_known_needs: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}; got {self.policy!r}")
        if not 1 <= self.window_samples <= MAX_WINDOW_SAMPLES:  # each decision reads the whole window
            raise ValueError(f"window_samples must be from 1 to {MAX_WINDOW_SAMPLES}, got {self.window_samples}")
        # faster, the daemon spins a core on stale readings; slower, it waits that long to place the first task
        if not MIN_SAMPLE_INTERVAL_S <= self.sample_interval_s <= MAX_SAMPLE_INTERVAL_S:
            raise ValueError(
                f"sample_interval_s must be from {MIN_SAMPLE_INTERVAL_S:g} to {MAX_SAMPLE_INTERVAL_S:g} s, "
                f"got {self.sample_interval_s:g}"
            )
        for name in ("margin_mib", "min_free_mib", "reserve_mib", "max_relaunches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def window_s(self) -> float:
        """How long a GPU stays unschedulable after a task's first kernel (one full monitor window)."""
        return self.window_samples * self.sample_interval_s
