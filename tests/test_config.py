"""carma's TOML configuration file: the paper's defaults, overrides, and errors that name their section."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from carma.config import Config, ConfigError, load_config, parse_config
from carma.core.risk import RiskWeights
from carma.sim.gpus import parse_gpus
from carma.sim.models import calibrated_power
from support import run_carma


@pytest.fixture
def toml_file(tmp_path):
    def _write(text: str):
        path = tmp_path / "carma.toml"
        path.write_text(text)
        return path

    return _write


@pytest.mark.parametrize(
    "make_config", [Config, lambda: parse_config({}), lambda: load_config(None)], ids=["class", "empty", "no-file"]
)
def test_defaults_are_the_papers(make_config):
    config = make_config()
    s = config.scheduler
    assert s.policy == "magm"
    assert (s.window_samples, s.margin_mib, s.min_free_mib, s.reserve_mib) == (30, 2048, 2048, 512)
    assert s.risk.enabled and s.hold_known_needs  # the one scheduler setting that is carma's own
    assert (s.risk.smact, s.risk.smocc, s.risk.drama) == (0.80, 0.45, 0.40)
    w = s.risk.weights
    assert (w.mean, w.median, w.p95, w.ema) == (0.2, 0.3, 0.3, 0.2)
    assert config.twin.gpus == parse_gpus("3xA100-40GB")
    assert config.twin.sharing == "mps"
    assert config.twin.scheduler == s
    assert (config.estimate.timeout_s, config.estimate.captures) == (600, 1)  # carma's own: one capture at a time
    assert config.server.keep_ended_s is None  # every task is kept


@pytest.mark.parametrize("doc", ["docs/configuration.md", "src/carma/config.py"])
def test_the_documented_example_file_is_valid_and_shows_the_defaults(doc):
    text = (Path(__file__).parent.parent / doc).read_text()
    config = parse_config(tomllib.loads(re.search(r"```toml\n(.*?)```", text, re.S)[1]), doc)
    assert config == Config()  # its twin's power exponent was 0.81, not the fitted 0.8113


@pytest.mark.parametrize(
    ("text", "tables"),
    [('[twin]\ngpus = "3xA100-40GB"\n', {"twin"}), ("[twin]\n", {"twin"}), ("[mig]\n[server]\n", {"mig", "server"})],
)
def test_a_table_is_known_even_when_it_sets_the_defaults(toml_file, text, tables):
    """The server warns of a [twin], the twin of the server's tables: the server was silent when the table
    equalled the defaults (the documented example)."""
    assert load_config(toml_file(text)).tables == tables


def test_simulate_says_it_reads_no_mig_table(tmp_path):
    """A [mig] scheme was checked, then ignored: `--mig dynamic` ran scheme B under `scheme = "a"`."""
    (tmp_path / "m.toml").write_text('[mig]\nscheme = "a"\n')
    result = run_carma("simulate", "--limit", "2", "--config", "m.toml", cwd=tmp_path)
    assert result.returncode == 0
    assert "warning: m.toml: [mig] is for carma server; carma simulate reads [scheduler] and [twin]" in result.stderr


def test_an_empty_file_gives_the_defaults(toml_file):
    assert load_config(toml_file("# nothing to change\n")) == Config()


def test_overrides_of_every_section(toml_file):
    config = load_config(
        toml_file(
            """
            [scheduler]
            policy = "lug"
            window_samples = 10
            margin_mib = 1024
            min_free_mib = 4096
            reserve_mib = 0

            [scheduler.risk]
            enabled = false
            smact = 0.9
            smocc = 0.5
            drama = 0.6
            weights = { mean = 0.4, median = 0.1, p95 = 0.5, ema = 0.0 }

            [twin]
            gpus = "2xA100-80GB"
            sharing = "timeslice"
            fragmentation = 0.1
            power_exponent = 0.8

            [estimate]
            timeout_s = 1800
            captures = 2

            [server]
            keep_ended_days = 7.5
            """
        )
    )
    s = config.scheduler
    assert s.policy == "lug"
    assert (s.window_samples, s.margin_mib, s.min_free_mib, s.reserve_mib) == (10, 1024, 4096, 0)
    assert not s.risk.enabled
    assert (s.risk.smact, s.risk.smocc, s.risk.drama) == (0.9, 0.5, 0.6)
    assert s.risk.weights == RiskWeights(mean=0.4, median=0.1, p95=0.5, ema=0.0)
    twin = config.twin
    assert [g.name for g in twin.gpus] == ["A100-80GB", "A100-80GB"]
    assert (twin.sharing, twin.fragmentation, twin.power.exponent) == ("timeslice", 0.1, 0.8)
    assert twin.scheduler == s  # runs start from the configured scheduler
    assert (config.estimate.timeout_s, config.estimate.captures) == (1800, 2)
    assert config.server.keep_ended_s == 7.5 * 86400


def test_a_partial_override_keeps_the_other_defaults():
    config = parse_config({"scheduler": {"risk": {"smact": 0.7}}, "twin": {"sharing": "timeslice"}})
    assert config.scheduler.risk.smact == 0.7
    assert config.scheduler.risk.smocc == 0.45
    assert config.scheduler.risk.weights == RiskWeights()
    assert config.scheduler.policy == "magm"
    assert config.twin.gpus == parse_gpus("3xA100-40GB")
    assert config.twin.power == calibrated_power()  # the fitted model when the file does not override it


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"schedular": {}}, "carma.toml: unknown key(s) schedular"),
        ({"scheduler": {"polcy": "rr"}}, "carma.toml [scheduler]: unknown key(s) polcy"),
        ({"scheduler": {"risk": {"smactt": 0.8}}}, "carma.toml [scheduler.risk]: unknown key(s) smactt"),
        (
            {"scheduler": {"risk": {"weights": {"mean": 0.5, "p50": 0.5}}}},
            "carma.toml [scheduler.risk.weights]: unknown key(s) p50",
        ),
        ({"twin": {"gpu": "2xA100-80GB", "power": 1}}, "carma.toml [twin]: unknown key(s) gpu, power"),
        ({"estimate": {"timeout": 60}}, "carma.toml [estimate]: unknown key(s) timeout"),
    ],
)
def test_unknown_keys_name_their_section(doc, message):
    with pytest.raises(ConfigError) as excinfo:
        parse_config(doc, "carma.toml")
    assert str(excinfo.value) == message


@pytest.mark.parametrize(
    "weights",
    [{"mean": 0.5}, {"mean": 0.25, "median": 0.25, "p95": 0.25, "ema": 0.5}, {"mean": -0.2, "median": 0.7}],
)
def test_weights_must_sum_to_one(weights):
    with pytest.raises(
        ConfigError, match=r"^carma\.toml \[scheduler\.risk\.weights\]: risk weights must be non-negative and sum to 1"
    ):
        parse_config({"scheduler": {"risk": {"weights": weights}}}, "carma.toml")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"scheduler": {"policy": "fastest"}}, "fastest"),
        ({"scheduler": {"window_samples": 0}}, "window_samples must be from 1 to 3600, got 0"),
        ({"scheduler": {"window_samples": 10**8}}, "window_samples must be from 1 to 3600, got 100000000"),  # hung
        ({"twin": {"gpus": "100000xA100-40GB"}}, "a simulated server has at most 1024 GPUs"),
        ({"scheduler": {"margin_mib": -1}}, "margin_mib must not be negative"),
        ({"twin": {"gpus": "3xB200"}}, "unknown GPU type 'B200'"),
        ({"twin": {"sharing": "mig"}}, "unknown sharing mode 'mig'"),
        ({"twin": {"fragmentation": 1.0}}, "fragmentation allowance must be a fraction in [0, 1)"),
        ({"twin": {"power_exponent": "steep"}}, "[twin]: power_exponent must be a number, not 'steep'"),
        ({"scheduler": {"window_samples": "30"}}, "[scheduler]: window_samples must be an integer, not '30'"),
        ({"scheduler": {"margin_mib": True}}, "[scheduler]: margin_mib must be an integer, not True"),
        ({"scheduler": {"risk": {"enabled": "no"}}}, "[scheduler.risk]: enabled must be true or false, not 'no'"),
        ({"twin": {"gpus": 3}}, "[twin]: gpus must be a string, not 3"),
        (
            {"scheduler": {"risk": {"smocc": 45}}},
            "[scheduler.risk]: risk threshold smocc must be a fraction in [0, 1], got 45",
        ),
        ({"twin": {"power_exponent": 0}}, "[twin]: power exponent must be positive"),
        ({"estimate": {"timeout_s": 0}}, "[estimate]: timeout_s must be positive"),
        ({"estimate": {"captures": 0}}, "[estimate]: captures must be at least 1"),
        ({"estimate": {"captures": 1.5}}, "[estimate]: captures must be an integer, not 1.5"),
        ({"server": {"keep_ended_days": -1}}, "[server]: keep_ended_days must be 0 (keep every task) or more, not -1"),
        ({"server": {"keep": 30}}, "carma.toml [server]: unknown key(s) keep"),
        ({"scheduler": {"sample_interval_s": float("inf")}}, "[scheduler]: sample_interval_s must be a finite number"),
        (
            {"scheduler": {"sample_interval_s": 0.001}},
            "[scheduler]: sample_interval_s must be from 0.1 to 60 s, got 0.001",
        ),
        (  # a placement waits for the first sample: the server took tasks and placed none
            {"scheduler": {"sample_interval_s": 1e300}},
            "[scheduler]: sample_interval_s must be from 0.1 to 60 s, got 1e+300",
        ),
        (  # the weights not given read as if written
            {"scheduler": {"risk": {"weights": {"mean": 1.0}}}},
            "[scheduler.risk.weights]: risk weights must be non-negative and sum to 1, got mean 1, median 0.3, "
            "p95 0.3, ema 0.2 (sum 1.8); a weight left out keeps its default",
        ),
        ({"twin": {"power_exponent": float("nan")}}, "[twin]: power_exponent must be a finite number, not nan"),
        (  # NaN would pass the sum check and switch the risk filter off unsaid
            {"scheduler": {"risk": {"weights": {"mean": float("nan")}}}},
            "[scheduler.risk.weights]: mean must be a finite number",
        ),
        (
            {"scheduler": {"policy": "fast"}},
            "[scheduler]: policy must be one of exclusive, rr, magm, lug, ff, bf, pair; got 'fast'",
        ),
    ],
)
def test_invalid_values_are_config_errors(doc, message):
    with pytest.raises(ConfigError) as excinfo:
        parse_config(doc, "carma.toml")
    assert str(excinfo.value).startswith("carma.toml")
    assert str(excinfo.value).count("carma.toml") == 1
    assert message in str(excinfo.value)


@pytest.mark.parametrize("doc", [{"scheduler": 5}, {"scheduler": "magm"}, {"scheduler": {"risk": 0.8}}, {"twin": 4}])
def test_a_value_where_a_table_belongs_is_a_config_error(doc):
    with pytest.raises(ConfigError, match="table"):
        parse_config(doc, "carma.toml")


def test_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(missing)
    assert str(excinfo.value) == f"no config file {str(missing)!r}"


def test_invalid_toml_is_a_config_error_naming_the_file(toml_file):
    path = toml_file("[scheduler\npolicy = magm\n")
    with pytest.raises(ConfigError, match=r"carma\.toml: not valid TOML \(") as excinfo:
        load_config(path)
    assert str(excinfo.value).startswith(str(path))


def test_a_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    path = tmp_path / "carma.toml"
    path.write_bytes(b'\xef\xbb\xbf[scheduler]\npolicy = "lug"\n')
    assert load_config(path).scheduler.policy == "lug"


def test_errors_in_a_file_name_the_file(toml_file):
    path = toml_file("[scheduler.risk]\nsmactt = 0.8\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    assert str(excinfo.value) == f"{path} [scheduler.risk]: unknown key(s) smactt"
