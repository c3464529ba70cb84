"""Memory-growth prediction: a running task's peak memory over the rest of its run, from its 1 Hz samples.

After MIGM (Dash et al., `shared/seeds/002`, section 3.2.3): fit a straight line to the memory observed so
far, take the residuals as normal noise, and call the task's peak the top of a 99% band at the end of its
run. A task whose band top exceeds what it may use will run out of memory before it ends, so it can be
restarted early on a larger instance instead of crashing late (issue 47, item 4).

It lives in `carma.core`, not `carma.core.mig`: nothing in it knows MIG. The same prediction answers both
of the issue's questions: will a task outgrow its MIG instance (restart it early on the next larger one),
and will a task on a shared GPU outgrow that GPU's free memory (close the GPU to new tasks, and answer the
crash before it happens). The caller compares `Prediction.peak_mib` with the capacity that applies.

What is simplified against MIGM, and why:

- MIGM fits two series from an instrumented PyTorch allocator: the requested memory and the inverse of the
  reuse ratio, each linear in the iteration, and combines them. carma sees only the driver's per-process
  used memory (NVML), which is the product of the two (what is requested, less what is reused), plus the
  CUDA context and PyTorch's cached blocks. It fits that one series: the reuse ratio is folded into it, and
  MIGM's workspace estimate (parsing `CUBLAS_WORKSPACE_CONFIG`) is not needed because workspace is in it.
  Cached blocks make the used memory an upper bound of what MIGM predicts (allocated plus context), so the
  prediction errs towards an early restart, never towards a crash.
- The time axis is seconds at 1 Hz, not iterations; the remaining run is a horizon in seconds
  (`remaining_from_fraction` turns declared steps or a history's duration into one).
- MIGM's band adds z times the residuals' deviation to the line. Here the band is the textbook prediction
  interval of a new observation (Student's t, and the line's own uncertainty, which grows with the
  distance from the samples): for the few samples of an early read MIGM's form is too narrow, and the
  band must widen with the horizon for a prediction far ahead to be honest.
- MIGM checks that successive predictions converge before reporting one. Here a growth is reported only
  when the slope is significant at the same level (the line's lower bound rises); a series that is flat,
  falling, or too noisy to tell predicts its observed maximum. A later read with more samples decides.
- Allocator segments make memory grow in jumps, not smoothly. The line runs through the staircase; the
  jumps are residuals and widen the band, so the band top covers the staircase's next steps.
- Loading a model is a jump no later step repeats: `warmup_s` leaves out the samples from the first
  sighting until the task's allocation settles (the catalog's `warmup_s` is that span).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

Sample = tuple[float, float]  # (seconds, on any clock; MiB used)

LEVEL = 0.99  # MIGM's 99% band
MIN_SAMPLES = 10  # ten seconds at 1 Hz: a line through fewer is a guess
MIN_SPAN_S = 8.0
MIN_SLOPE = 1e-6  # MiB/s, 0.09 MiB a day: below it a slope is rounding, not growth
FEWEST_SAMPLES = 6  # below this the t quantile's expansion is not accurate (and a band means little)


@dataclass(frozen=True)
class NoPrediction:
    """Not enough to predict from; `reason` says what is missing, in one line."""

    reason: str


@dataclass(frozen=True)
class Prediction:
    """A task's predicted peak memory `horizon_s` after its last sample."""

    horizon_s: float
    trend_mib: float  # the fitted line at the horizon (the observed maximum when not growing)
    peak_mib: float  # the band's top at the horizon, never below the maximum already observed
    observed_max_mib: float
    growing: bool  # False: flat, falling or too noisy to tell; the peak is the observed maximum

    def will_exceed(self, capacity_mib: float) -> bool:
        """Whether the task is predicted to need more than `capacity_mib` before its run ends."""
        return self.peak_mib > capacity_mib


