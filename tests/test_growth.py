"""Memory-growth prediction (issue 47, item 4): a task's peak memory over its run from its early samples,
held to MIGM's figures (mean peak error at most 15% when read at 10% of a run; Qwen2-7B's crash at
iteration 94 foreseen at iteration 6)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carma.core.early import MAX_KEPT, EarlyRestarts
from carma.core.growth import NoPrediction, Prediction, fit, predict, remaining_from_fraction, t_quantile
from carma.core.types import Task, TaskSpec

GIB = 1024


def line(base: float, slope: float, seconds: int, noise: float = 0.0, seed: int = 0) -> list[tuple[float, float]]:
    """Memory growing at `slope` MiB/s, sampled at 1 Hz, with normal noise of `noise` MiB."""
    rng = random.Random(seed)
    return [(float(t), max(0.0, base + slope * t + rng.gauss(0, noise))) for t in range(seconds)]


def predicted(samples: list[tuple[float, float]], horizon_s: float, **kwargs: float) -> Prediction:
    result = predict(samples, horizon_s, **kwargs)
    assert isinstance(result, Prediction), result
    return result


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("base", "slope", "run_s"), [(2000, 8.0, 1000), (500, 2.0, 3600), (8000, 30.0, 600)])
def test_a_linear_series_read_at_a_tenth_of_its_run_predicts_its_peak_within_15_percent(seed, base, slope, run_s):
    """MIGM's accuracy (mean error 14.98% at 10% of the iterations), here for every run, not on average."""
    read = run_s // 10
    samples = line(base, slope, read, noise=3 * slope, seed=seed)
    true_peak = base + slope * (run_s - 1)
    p = predicted(samples, horizon_s=run_s - read)
    assert p.growing
    assert abs(p.peak_mib - true_peak) <= 0.15 * true_peak
    assert p.peak_mib >= true_peak, "the band's top is the peak: below the truth is a crash not foreseen"


@settings(max_examples=60, deadline=None)
@given(
    base=st.floats(200, 40_000),
    slope=st.floats(0.5, 50),
    run_s=st.integers(600, 20_000),
    noise_s=st.floats(0, 3),
    seed=st.integers(0, 2**16),
)
def test_linear_growth_with_noise_of_a_few_seconds_growth_is_predicted_within_15_percent(
    base, slope, run_s, noise_s, seed
):
    read = run_s // 10
    samples = line(base, slope, read, noise=noise_s * slope, seed=seed)
    p = predicted(samples, horizon_s=run_s - read)
    true_peak = base + slope * (run_s - 1)
    assert abs(p.peak_mib - true_peak) <= 0.15 * true_peak


@settings(max_examples=60, deadline=None)
@given(
    level_mib=st.floats(0, 1e6),
    count=st.integers(10, 400),
    step_s=st.floats(1, 10),
    horizon_s=st.floats(0, 1e7),
    headroom=st.floats(0, 1e5),
)
def test_a_flat_series_never_predicts_exceeding(level_mib, count, step_s, horizon_s, headroom):
    samples = [(i * step_s, level_mib) for i in range(count)]
    p = predicted(samples, horizon_s)
    assert not p.growing
    assert p.peak_mib == level_mib
    assert not p.will_exceed(level_mib + headroom)


def test_a_noisy_flat_series_reads_as_growth_no_more_often_than_the_band_allows():
    """The slope must be positive at the band's level: pure noise passes that test 0.5% of the time (a
    needless early restart), and otherwise predicts the maximum it has seen."""
    predictions = [predicted(line(12_000, 0.0, 120, noise=200, seed=seed), 100_000) for seed in range(400)]
    assert sum(p.growing for p in predictions) <= 4
    assert all(p.peak_mib == p.observed_max_mib for p in predictions if not p.growing)


def test_falling_memory_predicts_what_was_already_used():
    samples = line(10_000, -5.0, 60)
    p = predicted(samples, horizon_s=1000)
    assert (p.growing, p.peak_mib) == (False, 10_000)


