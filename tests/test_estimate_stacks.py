"""Device and software-stack constants, and the GPU-only memory xMem models rather than captures."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


MIB = 2**20


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CARMA_HOME", str(tmp_path))
    return tmp_path


def test_a_devices_context_is_its_software_stacks(config_home: Path) -> None:
    """The A100-40GB's one constant, 1449 MiB from the GPUMemNet runs (eager module loading), was about 900
    MiB above every small model CARMA measured on its lazily loading stack."""
    from carma.estimate import devices

    carma, gpumemnet = devices.get_device("a100-40gb"), devices.get_device("A100-40GB@cuda11-torch2-eager")
    assert (carma.stack, carma.context_bytes) == ("cuda12-torch2", 522 * MIB)
    assert (gpumemnet.name, gpumemnet.context_bytes) == ("a100-40gb@cuda11-torch2-eager", 1449 * MIB)
    assert devices.get_device("h100-80gb").stack == "cuda13-torch2"  # the stack it was measured on
    # a stack measured on another GPU only: that context, with this GPU's cuBLAS workspaces (32 MiB on Hopper)
    h100 = devices.get_device("h100-80gb").context_bytes
    assert devices.get_device("h200-141gb@cuda13-torch2").context_bytes == h100
    a100 = devices.get_device("a100-80gb@cuda13-torch2")
    assert a100.context_bytes == h100 - 2 * (32 * MIB - (8 * MIB + 128 * 1024))
    assert a100.source.startswith("first estimate, not measured: the cuda13-torch2 context of the h100-80gb")
    with pytest.raises(devices.EstimateError, match=r"^unknown stack 'cuda9'; known stacks: cuda12-torch2, "):
        devices.get_device("a100-40gb@cuda9")


def test_devices_toml_sets_the_stack_of_every_estimate_and_keeps_it(config_home: Path) -> None:
    from carma.estimate import devices

    (config_home / "devices.toml").write_text('stack = "cuda11-torch2-eager"\n')
    assert devices.get_device("a100-40gb").context_bytes == 1449 * MIB
    devices.save_calibrated(devices.Device("rtx-4090-24gb", 400 * MIB, 24 * 2**30, "measured", "cuda12-torch2"))
    assert (config_home / "devices.toml").read_text().splitlines()[1] == 'stack = "cuda11-torch2-eager"'
    assert devices.get_device("rtx-4090-24gb").stack == "cuda12-torch2"
    assert devices.get_device("a100-40gb").context_bytes == 1449 * MIB
    # a calibrated value is taken for its own stack, not for another one named
    devices.save_calibrated(devices.Device("a100-40gb", 600 * MIB, 40 * 2**30, "measured", "cuda12-torch2"))
    assert devices.get_device("a100-40gb@cuda12-torch2").context_bytes == 600 * MIB
    assert devices.get_device("a100-40gb@cuda11-torch2-eager").context_bytes == 1449 * MIB
    (config_home / "devices.toml").write_text('stack = "cuda7"\n')
    with pytest.raises(devices.EstimateError, match=r"devices.toml: unknown stack 'cuda7'; known stacks: "):
        devices.get_device("a100-40gb")


def test_calibration_names_the_stack_it_measured() -> None:
    from carma.estimate.devices import stack_of

    assert stack_of("2.11.0+cu130", "13.0", "") == "cuda13-torch2"
    assert stack_of("2.7.1+cu126", "12.6", "LAZY") == "cuda12-torch2"
    assert stack_of("2.0.1", "11.6", "eager") == "cuda11-torch2-eager"


CONV_JOB = """
import torch
from carma.estimate.base import TrainingJob

def job():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )
    batch = (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    return TrainingJob(model, batch, loss, torch.optim.Adam(model.parameters()))
"""


def test_cudnn_workspaces_are_modelled_per_convolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU never allocates cuDNN's workspaces: VGG-16 at batch 128 was estimated 2.9 GiB short. Each
    convolution's workspace is a transient block its stack's ratio sizes, which the caching allocator may
    have to open a segment for."""
    from carma.estimate.job import capture_job
    from carma.estimate.xmem import estimate_xmem

    (tmp_path / "convjob.py").write_text(CONV_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    capture = capture_job("convjob:job", steps=3)
    bare, modelled = (estimate_xmem(capture, 0, "gpu", workspace_ratio=r) for r in (0.0, 2.0))
    output = 16 * 64 * 64 * 64 * 4  # the largest block a convolution allocates: 16 MiB
    assert modelled.peak_bytes >= bare.peak_bytes + 2 * output  # a 32 MiB workspace beside what was there
    assert modelled.breakdown.total == modelled.peak_bytes
    (note,) = modelled.notes
    assert note.startswith("modelled, not captured: cuDNN's workspaces beside the 21 blocks convolutions allocate")
    assert bare.notes == ()


def test_the_estimate_takes_the_jobs_stack(tmp_path: Path) -> None:
    """`--stack` names the software stack the job will run on when it differs from the device's default."""
    import json

    from support import cli_env, run_carma

    (tmp_path / "train.py").write_text(
        "import torch\nmodel = torch.nn.Linear(8, 2)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(5):\n    model(torch.randn(4, 8)).sum().backward()\n    optimizer.step()\n"
    )
    env = cli_env(CARMA_HOME=str(tmp_path / "home"))
    done = run_carma(
        "estimate", "--stack", "cuda11-torch2-eager", "--json", "--", "python", "train.py", cwd=tmp_path, env=env
    )
    result = json.loads(done.stdout)
    assert (result["device"], result["breakdown"]["context"]) == ("a100-40gb@cuda11-torch2-eager", 1449 * MIB)
    refused = run_carma("estimate", "--stack", "cuda9", "--", "python", "train.py", cwd=tmp_path, env=env)
    assert refused.returncode == 2 and refused.stderr.startswith("error: unknown stack 'cuda9'; known stacks: ")
