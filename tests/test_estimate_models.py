"""The validation set of real models (validation/models) and the benchmark that judges the estimators on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "validation" / "models"
WORKLOADS = ROOT.parent / "shared" / "datasets" / "carma" / "workloads.csv"
TORCHVISION = Path(sys.prefix) / "torchvision"  # where `make setup` installs it (validation/models/torchvision_ops.py)

torch = pytest.importorskip("torch")
sys.path.insert(0, str(MODELS))
import tasks  # noqa: E402  (validation/models is a folder of scripts)


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """A few rows of CARMA's table, as shared/datasets/carma/workloads.csv holds them."""
    path = tmp_path / "workloads.csv"
    path.write_text(
        "task,model,dataset,batch_size,gpus,epochs,minutes_per_epoch,solo_minutes,mem_mib,horus_mib,faketensor_mib,"
        "gpumemnet_mib\n"
        "BERT_base,bert_base,wikitext-2,32,1,1,14.92,14.92,19828,17457,,32000\n"
        "resnet18_cifar100_20e_1,resnet18,cifar100,32,1,20,0.49,9.8,788,2232,54,8000\n"
        "resnet18_cifar100_50e_1,resnet18,cifar100,32,1,50,0.49,24.5,788,2232,54,8000\n"
        "gpt2_large_2,gpt2_large,wikitext-2,8,2,1,65.72,65.72,28356,,,\n"
        "UNet,unet,voc,8,1,90,0.35,31.5,9910,2231,3404,8000\n"
        "vgg3,vgg16,imagenet,128,1,1,44.6,44.6,21864,,9894,24000\n"
    )
    return path


def test_the_covered_tasks_are_carmas_cnns_transformers_and_unet_each_once(table: Path) -> None:
    """The 20- and 50-epoch CIFAR tasks train the same job: one task; a two-GPU task is captured for its GPUs."""
    loaded = tasks.load(table)
    assert [(t.name, t.family, t.mem_mib, t.gpus) for t in loaded] == [
        ("BERT_base", "transformer", 19828, 1),
        ("resnet18_cifar100_20e_1", "CNN", 788, 1),
        ("gpt2_large_2", "transformer", 28356, 2),
        ("UNet", "CNN", 9910, 1),
        ("vgg3", "CNN", 21864, 1),
    ]
    bert, resnet, gpt2, unet, vgg = (t.argv("python") for t in loaded)
    assert bert == ["python", str(MODELS / "language.py"), "bert_base", "--batch-size", "32"]
    assert resnet == ["python", str(MODELS / "vision.py"), "resnet18", "--dataset", "cifar100", "--batch-size", "32"]
    assert gpt2 == ["python", str(MODELS / "gpt2.py"), "--batch-size", "8"]
    assert unet == ["python", str(MODELS / "segmentation.py"), "--batch-size", "8"]
    assert vgg[-4:] == ["--dataset", "imagenet", "--batch-size", "128"]


@pytest.mark.skipif(not WORKLOADS.exists(), reason="shared/datasets/carma/workloads.csv is not here")
def test_every_covered_task_of_carmas_table_is_there() -> None:
    """All of CARMA's table but DLRM and Mask R-CNN (validation/models/tasks.py says why)."""
    loaded = tasks.load(WORKLOADS)
    covered = {*tasks.VISION, *tasks.LANGUAGE, *tasks.CAUSAL, *tasks.CLASSIFICATION, *tasks.SEGMENTATION}
    assert len(loaded) == 36 and {t.model for t in loaded} == covered
    two_gpus = sorted(t.name for t in loaded if t.gpus == 2)
    assert two_gpus == ["gpt2_large_2", "xlnet_base_cased_2", "xlnet_large_cased_2"]


def test_xception_is_timms_architecture() -> None:
    """timm's `xception` has 22,855,952 parameters for 1,000 classes; torchvision has no Xception."""
    from xception import xception

    model = xception(1000)
    assert sum(p.numel() for p in model.parameters()) == 22_855_952
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_gpt2_is_gpt2_large() -> None:
    """GPT-2 large has 774,030,080 parameters (its embedding tied to its head); built on the meta device."""
    pytest.importorskip("transformers")
    from gpt2 import config
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config())
    assert sum(p.numel() for p in model.parameters()) == 774_030_080


