"""The real-GPU validation suite, exercised where there is no GPU: the workloads on the CPU, the mini-trace
replay as a dry run on a fake H100 (with the MPS stand-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = ROOT / "validation"
STAND_IN = Path(__file__).resolve().parent / "bin"


def run(script: str, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(VALIDATION / script), *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_a_workload_trains_and_reports_on_the_cpu():
    pytest.importorskip("torch")
    result = run("workloads.py", "--model", "mlp", "--batch-size", "4", "--steps", "3", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["step 1", "step 2", "step 3"]
    report = json.loads(lines[-1].removeprefix("carma-workload "))
    assert (report["model"], report["steps"], report["device"]) == ("mlp", 3, "cpu")
    assert report["samples_per_s"] > 0 and report["torch_peak_reserved_mib"] is None


def test_the_mini_trace_replays_under_each_configuration_on_a_fake_gpu(tmp_path):
    out = tmp_path / "results"
    result = run(
        "run.py", "--dry-run", "--limit", "4", "--time-scale", "100", "--steps-scale", "0.5", "--out", out,
        env={"PATH": f"{STAND_IN}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    runs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("exclusive", "magm", "magm-mps")}
    for name, r in runs.items():
        assert (r["completed"], r["failed"], r["dry_run"]) == (4, 0, True), name
        assert r["energy_kj"] > 0 and r["makespan_s"] > 0
        assert (out / f"{name}.server.log").exists()
    assert runs["exclusive"]["collocated_attempts"] == 0
    peaks = {a["task"]: a["observed_peak_mib"] for a in runs["exclusive"]["attempts"]}
    assert peaks["resnet50-bs64"] == 14 * 1024  # the fake job's memory, as the daemon observed it
    mps = runs["magm-mps"]
    assert mps["mps"] and mps["declared_memory"]
    assert all(a["declared_mib"] == peaks[a["task"]] for a in mps["attempts"])  # from the exclusive run
    report = (out / "report.md").read_text()
    assert "dry run" in report and report.count("| magm-mps |") == 1 + 4


def test_an_unknown_configuration_is_one_clear_error(tmp_path):
    result = run("run.py", "--dry-run", "--configs", "exclusive,fastest", "--out", tmp_path)
    assert result.returncode == 2 and "unknown configuration(s) fastest" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_estimator_validation_refuses_plainly_without_a_gpu(tmp_path):
    """It measures jobs on a real GPU; here (CUDA hidden) it says so in one line and writes nothing."""
    pytest.importorskip("torch")
    result = run("estimates.py", "--sample", "2", "--out", tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: no CUDA GPU here: this validation trains the jobs on a GPU; run it on the GPU machine"
    ]
    assert list(tmp_path.iterdir()) == []
