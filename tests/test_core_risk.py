"""Risk statistics, the exclusion rule and the monitor window."""

import pytest

from carma.core import GpuSample, RiskConfig, RiskWeights
from carma.core.monitor import MonitorWindow
from carma.core.risk import Risk, ema_last, quantile, risk_score


def test_quantile_interpolates_linearly_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert quantile(values, 0.5) == pytest.approx(2.5)
    assert quantile(values, 0.95) == pytest.approx(3.85)
    assert quantile([7.0], 0.95) == 7.0


def test_ema_uses_window_aware_alpha():
    # alpha = 2 / (W + 1) = 2/3 for two samples
    assert ema_last([0.0, 1.0]) == pytest.approx(2 / 3)
    assert ema_last([0.4] * 30) == pytest.approx(0.4)


def test_risk_score_of_a_steady_window_is_its_level():
    assert risk_score([0.6] * 30, RiskWeights()) == pytest.approx(0.6)


def test_risk_score_weighs_mean_median_p95_and_ema():
    values = [0.0] * 9 + [1.0]  # one recent spike
    w = RiskWeights()
    alpha = 2 / 11
    expected = w.mean * 0.1 + w.median * 0.0 + w.p95 * quantile(sorted(values), 0.95) + w.ema * alpha
    assert risk_score(values, w) == pytest.approx(expected)
    assert risk_score(values, RiskWeights(mean=1.0, median=0.0, p95=0.0, ema=0.0)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("smact", "smocc", "drama", "excluded"),
    [
        (0.80, 0.45, 0.00, True),  # thresholds are inclusive
        (0.80, 0.00, 0.40, True),
        (0.79, 0.90, 0.90, False),  # compute not saturated: never excluded
        (0.95, 0.44, 0.39, False),  # saturated but neither occupancy nor bandwidth high
        (1.00, 1.00, 1.00, True),
    ],
)
def test_exclusion_rule(smact, smocc, drama, excluded):
    assert Risk(smact, smocc, drama).excluded(RiskConfig()) is excluded


def test_exclusion_thresholds_are_configurable():
    strict = RiskConfig(smact=0.5, smocc=0.2, drama=0.9)
    assert Risk(0.6, 0.3, 0.0).excluded(strict)
    assert not Risk(0.6, 0.3, 0.0).excluded(RiskConfig())


@pytest.mark.parametrize("weights", [(0.5, 0.5, 0.5, 0.0), (-0.1, 0.5, 0.3, 0.3)])
def test_weights_must_be_a_distribution(weights):
    with pytest.raises(ValueError, match="sum to 1"):
        RiskWeights(*weights)


def _sample(t, smact):
    return GpuSample(0, t, 0, 40960, smact, 0.5, 0.5)


def test_window_keeps_only_the_last_samples_and_recomputes_risk():
    window = MonitorWindow(3, RiskWeights(mean=1.0, median=0.0, p95=0.0, ema=0.0))
    for t, smact in enumerate([1.0, 1.0, 1.0]):
        window.add(_sample(t, smact))
    assert window.risk().smact == pytest.approx(1.0)
    for t in (3, 4, 5):
        window.add(_sample(t, 0.0))
    assert len(window) == 3
    assert window.risk().smact == pytest.approx(0.0)
    assert window.latest.t == 5


def test_window_ignores_a_sample_it_already_holds():
    window = MonitorWindow(30, RiskWeights())
    window.add(_sample(1, 0.2))
    window.add(_sample(1, 0.9))
    window.add(_sample(0, 0.9))
    assert len(window) == 1
    assert window.latest.smact == 0.2


@pytest.mark.parametrize(
    ("risk", "missing", "excluded"),
    [
        (Risk(None, None, None), "risky", True),  # no metrics at all: kept out of collocation...
        (Risk(None, None, None), "skip", False),  # ...or judged by nothing
        (Risk(0.9, None, 0.5), "risky", True),
        (Risk(0.9, None, 0.5), "skip", True),  # the rule on the metrics there are
        (Risk(0.9, None, 0.1), "skip", False),
        (Risk(0.1, 0.1, 0.1), "risky", False),  # all present: the plain rule
    ],
)
def test_missing_metrics_follow_the_configured_choice(risk, missing, excluded):
    assert risk.excluded(RiskConfig(missing=missing)) is excluded


def test_window_scores_only_the_samples_that_have_a_metric():
    window = MonitorWindow(30, RiskWeights(mean=1.0, median=0.0, p95=0.0, ema=0.0))
    window.add(GpuSample(0, 0, 0, 40960, None, None, None))
    assert window.risk() == Risk(None, None, None)
    window.add(GpuSample(0, 1, 0, 40960, 0.4, None, 0.2))
    assert window.risk() == Risk(pytest.approx(0.4), None, pytest.approx(0.2))


def test_the_missing_choice_is_validated():
    with pytest.raises(ValueError, match="'risky' or 'skip'"):
        RiskConfig(missing="ignore")
