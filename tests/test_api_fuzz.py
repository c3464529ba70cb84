"""The API fuzzed from its own schema: schemathesis, every check, against a real daemon on fake GPUs over
TCP. The daemon runs what a submission's `command` says as its submitter, so the fuzzer holds a token that
is no admin's, of a user with no rights (`nobody`), on a daemon drained by its admin first: nothing it
submits is ever placed, and it may not resume placements."""

from __future__ import annotations

import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from servers import free_port

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
FUZZER_TOKEN = "fuzzer-token-0123456789"
# The schema cannot say that a working directory must exist, nor that a command's program is not blank:
# schema-valid submissions may get the one-line 422 of the server's own checks. Half of them are given an
# empty directory that exists, so that some are taken.
CONFIG = """
[dictionaries.workdirs]
values = ["{workdir}"]

[[operations]]
include-name = "POST /v1/tasks"
checks.positive_data_acceptance.expected-statuses = ["2xx", "422"]
parameters = {{ "body.workdir" = {{ dictionary = "workdirs", probability = 0.5 }} }}
"""
EXAMPLES = 25  # per operation and phase: about 700 requests, 10 s on one core


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def test_every_answer_is_as_the_schema_says_and_none_is_a_server_error(start_server, tmp_path):  # type: ignore[no-untyped-def]
    if not SCHEMATHESIS.exists():
        pytest.skip("schemathesis is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    home = tmp_path / "h"
    home.mkdir()
    (home / "tokens").write_text(f"{FUZZER_TOKEN} nobody {_nobody()}\n")
    (home / "tokens").chmod(0o600)
    port = free_port()
    server = start_server("--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{port}", home=home)
    assert server.cli("drain").returncode == 0  # before the first submission: none is ever placed
    (tmp_path / "work").mkdir()
    (tmp_path / "schemathesis.toml").write_text(CONFIG.format(workdir=tmp_path / "work"))
    command = [
        str(SCHEMATHESIS), "--no-color", "--config-file", str(tmp_path / "schemathesis.toml"), "run",
        f"http://127.0.0.1:{port}/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES), "--seed", "1",
        "--header", f"Authorization: Bearer {FUZZER_TOKEN}", "--request-timeout", "10",
        "--exclude-path", "/v1/events",  # a live stream: it never ends
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    tasks = server.json("queue", "--all")
    assert tasks and {t["state"] for t in tasks} <= {"queued", "cancelled"}  # submitted, and none ever placed
    assert server.json("status")["draining"]
    assert "Traceback" not in (home / "test-server.log").read_text()