@settings(max_examples=40, deadline=None)
@given(noise=st.floats(1, 200), factor=st.floats(1.01, 10), seed=st.integers(0, 2**16))
def test_the_band_widens_with_noise(noise, factor, seed):
    """The same pattern of noise, scaled up: the band above the line scales with it."""
    rng = random.Random(seed)
    pattern = [rng.gauss(0, 1) for _ in range(60)]
    quiet = [(float(t), 40_000 + 100 * t + noise * e) for t, e in enumerate(pattern)]
    loud = [(float(t), 40_000 + 100 * t + noise * factor * e) for t, e in enumerate(pattern)]
    a, b = predicted(quiet, 600), predicted(loud, 600)
    assert a.growing and b.growing
    assert b.peak_mib - b.trend_mib == pytest.approx(factor * (a.peak_mib - a.trend_mib), rel=1e-6)
    assert b.peak_mib - b.trend_mib > a.peak_mib - a.trend_mib


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(0, 80_000), min_size=10, max_size=80),
    h1=st.floats(0, 1e6),
    h2=st.floats(0, 1e6),
)
def test_the_prediction_is_monotone_in_the_horizon(values, h1, h2):
    growth = fit([(float(t), v) for t, v in enumerate(values)])
    assert not isinstance(growth, NoPrediction)
    near, far = sorted((h1, h2))
    assert growth.at(near).peak_mib <= growth.at(far).peak_mib
    assert growth.at(near).peak_mib >= max(values)