@dataclass(frozen=True)
class Growth:
    """A line fitted to a task's memory, with what its prediction band needs."""

    samples: int
    t_last: float
    t_mean: float
    sxx: float  # sum of squared time deviations from t_mean
    level_mib: float  # the line at t_mean
    slope_mib_per_s: float
    residual_sd_mib: float
    quantile: float  # Student's t for the band's level with samples - 2 degrees of freedom
    observed_max_mib: float

    @property
    def growing(self) -> bool:
        """The slope is positive at the band's level: its lower bound is above zero (and above what rounding in
        running sums makes of a flat series)."""
        return self.slope_mib_per_s > max(self.quantile * self.residual_sd_mib / math.sqrt(self.sxx), MIN_SLOPE)

    def at(self, horizon_s: float) -> Prediction:
        """The peak predicted `horizon_s` seconds after the last sample (at the end of the task's run)."""
        if not (horizon_s >= 0 and math.isfinite(horizon_s)):
            raise ValueError(f"horizon must be a non-negative number of seconds, not {horizon_s!r}")
        if not self.growing:
            return Prediction(horizon_s, self.observed_max_mib, self.observed_max_mib, self.observed_max_mib, False)
        t = self.t_last + horizon_s
        trend = self.level_mib + self.slope_mib_per_s * (t - self.t_mean)
        spread = math.sqrt(1 + 1 / self.samples + (t - self.t_mean) ** 2 / self.sxx)
        top = trend + self.quantile * self.residual_sd_mib * spread
        return Prediction(horizon_s, trend, max(top, self.observed_max_mib), self.observed_max_mib, True)


@dataclass
class LineFit:
    """A least-squares line kept as running sums, so that a prediction at every decision costs the same however
    long the series: one sample added (or the oldest dropped) at a time, the fit read in constant time. Sums are
    kept relative to the first sample ever added (a flat series sums to exactly zero, not to rounding)."""

    t0: float = 0.0
    y0: float = 0.0
    n: int = 0
    st: float = 0.0
    sy: float = 0.0
    stt: float = 0.0
    sty: float = 0.0
    syy: float = 0.0
    t_last: float = -math.inf
    observed_max: float = 0.0  # of every sample added, dropped or not: the task has held that much
    kept: deque[Sample] = field(default_factory=deque)

    def add(self, t: float, mib: float) -> None:
        """A sample later than every earlier one."""
        if not self.n:
            self.t0, self.y0 = t, mib
        self._sum(t, mib, 1.0)
        self.kept.append((t, mib))
        self.t_last = t
        self.observed_max = max(self.observed_max, mib)

    def drop_before(self, t: float) -> None:
        """Leave the samples older than `t` out of the line."""
        while self.kept and self.kept[0][0] < t:
            self._sum(*self.kept.popleft(), -1.0)

    def thin(self) -> None:
        """Keep every other sample: a long series' line with half the memory, still spread over its span."""
        kept = list(self.kept)
        for t, mib in kept[1::2]:
            self._sum(t, mib, -1.0)
        self.kept = deque(kept[::2])

    def _sum(self, t: float, mib: float, sign: float) -> None:
        dt, dy = t - self.t0, mib - self.y0
        self.n += int(sign)
        self.st += sign * dt
        self.sy += sign * dy
        self.stt += sign * dt * dt
        self.sty += sign * dt * dy
        self.syy += sign * dy * dy

    def growth(
        self, *, level: float = LEVEL, min_samples: int = MIN_SAMPLES, min_span_s: float = MIN_SPAN_S
    ) -> Growth | NoPrediction:
        """The line through the samples so far, or why there is none yet."""
        n = self.n
        if n < min_samples:
            return NoPrediction(f"too few samples after the warm-up: {n} of the {min_samples} needed")
        span = self.t_last - self.kept[0][0]
        if span < min_span_s:
            return NoPrediction(f"samples span {span:g} s of the {min_span_s:g} s needed")
        t_mean, y_mean = self.st / n, self.sy / n
        sxx = self.stt - n * t_mean * t_mean
        slope = (self.sty - n * t_mean * y_mean) / sxx
        sse = max(0.0, self.syy - n * y_mean * y_mean - slope * (self.sty - n * t_mean * y_mean))
        return Growth(
            samples=n,
            t_last=self.t_last,
            t_mean=self.t0 + t_mean,
            sxx=sxx,
            level_mib=self.y0 + y_mean,
            slope_mib_per_s=slope,
            residual_sd_mib=math.sqrt(sse / (n - 2)),
            quantile=t_quantile(1 - (1 - level) / 2, n - 2),
            observed_max_mib=self.observed_max,
        )


