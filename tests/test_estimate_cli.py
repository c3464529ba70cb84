"""`carma estimate` end to end: the installed console script on a tiny job function and a tiny training script."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from carma.cli.estimate import _whole_mib
from carma.server.proctree import read_stat
from support import CARMA, cli_env, run_carma, wait_until

MIB = 2**20

pytest.importorskip("torch", reason="estimating needs PyTorch (pip install 'carma-gpu[estimate]')")

BREAKDOWN = {"parameters", "gradients", "optimizer_state", "activations", "allocator", "workspaces", "context"}
METHODS = ("xmem", "faketensor", "horus", "gpumemnet")

JOB = """
import torch
from carma.estimate.base import TrainingJob


def job():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    batch = (torch.randn(16, 64), torch.randint(0, 8, (16,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    return TrainingJob(model, batch, loss, torch.optim.Adam(model.parameters()))
"""

SCRIPT = """
import argparse
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(20):
    x = torch.randn(args.batch_size, 64).to(device)
    y = torch.randint(0, 8, (args.batch_size,)).to(device)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with the job module, the training script, one that never trains and one that takes long."""
    folder = tmp_path_factory.mktemp("estimate")
    (folder / "tinyjob.py").write_text(textwrap.dedent(JOB))
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    (folder / "notrain.py").write_text("import torch\nprint(torch.ones(2).sum())\n")
    (folder / "slow.py").write_text("import time\ntime.sleep(60)\n")
    return folder


def estimate(work: Path, *args: object):  # type: ignore[no-untyped-def]
    return run_carma("estimate", *args, cwd=work, env=cli_env(CARMA_HOME=str(work / "home")))


@functools.cache
def job_table(work: Path, method: str):  # type: ignore[no-untyped-def]
    """The job function's estimate by `method` as a table, which two tests read: made once per worker."""
    return estimate(work, "--job", "tinyjob:job", "--method", method)


def assert_estimate_json(stdout: str, method: str, device: str) -> dict:
    result = json.loads(stdout)
    assert set(result) == {"method", "peak_bytes", "breakdown", "device", "seconds", "device_bytes", "fits"}
    assert set(result["breakdown"]) == BREAKDOWN
    assert result["fits"] is (result["peak_bytes"] <= result["device_bytes"])  # the table's last line, for scripts
    assert (result["method"], result["device"]) == (method, device)
    assert result["peak_bytes"] == sum(result["breakdown"].values()) > result["breakdown"]["context"] > 0
    assert result["seconds"] > 0
    return result


def one_error_line(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("method", METHODS)
def test_a_job_function_is_estimated_by_each_method(work, method):
    result = estimate(work, "--job", "tinyjob:job", "--method", method, "--json")
    assert result.returncode == 0, result.stderr
    assert_estimate_json(result.stdout, method, "a100-40gb")


@pytest.mark.parametrize("method", METHODS)
def test_a_training_script_is_estimated_by_each_method(work, method):
    result = estimate(work, "--method", method, "--device", "h100-80gb", "--json", "--", "python", "train.py",
                      "--batch-size", "32")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_estimate_json(result.stdout, method, "h100-80gb")


def test_the_readable_output_is_a_table_of_the_breakdown(work):
    result = job_table(work, "horus")
    assert result.returncode == 0, result.stderr
    for part in ("parameters", "gradients", "optimizer state", "activations", "allocator", "context", "peak"):
        assert part in result.stdout
    assert "GiB" in result.stdout and "MiB" in result.stdout and "fits in the 40.00 GiB of a100-40gb" in result.stdout


def test_the_tables_parts_in_mib_add_up_to_its_peak(work):
    """Each part rounded alone, a 1455 MiB peak had parts adding up to 1456."""
    for method in ("xmem", "horus"):
        result = job_table(work, method)
        assert result.returncode == 0, result.stderr
        cells = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
        rows = {cell[1].strip(): int(cell[3].replace(",", "")) for cell in cells}
        assert sum(rows.values()) - rows["peak"] == rows["peak"], (method, rows)
    assert _whole_mib([int(0.6 * MIB)] * 3 + [1449 * MIB]) == [1, 1, 0, 1449]  # 1451, each rounded alone 1452
    assert _whole_mib([MIB // 2, MIB // 2]) == [1, 0]


def test_notes_on_the_capture_come_with_the_estimate(work):
    """A script's CUDA autocast runs as CPU autocast: the table and the JSON say so."""
    amp = SCRIPT.replace("    loss = torch", '    with torch.autocast("cuda"):\n        loss = torch')
    (work / "amp.py").write_text(textwrap.dedent(amp))
    table = estimate(work, "--", "python", "amp.py")
    assert table.returncode == 0, table.stderr
    assert "note: the job's CUDA autocast (mixed precision) ran as CPU autocast" in table.stdout
    as_json = estimate(work, "--json", "--", "python", "amp.py")
    assert as_json.returncode == 0, as_json.stderr
    notes = json.loads(as_json.stdout)["notes"]
    assert len(notes) == 1 and notes[0].startswith("the job's CUDA autocast")


def test_timeline_writes_a_png_for_xmem_making_its_folder(work):
    png = work / "plots" / "estimates" / "timeline.png"
    result = estimate(work, "--job", "tinyjob:job", "--timeline", png)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert result.stdout.splitlines()[-1] == f"wrote {png}"
    as_json = estimate(work, "--job", "tinyjob:job", "--timeline", "t.png", "--json")
    assert json.loads(as_json.stdout)["method"] == "xmem"
    assert as_json.stderr.splitlines()[-1] == "wrote t.png"  # it said nothing of the file


def test_the_timeline_counts_iterations_from_1_as_the_docs_do(monkeypatch):
    """The docs' "peak in iteration 2" was titled "peak in iteration 1" on the plot (counted from 0)."""
    from carma.estimate.xmem import estimator

    titles: list[str] = []
    monkeypatch.setattr(estimator, "draw_png", lambda sim, path, title: titles.append(title))
    for k in (1, -1):
        estimator.plot_timeline(estimator.XMemResult(None, k, 0, 0, 0, 0.0), "t.png", "h100-80gb")  # type: ignore[arg-type]
    assert titles == ["xMem on h100-80gb: peak in iteration 2", "xMem on h100-80gb: peak before the first iteration"]


def test_an_interpreter_that_does_not_run_is_reported_by_its_first_line(work, tmp_path):
    """A pyenv shim for a Python not installed: its last line, the one reported, was a fragment of advice."""
    shim = tmp_path / "bin" / "python2"
    shim.parent.mkdir()
    shim.write_text(
        "#!/bin/sh\necho 'pyenv: python2: command not found' >&2\necho >&2\n"
        "echo 'The python2 command exists in these Python versions:' >&2\necho '  2.7.18' >&2\nexit 127\n"
    )
    shim.chmod(0o755)
    env = cli_env(CARMA_HOME=str(work / "home"))
    env["PATH"] = f"{shim.parent}{os.pathsep}{env['PATH']}"
    result = run_carma("estimate", "--", "python2", "train.py", cwd=work, env=env)
    assert one_error_line(result) == (
        "error: the estimating process died (exit status 127): pyenv: python2: command not found"
    )


def test_a_timeline_named_as_a_folder_is_refused_before_the_capture(work):
    (work / "plots.png").mkdir()
    result = estimate(work, "--timeline", "plots.png", "--", "python", "slow.py")
    assert one_error_line(result) == "error: --timeline: 'plots.png' is a folder: give a file name ending in .png"


def test_without_matplotlib_a_timeline_is_refused_before_the_capture(work, tmp_path):
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = cli_env(CARMA_HOME=str(work / "home"), PYTHONPATH=str(tmp_path))
    result = run_carma("estimate", "--timeline", tmp_path / "t.png", "--", "python", "slow.py", cwd=work, env=env)
    assert one_error_line(result) == "error: --timeline: plots need matplotlib: pip install 'carma-gpu[plot]'"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--job", "tinyjob:job", "--method", "guess"), "--method must be one of xmem, faketensor, horus, gpumemnet"),
        (("--job", "tinyjob:job", "--method", "history"), "history is the server's estimate"),
        (("--job", "tinyjob:job", "--device", "tpu-v5"), "unknown device 'tpu-v5'; known devices: a100-40gb"),
        (("--job", "tinyjob:job", "--method", "horus", "--timeline", "t.png"), "--timeline needs --method xmem"),
        (("--job", "tinyjob:job", "--gpus", "2"), "--gpus is for a training command"),
        (("--gpus", "0", "--", "python", "train.py"), "--gpus"),
        ((), "give a training command after -- or a job function with --job"),
        (("--job", "tinyjob:job", "--", "python", "train.py"), "one, not both"),
        (("--job", "nosuchmodule:job"), "nosuchmodule"),
        (("--", "python", "notrain.py"), "optimizer"),
        (
            ("--", "python", "train.py", "--batchsize", "8"),  # argparse says why, on stderr
            "exited with status 2 after 0 optimizer steps: train.py: error: unrecognized arguments: --batchsize 8",
        ),
        (
            ("--", "python", "-c", "import sys; sys.exit('usage: train.py DIR')"),
            "the script exited after 0 optimizer steps: usage: train.py DIR",
        ),
        (("--timeout", "0", "--", "python", "train.py"), "--timeout must be a positive number of seconds, not 0"),
        (("--timeout", "nan", "--", "python", "train.py"), "--timeout must be a positive number of seconds, not nan"),
        (("--job", "tinyjob:job", "--timeline", "plot"), "--timeline writes a PNG: give a file name ending in .png"),
        (("--job", "tinyjob:job", "--timeline", "tinyjob.py/t.png"), "--timeline: cannot make the folder 'tinyjob.py'"),
        (("--job", "tinyjob:job", "--timeline", "/proc/t.png"), "--timeline: cannot write '/proc/t.png': "),
        (("--timeout", "1", "--", "python", "slow.py"), "did not reach 3 optimizer steps within 1 s"),
        (
            ("--steps", "1", "--", "python", "slow.py"),
            "xmem needs at least 2 training steps, not 1 (its peak",
        ),  # not captured
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(work, args, message):
    assert message in one_error_line(estimate(work, *args))


def test_a_training_command_without_the_double_dash_is_shown_where_it_goes(work):
    result = estimate(work, "python", "train.py", "--lr", "3")
    assert result.returncode == 2
    assert "put the training command after --: carma estimate -- python train.py --lr 3" in " ".join(
        line.strip("│ ") for line in result.stderr.splitlines()
    )


def test_calibrate_without_a_gpu_is_one_line(work):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "no CUDA GPU found" in one_error_line(estimate(work, "calibrate"))
    assert not (work / "home" / "devices.toml").exists()


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (("--device", "h100-80gb", "--json", "calibrate"), "--device, --json"),  # stored under the GPU's name
        (("calibrate", "--", "python", "train.py"), "a training command after --"),
    ],
)
def test_calibrate_refuses_what_only_an_estimate_reads(work, args, given):
    assert one_error_line(estimate(work, *args)) == (
        f"error: carma estimate calibrate takes none of the estimate's options ({given}); its own come after it: "
        "carma estimate calibrate --help"
    )


def test_without_pytorch_the_command_says_how_to_install_it(work, tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    env = cli_env(PYTHONPATH=str(tmp_path))
    result = run_carma("estimate", "--job", "tinyjob:job", cwd=work, env=env)
    assert one_error_line(result) == "error: estimating needs PyTorch: pip install 'carma-gpu[estimate]'"


def test_the_script_is_captured_under_the_python_its_command_names(work, tmp_path):
    """As the server does: `python` on the PATH (or a path, or a script's #! line) runs the capture, with its
    environment's packages; one without PyTorch, or not there, is one line."""
    import sys
    import venv

    wrapper = tmp_path / "bin" / "python3"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$0" >> {tmp_path}/ran\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    on_path = cli_env(CARMA_HOME=str(work / "home"), PATH=f"{wrapper.parent}:{cli_env()['PATH']}")
    result = run_carma("estimate", "--json", "--", "python3", "train.py", cwd=work, env=on_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ran").read_text().split() == [str(wrapper)]
    (work / "by_path.py").write_text(f"#!{wrapper}\n" + (work / "train.py").read_text())
    (work / "by_path.py").chmod(0o755)
    assert estimate(work, "--json", "--", "./by_path.py").returncode == 0
    assert (tmp_path / "ran").read_text().split() == [str(wrapper)] * 2

    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a Python without PyTorch
    line = one_error_line(estimate(work, "--", str(bare / "bin" / "python"), "train.py"))
    assert line.startswith(f"error: {bare}") and ", the Python that runs the job, has no PyTorch: install it" in line
    assert one_error_line(estimate(work, "--", "python9", "train.py")) == (
        "error: python9 is not on the PATH: activate the environment that has it, or give its path"
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_capture_stopped_by_a_signal_leaves_no_temporary_folder_nor_the_scripts_helpers(work, tmp_path, sig):
    """Their default action ended the command at once: a carma-estimate-* folder stayed in /tmp each time.
    Then the capture child died with the command, but a process the script had started ran on (a timeout
    ended it; a signal did not)."""
    pid_file = tmp_path / "helper.pid"
    helped = "import subprocess, sys, time\n"
    helped += "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    helped += f"open({str(pid_file)!r}, 'w').write(str(helper.pid))\ntime.sleep(60)\n"
    (work / "helped.py").write_text(helped)
    env = cli_env(CARMA_HOME=str(work / "home"), TMPDIR=str(tmp_path))
    command = [CARMA, "estimate", "--", "python", "helped.py"]
    capture = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    helper = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "the script's helper"))
    capture.send_signal(sig)
    try:
        assert capture.wait(timeout=30) == 128 + sig
        assert list(tmp_path.glob("carma-estimate-*")) == []
        wait_until(lambda: (stat := read_stat(helper)) is None or not stat.running, 10, "the script's helper to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)
