"""Scheduler configuration with CARMA's defaults (SYSTEM.md section 1; the CARMA paper, sections 2.3-2.6)."""

from __future__ import annotations

from dataclasses import dataclass, field

from carma.core.policies import POLICY_NAMES
from carma.core.risk import RiskConfig

MIN_SAMPLE_INTERVAL_S = 0.1  # NVML's utilization counters update every 1/6 s to 1 s
MAX_SAMPLE_INTERVAL_S = 60.0  # the first sample, which a placement needs, comes after one interval
MAX_WINDOW_SAMPLES = 3600  # an hour of 1-second samples; every decision and risk score reads the whole window


# carma's own decisions beyond CARMA's rules (docs/policy.md): the switches, and their names in a run's label
OWN_DECISIONS = {"ttfk_unknown_only": "open warm-ups", "warmup_risk": "warm-up risk", "backfill": "backfilling"}


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
    # carma's own: a task whose need is known in MiB (declared, estimated) holds it from its launch
    # (`hold_known_needs`), so its time to first kernel need not close its GPUs; only tasks of unknown need
    # keep CARMA's TTFK rule (a GPU takes no further task until the window after their first kernel).
    ttfk_unknown_only: bool = False
    # carma's own: with open warm-ups, the risk filter adds the activity each task on a GPU is expected to have
    # (a world's `activity` port: the twin's catalog profiles, the server's history of each command's runs
    # alone) until half a window after its first kernel, so tasks that join during warm-ups do not pile onto a
    # GPU that fails the filter once they compute (docs/policy.md); a task without a profile adds nothing.
    warmup_risk: bool = False
    # carma's own: EASY backfilling (`carma.core.backfill`). While the head of the queue waits, a later task
    # of known duration may start where it cannot delay the head's reserved start; off: strict FIFO.
    backfill: bool = False
    # issue 47: with a memory series per task (a world that gives the scheduler `early`), a task on a shared GPU
    # whose memory is predicted to grow holds that growth against new tasks while it rises, and one whose growth
    # lasts and will not fit beside its co-runners is relaunched through recovery before it crashes
    # (`carma.core.early`)
    predict_growth: bool = True

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
        if self.ttfk_unknown_only and not self.hold_known_needs:  # a warm-up is open beside the needs held only
            raise ValueError("ttfk_unknown_only needs hold_known_needs: a warm-up is open only beside the needs held")

    @property
    def window_s(self) -> float:
        """How long a GPU stays unschedulable after a task's first kernel (one full monitor window)."""
        return self.window_samples * self.sample_interval_s