@pytest.mark.skipif(
    not (TORCHVISION / "torchvision").is_dir(), reason=f"torchvision is not installed in {TORCHVISION} (make setup)"
)
def test_unet_is_segmentation_models_pytorchs_architecture() -> None:
    """segmentation_models_pytorch's `Unet("resnet34", classes=21)` has 24,439,269 parameters (0.4 to 0.6) and
    answers each pixel's 21 class scores; CARMA's VOC script trains it on 512x512 images. In a process of its
    own, as torchvision's import."""
    code = f"""
import sys
sys.path.insert(0, {str(MODELS)!r})
import torch, torchvision_ops, unet
model = unet.Unet(torchvision_ops.import_models(), 21)
print(sum(p.numel() for p in model.parameters()), tuple(model(torch.randn(1, 3, 64, 96)).shape))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "24439269 (1, 21, 64, 96)", done.stderr[-800:]


@pytest.mark.skipif(
    not (TORCHVISION / "torchvision").is_dir(), reason=f"torchvision is not installed in {TORCHVISION} (make setup)"
)
def test_torchvisions_models_import_beside_cpu_torch_and_download_nothing() -> None:
    """`import torchvision` failed (`operator torchvision::nms does not exist`): its compiled operators do not
    load beside the CPU PyTorch. In a process of its own: the schemas it defines are global."""
    code = f"""
import sys, socket
sys.path.insert(0, {str(MODELS)!r})
socket.socket.connect = lambda *a: sys.exit("tried to connect")  # weights=None: nothing to download
import torch, torchvision_ops
models = torchvision_ops.import_models()
for name in ("resnet18", "vgg16", "mobilenet_v3_small", "efficientnet_b0"):
    getattr(models, name)(weights=None, num_classes=100)(torch.randn(2, 3, 32, 32)).sum().backward()
try:
    torch.ops.torchvision.nms(torch.zeros(2, 4), torch.zeros(2), 0.5)
except NotImplementedError:
    print("nms has no kernel")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "nms has no kernel"), done.stderr[-800:]


def test_transformers_models_import_beside_the_validation_torchvision() -> None:
    """Installed among the environment's packages, torchvision was imported by transformers' model classes,
    and `from transformers import BertForMaskedLM` failed for every test and job."""
    pytest.importorskip("transformers")
    code = "from transformers import BertForMaskedLM; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-800:]


def _outcome(task: str, family: str, measured: int, xmem: float, faketensor: float) -> dict:
    above = {"xmem": xmem, "faketensor": faketensor, "horus": None, "gpumemnet": None}
    return {"task": task, "family": family, "measured_mib": measured, "above": above, "errors": {}, "seconds": 1.0}


def test_the_benchmark_judges_per_family_and_counts_underestimates(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import estimators_models

    outcomes = [
        _outcome("cnn-a", "CNN", 1000, 500, 400),  # context 500: xmem exact, faketensor -10%
        _outcome("cnn-b", "CNN", 2000, 1560, 1400),  # +3%, -5%
        _outcome("bert", "transformer", 10000, 9000, 9000),  # -5.0% each: an underestimate beyond 3%
    ]
    assert estimators_models.figures(outcomes, "xmem", "CNN", 500) == {
        "tasks": 2, "median": pytest.approx(0.015), "under": 0, "under_limit": 0, "worst_under": 0.0,
    }  # fmt: skip
    everything = estimators_models.figures(outcomes, "xmem", "all", 500)
    assert (everything["under"], everything["under_limit"], everything["median"]) == (1, 1, pytest.approx(0.03))
    assert estimators_models.figures(outcomes, "horus", "all", 500) is None
    estimators_models.report(outcomes, 500)
    out = capsys.readouterr().out
    assert "yes  xMem median absolute error <= 5%" in out
    assert "NO   xMem no underestimate larger than 3%" in out
    assert "yes  xMem better than every baseline" in out