def test_memory_growing_in_allocator_jumps_is_predicted_to_its_top():
    """A 512 MiB segment every 30 s, read at 10% of a 1000 s run: three jumps seen, thirty to come."""
    samples = [(float(t), 2000.0 + 512 * (t // 30)) for t in range(100)]
    true_peak = 2000 + 512 * (999 // 30)
    p = predicted(samples, horizon_s=900)
    assert p.growing
    assert true_peak <= p.peak_mib <= 1.15 * true_peak


def test_the_warm_up_keeps_loading_a_model_from_reading_as_growth():
    """Loading 6 GiB over 10 s, then flat: the load is no trend, once the warm-up leaves it out."""
    samples = [(float(t), 500.0 + 600 * min(t, 10)) for t in range(40)]
    assert predicted(samples, 3600).will_exceed(40 * GIB)
    settled = predicted(samples, 3600, warmup_s=10)
    assert not settled.growing
    assert not settled.will_exceed(6600)


def qwen2_7b(iterations: int, *, seconds_per_iteration: int = 2, seed: int = 0) -> list[tuple[float, float]]:
    """MIGM's Qwen2-7B inference with a growing context, shaped by the paper's figures: past 10 GB at
    iteration 94, a final peak of 12.23 GB; here 150 iterations of 2 s, sampled at 1 Hz, memory in steps of
    one iteration's growth with a little allocator noise, after a 10 s model load."""
    load_s, total, crash_at, final = 10, 150, 94, 12.23 * GIB
    per_iteration = (final - 10 * GIB) / (total - crash_at)
    start = 10 * GIB - crash_at * per_iteration
    rng = random.Random(seed)
    samples = []
    for t in range(load_s + iterations * seconds_per_iteration):
        if t < load_s:
            mib = 500 + (start - 500) * t / load_s
        else:
            mib = start + per_iteration * ((t - load_s) // seconds_per_iteration + 1) + rng.gauss(0, 20)
        samples.append((float(t), mib))
    return samples


QWEN_TOTAL, QWEN_CRASH, QWEN_PEAK = 150, 94, 12.23 * GIB


def test_qwen2_7b_shape_crashes_at_iteration_94():
    memory = [m for _, m in qwen2_7b(QWEN_TOTAL)]
    first_over = next(i for i, m in enumerate(memory) if m > 10 * GIB)
    assert (first_over - 10) // 2 + 1 in (QWEN_CRASH, QWEN_CRASH + 1)  # the iteration running at that sample
    assert max(memory) == pytest.approx(QWEN_PEAK, rel=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_qwen2_7b_foreseen_at_iteration_6_and_within_15_percent_at_a_tenth(seed):
    """MIGM: the crash past 10 GB at iteration 94 is predicted at iteration 6; read at 10% of the run the
    peak is within 15% (MIGM: 11.41 GB predicted, 12.23 GB reached)."""
    at_6 = predicted(qwen2_7b(6, seed=seed), horizon_s=(QWEN_TOTAL - 6) * 2, warmup_s=10)
    assert at_6.will_exceed(10 * GIB)
    at_tenth = predicted(qwen2_7b(QWEN_TOTAL // 10, seed=seed), horizon_s=(QWEN_TOTAL - 15) * 2, warmup_s=10)
    assert abs(at_tenth.peak_mib - QWEN_PEAK) <= 0.15 * QWEN_PEAK


def test_too_few_samples_give_no_prediction_and_say_why():
    assert predict([], 100) == NoPrediction("no memory samples")
    few = predict(line(1000, 5, 9), 100)
    assert isinstance(few, NoPrediction) and "9 of the 10" in few.reason
    short = predict([(t / 10, 1000 + t) for t in range(20)], 100)
    assert isinstance(short, NoPrediction) and "span" in short.reason
    warm = predict(line(1000, 5, 30), 100, warmup_s=25)
    assert isinstance(warm, NoPrediction) and "after the warm-up" in warm.reason


@pytest.mark.parametrize(
    ("samples", "kwargs", "message"),
    [
        ([(1.0, 10.0), (0.0, 10.0)], {}, "time order"),
        ([(0.0, 10.0), (0.0, 11.0)], {}, "time order"),
        ([(0.0, -1.0)], {}, "non-negative MiB"),
        ([(math.nan, 1.0)], {}, "finite time"),
        ([], {"level": 1.0}, "band level"),
        ([], {"warmup_s": -1}, "warm-up"),
        ([], {"min_samples": 3}, "at least 6 samples"),
    ],
)
def test_bad_input_is_refused_in_one_line(samples, kwargs, message):
    with pytest.raises(ValueError, match=message):
        predict(samples, 10, **kwargs)
    with pytest.raises(ValueError, match="horizon"):
        predicted(line(1000, 5, 20), -1)


@pytest.mark.parametrize(("dof", "table"), [(4, 4.604), (6, 3.707), (8, 3.355), (10, 3.169), (30, 2.750), (120, 2.617)])
def test_the_t_quantile_matches_the_tables(dof, table):
    assert t_quantile(0.995, dof) == pytest.approx(table, rel=0.003)


def test_the_remaining_run_from_the_fraction_done():
    assert remaining_from_fraction(100, 0.1) == pytest.approx(900)
    assert remaining_from_fraction(100, 1.0) == 0
    with pytest.raises(ValueError, match="fraction"):
        remaining_from_fraction(100, 0)
    with pytest.raises(ValueError, match="elapsed"):
        remaining_from_fraction(-1, 0.5)


# ----------------------------------------------------------------- a running task's series (carma.core.early)


def _series(remaining_s: float, samples: list[tuple[float, float]]) -> tuple[EarlyRestarts, Task]:
    early = EarlyRestarts(lambda task, now: remaining_s)
    task = Task(1, TaskSpec("job"), 0.0)
    for t, mib in samples:
        early.observe(task, 1, t, int(mib))
    return early, task


def test_the_peak_is_predicted_at_the_end_of_the_run_however_late_the_last_reading():
    early, task = _series(100.0, line(2000, 4.0, 60))
    at_reading, later = early.predicted(task, 1, 59.0), early.predicted(task, 1, 89.0)
    assert (at_reading.horizon_s, later.horizon_s) == (100.0, 130.0)  # the run ends 100 s after `now`
    assert later.trend_mib == pytest.approx(2000 + 4.0 * (89 + 100), rel=1e-6)


def test_a_series_of_days_keeps_bounded_memory_and_still_predicts_its_peak():
    early, task = _series(3600.0, line(2000, 0.05, 3 * MAX_KEPT))
    assert early._series[task.id].line.n <= MAX_KEPT
    prediction = early.predicted(task, 1, 3 * MAX_KEPT - 1.0)
    assert prediction.trend_mib == pytest.approx(2000 + 0.05 * (3 * MAX_KEPT - 1 + 3600), rel=0.01)
    assert early.lasting(task.id)