def fit(
    samples: Sequence[Sample],
    *,
    level: float = LEVEL,
    warmup_s: float = 0.0,
    min_samples: int = MIN_SAMPLES,
    min_span_s: float = MIN_SPAN_S,
) -> Growth | NoPrediction:
    """Fit a line to `samples` (time-ordered), leaving out those within `warmup_s` of the first."""
    _check(samples, level, warmup_s, min_samples)
    if not samples:
        return NoPrediction("no memory samples")
    start = samples[0][0] + warmup_s
    line = LineFit()
    for t, mib in samples:
        if t >= start:
            line.add(t, mib)
    return line.growth(level=level, min_samples=min_samples, min_span_s=min_span_s)


def predict(
    samples: Sequence[Sample],
    horizon_s: float,
    *,
    level: float = LEVEL,
    warmup_s: float = 0.0,
    min_samples: int = MIN_SAMPLES,
    min_span_s: float = MIN_SPAN_S,
) -> Prediction | NoPrediction:
    """The peak predicted `horizon_s` after the last sample, or why there is none yet."""
    growth = fit(samples, level=level, warmup_s=warmup_s, min_samples=min_samples, min_span_s=min_span_s)
    return growth if isinstance(growth, NoPrediction) else growth.at(horizon_s)


def remaining_from_fraction(elapsed_s: float, fraction_done: float) -> float:
    """The seconds a run has left, from how far along it is: declared steps done over steps in all, or the
    time run over a history's typical duration. The pace so far is taken to hold."""
    if not (0 < fraction_done <= 1):
        raise ValueError(f"fraction of the run done must be in (0, 1], not {fraction_done!r}")
    if not (elapsed_s >= 0 and math.isfinite(elapsed_s)):
        raise ValueError(f"elapsed time must be a non-negative number of seconds, not {elapsed_s!r}")
    return elapsed_s * (1 - fraction_done) / fraction_done


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile by its Cornish-Fisher expansion in the normal one (Abramowitz and Stegun 26.7.5):
    within 0.3% of the tables for four or more degrees of freedom, and it needs no statistics library."""
    if dof < FEWEST_SAMPLES - 2:
        raise ValueError(f"the t quantile needs at least {FEWEST_SAMPLES - 2} degrees of freedom, not {dof}")
    z = NormalDist().inv_cdf(p)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / float(dof) ** (k + 1) for k, term in enumerate(terms))


def _check(samples: Sequence[Sample], level: float, warmup_s: float, min_samples: int) -> None:
    if not 0 < level < 1:
        raise ValueError(f"band level must be in (0, 1), not {level!r}")
    if not (warmup_s >= 0 and math.isfinite(warmup_s)):
        raise ValueError(f"warm-up must be a non-negative number of seconds, not {warmup_s!r}")
    if min_samples < FEWEST_SAMPLES:
        raise ValueError(f"a prediction needs at least {FEWEST_SAMPLES} samples, not {min_samples}")
    previous = -math.inf
    for t, mib in samples:
        if not (math.isfinite(t) and math.isfinite(mib) and mib >= 0):
            raise ValueError(f"a memory sample must be a finite time and non-negative MiB, not {(t, mib)!r}")
        if t <= previous:
            raise ValueError(f"memory samples must be in time order: {t:g} s follows {previous:g} s")
        previous = t
