"""Calibration on the public datasets reproduces what carma ships, and `carma twin` works as a user runs it.

The tests that need the datasets (Lucid, GPUMemNet) skip when `find_datasets` cannot find them; the
error path of `carma twin calibrate` needs no data and always runs. `carma twin calibrate` with real data
is never run here: it rewrites the shipped files in the source tree. The Python `calibrate()` computes the
same thing without writing.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from carma.calibration.sources import DataNotFound, find_datasets, package_rows
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
