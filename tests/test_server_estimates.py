"""Tasks that ask for a memory estimate, end to end: the daemon captures the task's own script on the CPU
in the background (xMem), or reads an earlier run's observed peak (history), and places with it."""

from __future__ import annotations

import json
import re
import sys

import pytest

from carma.estimate.devices import get_device
from carma.server import proctree
from carma.units import size_text
from servers import fakejob
from support import wait_until

TRAIN = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.Adam(model.parameters())
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(5):
    optimizer.zero_grad()
    with torch.autocast("cuda"):  # mixed precision on the GPU; the capture runs it as CPU autocast
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
print("trained")
"""


def submit(server, *command: str, **options: object) -> int:  # type: ignore[no-untyped-def]
    flags = [x for k, v in options.items() for x in (f"--{k}", str(v))]
    result = server.cli("submit", "--json", *flags, "--", *command)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["id"]


def first_attempt(server, task_id: int) -> dict:  # type: ignore[no-untyped-def]
    assert server.cli("wait", task_id, "--timeout", "120").returncode == 0, server.task(task_id)
    return server.task(task_id)["attempt_list"][0]


def test_xmem_estimates_the_tasks_own_script_before_placing_it(start_server, tmp_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "idle.py").write_text("print('no training here')\n")
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "20")
    trained = submit(server, sys.executable, "train.py", estimate="xmem", workdir=tmp_path)
    idle = submit(server, sys.executable, "idle.py", estimate="xmem", workdir=tmp_path)
    attempt = first_attempt(server, trained)
    assert (attempt["need"], attempt["need_source"]) == ("known", "xmem")
    listed = {t["id"]: t for t in server.json("queue", "--all")}  # the lists show the need it was placed with
    assert (listed[trained]["need"], listed[trained]["need_mib"]) == ("known", attempt["need_mib"])
    assert size_text(attempt["need_mib"] * 2**20) in server.cli("queue", "--all").stdout
    context = get_device("a100-40gb").context_bytes
    assert context / 2**20 < attempt["need_mib"] < context / 2**20 + 150  # the context and a few MiB of tensors
    shown = server.cli("show", trained).stdout
    assert "need " + str(attempt["need_mib"]) + " MiB from xmem" in shown
    estimate = server.task(trained)["memory_estimate"]  # what the need came from, part by part
    assert (estimate["method"], estimate["device"]) == ("xmem", "a100-40gb")
    assert -(-estimate["peak_bytes"] // 2**20) == attempt["need_mib"]
    assert estimate["breakdown"]["context"] == context
    assert f"estimate: {size_text(estimate['peak_bytes'])} by xmem for a100-40gb" in shown
    assert f"context {size_text(context)})" in shown
    (note,) = estimate["notes"]
    assert "autocast" in note and f"note: {note}" in shown
    assert server.cli("logs", trained).stdout == "trained\n"  # then it ran as submitted
    failed = first_attempt(server, idle)  # the estimate failed: it ran recovery only
    assert failed["need"] == "unknown" and failed["need_source"].startswith("xmem failed: ")
    assert "optimizer step" in failed["need_source"]
    assert server.task(idle)["memory_estimate"] is None
    # the task said "estimated by xmem", as if the estimate had been made: the failure showed on the attempt only
    assert "memory need: estimated by xmem, which failed (the script never reached an optimizer step" in (
        server.cli("show", idle).stdout
    )


def test_a_shell_line_asking_for_a_capture_is_refused_at_submission(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """It was taken, and its estimate failed later, in the server's log."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    refused = server.cli("submit", "--shell", "--estimate", "xmem", "--", "python", "train.py", "|", "tee", "log")
    assert (refused.returncode, refused.stderr) == (
        2,
        "error: a shell command line cannot be estimated by xmem: submit `python script.py ...` without --shell, or "
        "declare its memory (--mem)\n",
    )
    assert server.json("queue", "--all") == []


def test_history_uses_the_peak_an_earlier_run_of_the_command_was_seen_at(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    command = fakejob(60, "3GiB")
    first = first_attempt(server, submit(server, *command, estimate="history", workdir=tmp_path))
    assert first["need"] == "unknown" and first["need_source"].startswith("history: no earlier successful run")
    second = first_attempt(server, submit(server, *command, estimate="history", workdir=tmp_path))
    assert (second["need"], second["need_mib"], second["need_source"]) == ("known", 3072, "history")


def test_an_estimator_is_checked_and_not_given_with_a_declared_need(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    bad = server.cli("submit", "--estimate", "guess", "--", "true")
    assert bad.returncode == 2 and "estimate: choose one of xmem, faketensor, horus, gpumemnet, history" in bad.stderr
    both = server.cli("submit", "--estimate", "xmem", "--mem", "4GiB", "--", "true")
    assert both.returncode == 2 and "give mem or estimate, not both" in both.stderr
    assert server.json("queue", "--all") == []


def test_cancelling_a_task_that_waits_for_its_estimate_stops_the_capture(start_server, tmp_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(3600)  # loading a large dataset\n" + TRAIN)
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "20")
    slow = submit(server, sys.executable, "slow.py", estimate="xmem", workdir=tmp_path)
    trained = submit(server, sys.executable, "train.py", estimate="xmem", workdir=tmp_path)
    waiting = wait_until(lambda: "capturing for" in (server.task(slow)["waiting_reason"] or "") and server.cli("queue"))
    assert re.search(
        rf"^{slow} .* waiting for its memory estimate \(xmem: capturing for \d+ s\)$", waiting.stdout, re.M
    )
    assert server.cli("cancel", slow).returncode == 0
    attempt = first_attempt(server, trained)  # estimated without waiting for slow.py's capture to time out
    assert (attempt["need"], attempt["need_source"]) == ("known", "xmem")
    row = next(line for line in server.cli("queue", "--all").stdout.splitlines() if line.startswith(f"{slow} "))
    assert "cancelled" in row and "pending" not in row  # no estimate is coming


def test_stopping_the_daemon_kills_the_captures_under_way_and_exits_cleanly(start_server, tmp_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    (tmp_path / "slow.py").write_text("import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(3600)\n")
    server = start_server("--fake-gpus", "1xA100-40GB")
    submit(server, sys.executable, "slow.py", estimate="xmem", workdir=tmp_path)
    pid_file = tmp_path / "pid"
    capture = int(wait_until(lambda: pid_file.exists() and pid_file.read_text()))
    started = proctree.start_ticks(capture)
    server.stop()  # SIGTERM
    assert server.proc.returncode == 0
    wait_until(lambda: not proctree.alive(capture, started))  # killed, not left running
