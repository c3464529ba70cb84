"""carma's MPS control daemon and MPS client settings (against a stand-in control tool)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carma.server.mps import MpsControl, MpsError, client_limits
from support import run_carma

STAND_IN = Path(__file__).parent / "bin"


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.setenv("PATH", f"{STAND_IN}:{os.environ['PATH']}")


def test_start_status_stop(tmp_path, on_path):
    control = MpsControl(tmp_path)
    assert not control.status().running
    started = control.start()
    assert started.running and started.servers == (4242,)
    assert control.start().running  # starting twice is harmless
    assert not control.stop().running
    assert not control.status().running


def test_a_stop_while_clients_run_says_it_quits_once_they_end(tmp_path, on_path, monkeypatch):
    control = MpsControl(tmp_path, timeout_s=3)  # each answer is a Python stand-in's start: 0.5 s failed under load
    control.start()
    monkeypatch.setenv("FAKE_MPS_CLIENTS", "1")
    with pytest.raises(MpsError, match=r"quits once its clients end \(MPS servers: 4242\); it was still running"):
        control.stop()
    monkeypatch.delenv("FAKE_MPS_CLIENTS")
    assert not control.stop().running


def test_a_control_daemon_that_does_not_answer_is_one_line_not_a_traceback(tmp_path, on_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_HANG", "1")
    with pytest.raises(MpsError, match=r"^the MPS control daemon did not answer 'get_server_list' within 0\.5 s$"):
        MpsControl(tmp_path, timeout_s=0.5).status()


def test_clients_find_carmas_own_control_daemon(tmp_path):
    env = MpsControl(tmp_path).client_env()
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log"),
    }


def test_without_the_mps_binaries_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control not found"):
        MpsControl(tmp_path).start()
    result = run_carma("mps", "status", "--home", tmp_path, env={"PATH": "/nonexistent", "HOME": str(tmp_path)})
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "not found" in result.stderr


@pytest.mark.parametrize(
    ("need", "gpus", "threads", "env"),
    [
        (8192, 1, None, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}),
        (
            8192,
            2,
            50,
            {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M,1=10240M", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"},
        ),
        (None, 1, 25, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),  # unknown need: no memory limit
        (None, 1, None, {}),
    ],
)
def test_client_limits(need, gpus, threads, env):
    assert client_limits(need, 2048, gpus, threads) == env
