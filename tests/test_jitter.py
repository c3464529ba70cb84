"""Seeded jitter of a trace's arrivals (`carma simulate --jitter S --seeds N`, docs/traces.md): reproducible
copies within bounds, and figures summed up over them."""

from __future__ import annotations

import json
import statistics

import pytest

from carma.sim.experiment import RunConfig, seeded_sweep, simulate
from carma.traces.catalog import load_catalog
from carma.traces.jitter import jittered
from carma.traces.loaders import Trace, TraceEntry, load_trace
from support import run_carma


@pytest.fixture(scope="module")
def t1() -> Trace:
    return load_trace("carma-t1", load_catalog())


def test_the_same_seed_gives_the_same_copy_and_another_seed_another(t1):
    assert jittered(t1, 120, 3) == jittered(t1, 120, 3)
    assert jittered(t1, 120, 3) != jittered(t1, 120, 4)


def test_jitter_0_gives_the_packaged_trace_exactly(t1):
    assert jittered(t1, 0, 7) == t1


def test_each_arrival_moves_by_at_most_the_jitter_and_the_copy_is_sorted(t1):
    copy = jittered(t1, 120, 1)
    packaged = {e.where: e for e in t1.entries}  # a packaged entry's file and line: one each
    assert sorted(e.where for e in copy.entries) == sorted(packaged)
    offsets = [e.submit_s - packaged[e.where].submit_s for e in copy.entries]
    assert all(abs(offset) <= 120 for offset in offsets)
    assert any(offset < -60 for offset in offsets) and any(offset > 60 for offset in offsets)  # both ways
    assert all(e.workload == packaged[e.where].workload for e in copy.entries)
    times = [e.submit_s for e in copy.entries]
    assert times == sorted(times)


def test_arrivals_never_move_before_the_start():
    vgg = load_catalog()["vgg"]
    trace = Trace("early", tuple(TraceEntry(t, vgg, f"line {i}") for i, t in enumerate((0.0, 10.0, 50.0, 400.0))))
    for seed in range(20):
        copy = jittered(trace, 300, seed)
        assert min(e.submit_s for e in copy.entries) >= 0.0
        assert len(copy.entries) == 4


def test_arrivals_at_the_same_time_keep_the_traces_order(t1):
    """Offsets are drawn in the trace's order; entries that land on the same time keep it (here: the whole
    trace moved to 0 s by a jitter far larger than its times, which clamps every arrival to the start)."""
    early = Trace("early", tuple(TraceEntry(e.submit_s / 1e6, e.workload, e.where) for e in t1.entries))
    moved = jittered(early, 1e9, 0)
    at_zero = [e.where for e in moved.entries if e.submit_s == 0.0]
    assert len(at_zero) > 10 and at_zero == [e.where for e in early.entries if e.where in set(at_zero)]


@pytest.mark.parametrize("jitter", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_jitter_is_refused(t1, jitter):
    with pytest.raises(ValueError, match="jitter must be a finite number of seconds"):
        jittered(t1, jitter, 0)


def test_a_seeded_sweep_runs_each_configuration_on_each_seeds_copy(t1):
    runs = [RunConfig("magm"), RunConfig("magm", "oracle")]
    per_seed = seeded_sweep(t1, runs, 120, [0, 1])
    assert [[r.config for r in copy] for copy in per_seed] == [runs, runs]
    assert per_seed[1][0].row() == simulate(jittered(t1, 120, 1), runs[0]).row()
    assert per_seed[0][0].metrics.makespan_s != per_seed[1][0].metrics.makespan_s


# --- carma simulate --jitter ---------------------------------------------------------------------------

FIRST_20 = ("--trace", "carma-t1", "--limit", "20")


def simulate_json(*args: str) -> dict:
    result = run_carma("simulate", *FIRST_20, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def jittered_json() -> dict:
    return simulate_json("--jitter", "120", "--seeds", "3")


def test_jittered_runs_give_each_figures_mean_spread_and_each_seeds_runs(jittered_json):
    assert (jittered_json["jitter_s"], jittered_json["seeds"]) == (120, [0, 1, 2])
    [summary] = jittered_json["runs"]
    assert summary["config"] == "MAGM recovery only"
    assert [copy["seed"] for copy in jittered_json["seed_runs"]] == [0, 1, 2]
    for figure in ("makespan_s", "oom_crashes", "tasks_failed", "energy_mj", "jct_p95_s"):
        values = [copy["runs"][0][figure] for copy in jittered_json["seed_runs"]]
        assert summary[f"{figure}_mean"] == pytest.approx(statistics.fmean(values), abs=1e-4), figure
        assert summary[f"{figure}_sd"] == pytest.approx(statistics.stdev(values), abs=1e-4), figure
        assert (summary[f"{figure}_min"], summary[f"{figure}_max"]) == (min(values), max(values)), figure
    assert summary["makespan_s_max"] > summary["makespan_s_min"]  # the copies differ


def test_the_same_seeds_give_the_same_figures_and_jitter_0_those_of_the_trace(jittered_json):
    assert simulate_json("--jitter", "120", "--seeds", "3") == jittered_json
    plain = simulate_json()
    still = simulate_json("--jitter", "0", "--seeds", "2")
    assert [copy["runs"] for copy in still["seed_runs"]] == [plain["runs"]] * 2
    assert still["runs"][0]["makespan_s_mean"] == plain["runs"][0]["makespan_s"]


def test_the_table_gives_each_configurations_mean_and_range_over_the_seeds():
    result = run_carma(
        "simulate", *FIRST_20, "--policy", "magm", "--memory", "oracle", "--jitter", "60", "--seeds", "2"
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "arrivals moved by up to ±60 s, seeds 0-1: each figure's mean (least-most) over the seeds" in text
    assert "│ MAGM oracle │" in text and "makespan sd" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "4"], "--seeds takes --jitter"),
        (["--jitter", "60", "--bounds"], "--bounds takes the runs of the trace itself, not of jittered copies"),
        (["--jitter", "60", "--save", "runs.json"], "--save takes the runs of the trace itself"),
        (["--jitter", "inf"], "--jitter must be a finite number of seconds; got inf"),
    ],
)
def test_jitter_mistakes_are_one_line(tmp_path, args, message):
    result = run_carma("simulate", *FIRST_20, *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == []
