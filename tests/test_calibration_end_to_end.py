"""Calibration on the public datasets reproduces what carma ships, and `carma twin` works as a user runs it.

The tests that need the datasets (Lucid, GPUMemNet) skip when `find_datasets` cannot find them; the
error path of `carma twin calibrate` needs no data and always runs. `carma twin calibrate` with real data
is never run here: it rewrites the shipped files in the source tree. The Python `calibrate()` computes the
same thing without writing.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from carma.calibration.sources import DataNotFound, find_datasets, load_lucid, package_rows
from carma.sim.models import twin_params
from carma.traces.catalog import data_file
from support import run_carma


@pytest.fixture(scope="module")
def data_root() -> Path:
    try:
        return find_datasets()
    except DataNotFound as e:
        pytest.skip(f"public datasets not available ({e}); set $CARMA_DATASETS to run the end-to-end checks")


@pytest.fixture(scope="module")
def calibration(data_root):
    pytest.importorskip("scipy", reason="calibration needs SciPy (pip install 'carma[calibrate]')")
    from carma.calibration.calibrate import calibrate

    return calibrate(data_root)


def test_calibration_reproduces_the_shipped_parameters(calibration):
    assert calibration.params() == twin_params()


def test_calibration_reproduces_the_shipped_profiles(calibration):
    with open(data_file("profiles.csv"), newline="") as f:
        shipped = list(csv.DictReader(f))
    # Compared as the CSV writer writes them (str of each value), row by row in the workload table's order.
    fitted = [{key: str(value) for key, value in row.items()} for row in calibration.profiles]
    assert len(fitted) == len(shipped)
    for ours, theirs in zip(fitted, shipped, strict=True):
        assert ours == theirs, ours["task"]


def test_calibrate_writes_both_files_or_neither(calibration, tmp_path):
    """A profiles path that could not be written left the parameters rewritten: a fit with the other's data."""
    from carma.calibration.calibrate import write

    params, profiles = tmp_path / "twin_params.json", tmp_path / "profiles"
    params.write_text("old\n")
    profiles.mkdir()
    with pytest.raises(IsADirectoryError):
        write(calibration, params, profiles)
    assert params.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "profiles",
        "twin_params.json",
    ]
    profiles.rmdir()
    write(calibration, params, profiles)
    assert json.loads(params.read_text()) == twin_params()
    assert profiles.read_text() == data_file("profiles.csv").read_text()


