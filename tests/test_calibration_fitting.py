"""The calibration fits recover known parameters from synthetic data (fixed seeds, no datasets needed).

Each test generates data from the very model being fitted, with known parameters and a small, stated
amount of noise, and checks the fit gets them back. Noise is Laplace (the error least-absolute-error
fitting is the right estimator for) or uniform, its scale b chosen so that E|noise| = b.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from carma.calibration.fitting import fit_mae, grouped_folds
from carma.calibration.interference import (
    BASELINES,
    cross_validate,
    fit_timeslice,
    mps_share,
    pair_points,
    timeslice_speed,
)
from carma.calibration.power import (
    energy_check,
    fit_exponent,
    measured_ratios,
    predicted_ratio,
)
from carma.calibration.sources import LucidJob, LucidPair, package_rows
from carma.calibration.utilization import UtilizationRelation, fit_relation
from carma.sim.gpus import GPU_TYPES
from carma.sim.models import InterferenceModel, Load, PowerModel

pytest.importorskip("scipy", reason="calibration fits need SciPy (pip install 'carma-gpu[calibrate]')")


def line(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    return theta[0] * X[:, 0] + theta[1]


# ----------------------------------------------------------------------------- fit_mae


def test_fit_mae_recovers_a_line_from_noiseless_data():
    X = np.random.default_rng(1).uniform(0, 1, (40, 1))
    y = 2.5 * X[:, 0] - 0.7
    # Noiseless: only Nelder-Mead's stopping rule (xatol 1e-6) stands between the fit and the truth.
    assert fit_mae(line, (1.0, 0.0), X, y) == pytest.approx([2.5, -0.7], abs=1e-4)


def test_fit_mae_recovers_a_line_from_laplace_noise():
    rng = np.random.default_rng(2)
    X = rng.uniform(0, 1, (400, 1))
    y = 2.5 * X[:, 0] - 0.7 + rng.laplace(0, 0.02, 400)
    # Least-absolute-error estimates with noise scale 0.02 over 400 points err by about 0.02 / sqrt(400) = 0.001
    # per unit of x spread; 0.02 is a 20-sigma bound that still rejects a wrong model.
    assert fit_mae(line, (1.0, 0.0), X, y) == pytest.approx([2.5, -0.7], abs=0.02)


def test_fit_mae_recovers_the_time_slicing_speed_function_from_uniform_noise():
    rng = np.random.default_rng(3)
    X = rng.uniform(0.1, 1.0, (300, 2))
    y = timeslice_speed(np.array([0.8, 1.2, 2.2]), X) + rng.uniform(-0.01, 0.01, 300)
    # Speeds in [0.45, 1] with +-0.01 noise: a is pinned to a few percent, the exponents to about 0.1
    # (they act through g**p on g in [0.1, 1], where a 0.1 change moves the speed by under 0.02).
    a, p, q = fit_mae(timeslice_speed, (0.5, 1.0, 1.0), X, y)
    assert a == pytest.approx(0.8, abs=0.05)
    assert p == pytest.approx(1.2, abs=0.1)
    assert q == pytest.approx(2.2, abs=0.1)


def test_fit_mae_minimizes_absolute_not_squared_error():
    X = np.zeros((7, 1))
    y = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 50.0, 100.0])  # median 1, mean 22.3

    def constant(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return np.full(len(X), theta[0])

    assert fit_mae(constant, (10.0,), X, y)[0] == pytest.approx(1.0, abs=1e-4)


# SciPy warns when the whole first simplex is infinite (inf - inf); that start is the point of the test.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_fit_mae_ignores_parameters_whose_prediction_is_not_finite():
    X = np.random.default_rng(4).uniform(0, 1, (30, 1))
    y = 2.0 * X[:, 0]

    def defined_from_1_2(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return theta[0] * X[:, 0] if theta[0] >= 1.2 else np.full(len(X), np.nan)

    # The first start (1.0) lies where the prediction is NaN; a NaN loss there must not win over the
    # restarts from 1.3x and 1.6x the start, which lie in the defined region and reach the truth.
    theta = fit_mae(defined_from_1_2, (1.0,), X, y)
    assert theta[0] == pytest.approx(2.0, abs=1e-4)
    assert np.all(np.isfinite(defined_from_1_2(theta, X)))


def test_fit_mae_stays_at_the_edge_of_the_finite_region():
    X = np.random.default_rng(5).uniform(0, 1, (30, 1))
    y = 0.5 * X[:, 0]  # the unconstrained optimum (0.5) is where the prediction is infinite

    def defined_from_1(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return theta[0] * X[:, 0] if theta[0] >= 1.0 else np.full(len(X), np.inf)

    assert fit_mae(defined_from_1, (2.0,), X, y)[0] == pytest.approx(1.0, abs=1e-4)


# ----------------------------------------------------------------------------- grouped_folds

GROUPS = [f"g{i}" for i in range(12) for _ in range(i % 3 + 1)]  # 12 groups of 1 to 3 points


def test_grouped_folds_partition_the_points_without_splitting_a_group():
    folds = grouped_folds(GROUPS, 5, seed=0)
    assert len(folds) == 5
    assert all(mask.shape == (len(GROUPS),) for mask in folds)
    assert np.array_equal(np.sum(folds, axis=0), np.ones(len(GROUPS)))  # every point in exactly one fold
    labels = np.asarray(GROUPS)
    for name in set(GROUPS):
        in_folds = [i for i, mask in enumerate(folds) if mask[labels == name].any()]
        assert len(in_folds) == 1, name  # every group in exactly one fold...
        assert folds[in_folds[0]][labels == name].all(), name  # ...and whole there
    groups_per_fold = [len(set(labels[mask])) for mask in folds]
    assert sorted(groups_per_fold) == [2, 2, 2, 3, 3]  # 12 groups dealt round-robin into 5 folds


def test_grouped_folds_are_deterministic_for_a_seed_and_change_with_it():
    same = grouped_folds(GROUPS, 4, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(same, grouped_folds(GROUPS, 4, seed=3), strict=True))
    other = grouped_folds(GROUPS, 4, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(same, other, strict=True))


def test_grouped_folds_need_at_least_one_group_per_fold():
    with pytest.raises(ValueError, match="3 groups cannot make 5 folds"):
        grouped_folds(["a", "a", "b", "c", "c"], 5)


# ----------------------------------------------------------------------------- GRACT -> SMACT, SMOCC


def test_fit_relation_recovers_the_utilization_relation():
    truth = UtilizationRelation(slope=1.3, offset=0.2, smocc_scale=0.45, smocc_power=1.7)
    rng = np.random.default_rng(6)
    gract = rng.uniform(0, 1, 500)
    smact = np.array([truth.smact(g) for g in gract]) + rng.uniform(-0.01, 0.01, 500)
    smocc = np.array([truth.smocc(max(s, 0.0)) for s in smact]) + rng.uniform(-0.005, 0.005, 500)
    fitted = fit_relation(gract, smact, smocc)
    # Noise of +-0.01 (SMACT) and +-0.005 (SMOCC) on 500 runs: parameters within a few percent.
    assert fitted.slope == pytest.approx(1.3, abs=0.05)
    assert fitted.offset == pytest.approx(0.2, abs=0.02)
    assert fitted.smocc_scale == pytest.approx(0.45, abs=0.02)
    assert fitted.smocc_power == pytest.approx(1.7, abs=0.1)
    # The reported errors are those of the fitted curves: about the mean absolute noise (0.005 and 0.0025).
    assert fitted.smact_mae == pytest.approx(0.005, abs=0.002)
    assert fitted.smocc_mae == pytest.approx(0.0025, abs=0.001)
    assert fitted.runs == 500


def test_utilization_relation_inverts_and_clips():
    rel = UtilizationRelation(slope=1.25, offset=0.2, smocc_scale=0.5, smocc_power=1.5)
    for g in (0.25, 0.5, 0.75, 0.95):  # the rising part: offset < g < offset + 1 / slope = 1.0
        assert rel.gract(rel.smact(g)) == pytest.approx(g, abs=1e-12)
    assert rel.smact(0.5) == pytest.approx(1.25 * 0.3)
    assert rel.smact(0.1) == 0.0  # idle below the offset
    assert rel.smact(1.0) == 1.0  # 1.25 * 0.8 = 1.0 exactly at full busy time, and never more
    assert UtilizationRelation(2.0, 0.2, 0.5, 1.5).smact(1.0) == 1.0  # 2 * 0.8 = 1.6, clipped
    assert UtilizationRelation(1.0, 0.2, 0.5, 1.5).gract(1.0) == 1.0  # 1 / 1 + 0.2 = 1.2, clipped
    assert rel.smocc(0.64) == pytest.approx(0.5 * 0.512)


# ----------------------------------------------------------------------------- interference

A, P, Q = 0.8, 1.2, 2.2  # p and q far apart, so that mixing up own and co-runner's busy time shows
NOISE = 0.01  # Laplace scale: the mean absolute noise on a measured speed


def truth_speed(own: float, other: float) -> float:
    return 1.0 / (1.0 + A * own**P * other**Q)


@pytest.fixture(scope="module")
def synthetic_pairs() -> list[LucidPair]:
    """6 models x 3 batch sizes each; 4 measured pairs per unordered pair of models: 21 groups, 84 pairs."""
    rng = np.random.default_rng(7)
    models = [f"Model{i}" for i in range(6)]
    jobs = {
        m: [LucidJob(m, "Data", b, False, 100.0, float(rng.uniform(0.15, 1.0)), 0.3) for b in (16, 32, 64)]
        for m in models
    }
    pairs = []
    for m1, m2 in itertools.combinations_with_replacement(models, 2):
        for _ in range(4):
            j1, j2 = jobs[m1][rng.integers(3)], jobs[m2][rng.integers(3)]
            s1 = truth_speed(j1.gract, j2.gract) + rng.laplace(0, NOISE)
            s2 = truth_speed(j2.gract, j1.gract) + rng.laplace(0, NOISE)
            pairs.append(LucidPair(j1, j2, s1, s2))
    return pairs


def test_pair_points_give_each_job_its_own_and_its_co_runners_busy_time():
    vgg = LucidJob("VGG", "ImageNet", 32, False, 100.0, 0.9, 0.5)
    bert = LucidJob("BERT", "SQuAD", 32, False, 80.0, 0.6, 0.4)
    mlp = LucidJob("MLP", "MNIST", 64, True, 900.0, 0.2, 0.1)
    points = pair_points([LucidPair(vgg, bert, 0.7, 0.8), LucidPair(mlp, vgg, 0.95, 0.9)])
    assert points.own.tolist() == [0.9, 0.6, 0.2, 0.9]
    assert points.other.tolist() == [0.6, 0.9, 0.9, 0.2]
    assert points.speed.tolist() == [0.7, 0.8, 0.95, 0.9]
    assert points.groups == ["BERT + VGG", "BERT + VGG", "MLP + VGG", "MLP + VGG"]  # unordered: sorted names
    assert points.X.tolist() == [[0.9, 0.6], [0.6, 0.9], [0.2, 0.9], [0.9, 0.2]]


def test_fit_timeslice_recovers_the_time_slicing_parameters(synthetic_pairs):
    a, p, q = fit_timeslice(pair_points(synthetic_pairs))
    # 168 speeds with noise 0.01: over ten seeds the errors stayed below 0.04 (a) and 0.09 (p, q); a
    # swapped own/other would give p near 2.2 and q near 1.2, a full unit off.
    assert a == pytest.approx(A, abs=0.1)
    assert p == pytest.approx(P, abs=0.15)
    assert q == pytest.approx(Q, abs=0.15)


def test_too_few_pairings_or_a_fit_that_is_no_slowdown_is_refused(synthetic_pairs):
    """One measured pair was fitted to q=-17 (a busier co-runner slowing a job less) and shipped as the twin's
    parameters, which `twin validate` then could not check ("1 groups cannot make 5 folds")."""
    few = [p for p in synthetic_pairs if p.group in sorted({p.group for p in synthetic_pairs})[:4]]
    for refused in (fit_timeslice, cross_validate):
        with pytest.raises(ValueError, match=r"^4 model pairings measured \(.*\); the interference fit needs at le"):
            refused(pair_points(few))
    faster = [LucidPair(p.first, p.second, 2 - p.speed_first, 2 - p.speed_second) for p in synthetic_pairs]
    with pytest.raises(ValueError, match=r"^the interference fit is no slowdown \(a=-?[\d.e-]+, p="):
        fit_timeslice(pair_points(faster))


def test_cross_validation_error_is_the_noise_and_beats_both_baselines(synthetic_pairs):
    points = pair_points(synthetic_pairs)
    v = cross_validate(points, folds=5)
    assert (v.folds, v.groups, v.points) == (5, 21, 168)
    assert len(v.fold_mae) == 5
    # The model is right, so held-out error is the noise (E|noise| = 0.01) plus a little fitting error.
    assert 0.7 * NOISE < v.model_mae < 1.5 * NOISE
    # Each fold's model never saw its test pairs, so held-out error lies above the full fit's in-sample
    # error (by 1-4% over twelve seeds); fitting the folds on all points would make the two equal.
    assert 0.7 * NOISE < v.in_sample_mae < v.model_mae
    assert set(v.baseline_mae) == set(BASELINES)
    for name, mae in v.baseline_mae.items():
        assert v.model_mae < mae / 3, name  # both baselines are wrong models: several times the noise
    assert v.baseline_mae["no interference (speed 1.0)"] == pytest.approx(np.mean(np.abs(1.0 - points.speed)))
    share = np.minimum(1.0, 1.0 / (points.own + points.other))
    assert v.baseline_mae["proportional share of utilization"] == pytest.approx(np.mean(np.abs(share - points.speed)))


def test_mps_share_is_the_mps_excess_over_the_naive_excess():
    assert mps_share(package_rows("thesis_pair.csv")) == pytest.approx((0.04 + 0.04) / (0.14 + 0.05))


# ----------------------------------------------------------------------------- power

GPU = GPU_TYPES["a100-40gb"]
MODEL = InterferenceModel(a=0.85, p=1.84, q=1.87, mps_share=0.42)
LOAD = Load(gract=0.5, smact=0.35, smocc=0.1, drama=0.2)


def test_measured_ratios_divide_by_the_single_task_energy_of_the_same_mode():
    rows = [
        {"mode": "naive", "tasks": "1", "energy_kj": "4.0"},
        {"mode": "mps", "tasks": "1", "energy_kj": "5.0"},
        {"mode": "naive", "tasks": "3", "energy_kj": "9.0"},
        {"mode": "mps", "tasks": "3", "energy_kj": "7.5"},
        {"mode": "mps", "tasks": "7", "energy_kj": "15.0"},
    ]
    assert measured_ratios(rows) == pytest.approx({("naive", 3): 2.25, ("mps", 3): 1.5, ("mps", 7): 3.0})


def test_fit_exponent_recovers_the_power_exponent_from_the_mps_rows():
    def ratios(exponent: float, mode: str, sharing: str) -> dict[tuple[str, int], float]:
        power = PowerModel(exponent)
        return {(mode, n): predicted_ratio(MODEL, power, GPU, LOAD, n, sharing) for n in (2, 3, 7)}

    # Naive rows from another exponent: the fit must read the MPS rows only.
    measured = ratios(0.6, "mps", "mps") | ratios(1.5, "naive", "timeslice")
    # Noiseless ratios: Nelder-Mead's tolerance (1e-6) bounds the error.
    assert fit_exponent(MODEL, GPU, LOAD, measured) == pytest.approx(0.6, abs=1e-3)


def test_predicted_ratio_is_slowdown_times_the_power_ratio():
    power = PowerModel(0.7)
    slowdown = MODEL.slowdowns([LOAD] * 3, "timeslice")[0]
    smact_3 = min(1.0, 3 * 0.35 / slowdown)
    expected = slowdown * power.power_w(GPU, smact_3) / power.power_w(GPU, 0.35)
    assert predicted_ratio(MODEL, power, GPU, LOAD, 3, "timeslice") == pytest.approx(expected)


def test_energy_check_predicts_each_row_with_its_own_sharing_mode():
    power = PowerModel(0.8)
    measured = {("naive", 2): 1.4, ("mps", 2): 1.3, ("naive", 7): 4.2, ("mps", 7): 3.4, ("other", 2): 9.9}
    rows = energy_check(MODEL, power, GPU, LOAD, measured)
    assert [(r.mode, r.tasks, r.measured) for r in rows] == [
        ("mps", 2, 1.3),
        ("mps", 7, 3.4),
        ("naive", 2, 1.4),
        ("naive", 7, 4.2),
    ]  # sorted by mode and copies; a mode without a sharing model is left out
    for r in rows:
        sharing = "mps" if r.mode == "mps" else "timeslice"
        assert r.predicted == pytest.approx(predicted_ratio(MODEL, power, GPU, LOAD, r.tasks, sharing))
    naive_7, mps_7 = rows[3].predicted, rows[1].predicted
    assert mps_7 < naive_7  # the two modes really differ for this load: the labels matter
