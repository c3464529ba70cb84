"""The benchmark scripts as a user meets them first: `--help` says what each measures and runs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "options.py")  # options: their shared module


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_the_usage_and_no_run(script: str) -> None:
    """server_bench.py ran its 45 s of benchmarks on `--help`; dashboard_bench.py ran and ended in a traceback."""
    result = subprocess.run(
        [sys.executable, BENCHMARKS / script, "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-500:]
    assert result.stdout.startswith(f"usage: {script} ") and "machine:" not in result.stdout