def markdown_table(report: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header line is `header` (the separator line skipped)."""
    lines = report.splitlines()
    assert header in lines, f"no table headed {header!r} in the report"
    rows = []
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_validate_writes_the_fidelity_report(data_root, tmp_path):
    pytest.importorskip("scipy", reason="calibration needs SciPy (pip install 'carma[calibrate]')")
    report = tmp_path / "reports" / "fidelity.md"
    result = run_carma("twin", "validate", "--data", data_root, "--report", report, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert report.is_file()
    text = report.read_text()

    mae = markdown_table(text, "| predictor | held-out MAE of relative speed |")
    assert [row[0] for row in mae] == [
        "**carma time-slicing model**",
        "no interference (speed 1.0)",
        "proportional share of utilization",
    ]
    assert all(float(row[1].strip("*")) > 0 for row in mae)

    energy = markdown_table(text, "| sharing | copies | energy vs 1X: measured | twin | error |")
    thesis = {(r["mode"], r["tasks"]) for r in package_rows("thesis_energy.csv") if r["tasks"] != "1"}
    assert {(row[0].split()[0], row[1]) for row in energy} == thesis  # every multi-copy row of Table 4.2

    found = markdown_table(text, "| finding | twin | detail |")
    assert found, "the findings table is empty"
    assert all(row[1] in ("yes", "**no**") for row in found)
    assert list(tmp_path.iterdir()) == [tmp_path / "reports"]  # nothing written beside it


def test_calibrate_with_a_missing_data_folder_fails_with_one_line(tmp_path):
    # Checked first without the command: were it to fall back on other data, it would rewrite shipped files.
    with pytest.raises(DataNotFound, match="/nonexistent"):
        find_datasets(Path("/nonexistent"))
    result = run_carma("twin", "calibrate", "--data", "/nonexistent", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: calibration data not found in /nonexistent")
    assert "--data" in lines[0]


def test_find_datasets_takes_an_explicit_folder_that_holds_the_data(tmp_path):
    (tmp_path / "lucid").mkdir()
    (tmp_path / "lucid" / "colocation_pairs.csv").write_text("model1,model2\n")
    assert find_datasets(tmp_path) == tmp_path


def _datasets(root: Path, singles: str, pairs: str, runs: str) -> Path:
    for name, text in (("lucid/single_profiles.csv", singles), ("lucid/colocation_pairs.csv", pairs),
                       ("gpumemnet/mlp_training_runs.csv", runs)):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


SINGLES = "model,dataset,batchsize,amp,speed,gpu_util,gmem_util\nResNet18,cifar10,32,0,900,80,30\n"
PAIRS = "model1,dataset1,batchsize1,amp1,speed1,model2,dataset2,batchsize2,amp2,speed2\n"
PAIR = "ResNet18,cifar10,32,0,0.6,ResNet18,cifar10,32,0,0.6\n"
RUNS = "Avg GPUTL,Avg SMACT,Avg SMOCC\n50,0.4,0.2\n"


@pytest.mark.parametrize(
    ("singles", "pairs", "runs", "message"),
    [
        ("a,b,c\n1,2,3\n", PAIRS + PAIR, RUNS, "single_profiles.csv: no column 'model', 'dataset', 'batchsize'"),
        (SINGLES, PAIRS, RUNS, "colocation_pairs.csv: no measurements in it"),
        (SINGLES, PAIRS + PAIR.replace("32,0,0.6\n", "64,0,0.6\n"), RUNS,
         "colocation_pairs.csv, line 2: no solo profile of ResNet18 on cifar10, batch 64, amp 0"),
        (SINGLES.replace("900", "fast"), PAIRS + PAIR, RUNS,
         "single_profiles.csv, line 2: could not convert string to float: 'fast'"),
        (SINGLES, PAIRS + PAIR, "Avg GPUTL,Avg SMACT,Avg SMOCC\n", "mlp_training_runs.csv: no measurements in it"),
        (SINGLES, PAIRS + PAIR, RUNS.replace("0.4", "nan"), "mlp_training_runs.csv, line 2: Avg SMACT is 'nan'"),
        (SINGLES, PAIRS + PAIR[:20], RUNS,  # a truncated copy: a traceback once
         "colocation_pairs.csv, line 2: not as many values as the header has columns"),
        (SINGLES, PAIRS + PAIR, RUNS + "50,0.4\n", "mlp_training_runs.csv, line 3: not as many values as the header"),
        (SINGLES.replace(",0,900", ",yes,900"), PAIRS + PAIR, RUNS,
         "single_profiles.csv, line 2: amp is 'yes', not 0 or 1"),
    ],
    ids=["no-columns", "no-pairs", "unknown-solo", "not-a-number", "no-runs", "nan", "cut", "short-run", "amp"],
)  # fmt: skip
def test_measurements_that_cannot_be_fitted_are_one_line_naming_the_file_and_nothing_is_written(
    singles, pairs, runs, message, tmp_path
):
    data = _datasets(tmp_path / "data", singles, pairs, runs)
    result = run_carma("twin", "validate", "--data", data, "--report", "fidelity.md", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line
    assert not (tmp_path / "fidelity.md").exists()


def test_measurements_with_a_byte_order_mark_read_as_without(tmp_path):
    plain = _datasets(tmp_path / "plain", SINGLES, PAIRS + PAIR, RUNS)
    marked = _datasets(tmp_path / "marked", "\ufeff" + SINGLES, "\ufeff" + PAIRS + PAIR, RUNS)  # "no column 'model'"
    assert load_lucid(marked) == load_lucid(plain)


def test_validate_run_outside_a_checkout_writes_fidelity_md_where_it_runs(tmp_path):
    """Its default, docs/fidelity.md, was relative to the working directory: a docs/ folder appeared there."""
    from carma.cli.twin import _checkout_report

    assert _checkout_report() == Path(__file__).resolve().parents[1] / "docs" / "fidelity.md"  # run from here
    result = subprocess.run(
        [sys.executable, "-c", "import carma.cli.twin as t; print(t._checkout_report())"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(_copy_of_package(tmp_path))},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert result.stdout == "fidelity.md\n"


def _copy_of_package(tmp_path: Path) -> Path:
    """carma's package alone, as an installed wheel has it: no docs/ beside it."""
    site = tmp_path / "site"
    shutil.copytree(Path(__file__).resolve().parents[1] / "src" / "carma", site / "carma")
    return site


def test_a_report_path_that_is_a_directory_is_refused_before_the_work(tmp_path):
    result = run_carma("twin", "validate", "--data", "/nonexistent", "--report", tmp_path)
    assert (result.returncode, result.stderr) == (2, f"error: --report {tmp_path} is a directory; give a file name\n")
