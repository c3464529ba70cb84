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
    with pytest.raises(  # it said "unknown device 'rtx-4090-24gb'", listing rtx-4090-24gb among the known
        devices.EstimateError, match=r"^rtx-4090-24gb is calibrated for cuda12-torch2, not cuda13-torch2: measure it"
    ):
        devices.get_device("rtx-4090-24gb@cuda13-torch2")
    (config_home / "devices.toml").write_text('stack = "cuda7"\n')
    with pytest.raises(devices.EstimateError, match=r"devices.toml: unknown stack 'cuda7'; known stacks: "):
        devices.get_device("a100-40gb")


def test_calibration_names_the_stack_it_measured() -> None:
    from carma.estimate.devices import stack_of

    assert stack_of("2.11.0+cu130", "13.0", "") == "cuda13-torch2"
    assert stack_of("2.7.1+cu126", "12.6", "LAZY") == "cuda12-torch2"
    assert stack_of("2.0.1", "11.6", "eager") == "cuda11-torch2-eager"


CONV_JOB = """
import sys
import torch
from carma.estimate.base import TrainingJob


def network(kind):
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 64), torch.nn.Linear(64, 10))
    if kind == "depthwise":  # MobileNet's kind: strided, depthwise and 1x1 convolutions only
        convs = [torch.nn.Conv2d(3, 64, 3, 2, 1), torch.nn.Conv2d(64, 64, 3, 1, 1, groups=64)]
        convs.append(torch.nn.Conv2d(64, 64, 1))
    else:  # VGG's kind: dense 3x3 convolutions at stride 1
        convs = [torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1)]
    return torch.nn.Sequential(*convs, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))


def job(kind, batch_size):
    model = network(kind)
    batch = (torch.randn(batch_size, 3, 64, 64), torch.randint(0, 10, (batch_size,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    return TrainingJob(model, batch, loss, torch.optim.Adam(model.parameters()))


vgg_16 = lambda: job("vgg", 16)
vgg_64 = lambda: job("vgg", 64)
depthwise = lambda: job("depthwise", 64)
mlp = lambda: job("mlp", 64)
"""


def test_cudnn_workspaces_are_modelled_for_dense_3x3_convolutions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU never allocates cuDNN's workspaces: VGG-16 at batch 128 was estimated 3.7 GiB short. The
    largest Winograd transform of a dense 3x3 stride-1 convolution (36 values per 4x4 output tile, channel
    and image) is added as the segment it opens; it grows with the batch, and strided, depthwise and 1x1
    convolutions (MobileNet's) and MLPs take none."""
    from carma.estimate.job import capture_job
    from carma.estimate.xmem import estimate_xmem

    (tmp_path / "convjob.py").write_text(CONV_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    estimates = {name: estimate_xmem(capture_job(f"convjob:{name}", steps=2), 0, "gpu") for name in
                 ("vgg_16", "vgg_64", "depthwise", "mlp")}  # fmt: skip
    tiles = 16 * 16  # a 64x64 output in 4x4 tiles
    for name, batch in (("vgg_16", 16), ("vgg_64", 64)):
        workspace = 36 * tiles * batch * 64 * 4  # 64 channels of float32: 36 MiB at batch 16, 144 MiB at 64
        segment = -(-workspace // (2 * MIB)) * 2 * MIB if workspace >= 10 * MIB else 20 * MIB
        estimate = estimates[name]
        assert estimate.breakdown.workspaces == segment
        assert estimate.breakdown.total == estimate.peak_bytes
        (note,) = estimate.notes
        assert note.startswith(f"modelled, not captured: the {segment // MIB}.0 MiB segment of cuDNN's largest")
        assert f"a Winograd transform of the 3x3 convolution 3->64 channels at 64x64, batch {batch})" in note
    for name in ("depthwise", "mlp"):
        assert (estimates[name].breakdown.workspaces, estimates[name].notes) == (0, ())


def test_a_convolutions_geometry_survives_the_trace() -> None:
    """The capture names each convolution's window by its geometry, which the estimate reads back."""
    from carma.estimate.convolutions import Convolution, cudnn_workspace

    conv = Convolution(True, (8, 32, 147, 147), (64, 32, 3, 3), (147, 147), (1, 1), (1, 1), 1, False, 2, True, False)
    assert Convolution.parse(conv.mark()) == conv
    assert Convolution.parse("aten::convolution") is None
    assert cudnn_workspace(conv) == 36 * 37 * 37 * 8 * 64 * 2  # 147 = 36 tiles of 4 and one of 3
    strided = Convolution(False, (8, 32, 64, 64), (64, 32, 3, 3), (32, 32), (2, 2), (1, 1), 1, False, 4)
    assert cudnn_workspace(strided) == 0


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
    twice = run_carma(  # it read the stack as 'cuda13-torch2@cuda13-torch2'
        "estimate", "--device", "a100-40gb@cuda11-torch2-eager", "--stack", "cuda11-torch2-eager", "--json", "--",
        "python", "train.py", cwd=tmp_path, env=env,
    )  # fmt: skip
    assert json.loads(twice.stdout)["device"] == "a100-40gb@cuda11-torch2-eager"
    both = run_carma("estimate", "--device", "a100-40gb@cuda12-torch2", "--stack", "cuda13-torch2", "--", "x")
    assert (
        both.stderr == "error: --device a100-40gb@cuda12-torch2 names stack cuda12-torch2, --stack cuda13-torch2: "
        "give the stack once\n"
    )
