"""The documented rules that turn Lucid's solo profiles into the twin's per-task profiles, on small hand-made
inputs (no datasets needed), and the integrity of the profiles file carma ships."""

from __future__ import annotations

import csv
import io

import pytest

from carma.calibration.calibrate import small_workload
from carma.calibration.profiles import FIELDS, build_profiles, busy_fraction, nearest_job
from carma.calibration.sources import LucidJob
from carma.calibration.utilization import UtilizationRelation
from carma.traces.catalog import data_file


def job(
    model: str,
    dataset: str,
    batch: int,
    amp: bool = False,
    speed: float = 400.0,
    gract: float = 0.9,
    drama: float = 0.45,
):
    return LucidJob(model, dataset, batch, amp, speed, gract, drama)


def by_key(*jobs: LucidJob) -> dict[tuple[str, str, int, bool], LucidJob]:
    return {(j.model, j.dataset, j.batch, j.amp): j for j in jobs}


SINGLES = by_key(
    job("ResNet50", "ImageNet", 32, speed=400.0, gract=0.9, drama=0.45),
    job("ResNet50", "ImageNet", 64, speed=430.0, gract=0.95, drama=0.5),
    job("ResNet50", "ImageNet", 48, amp=True),  # mixed precision: never an analogue
    job("ResNet50", "CIFAR-10", 48),  # another dataset: never an analogue for ImageNet
    job("BERT", "SQuAD", 32, speed=80.0, gract=0.96, drama=0.6),
    job("NeuMF", "MovieLens", 256, speed=9000.0, gract=0.3, drama=0.15),
    job("ResNet18", "CIFAR-10", 32, speed=1500.0, gract=0.8, drama=0.4),
    job("ResNet18", "CIFAR-10", 64, speed=2500.0, gract=0.9, drama=0.5),
    job("VGG", "CIFAR-10", 32, amp=True),
)
RELATION = UtilizationRelation(slope=1.25, offset=0.2, smocc_scale=0.5, smocc_power=1.5)
CONSTANTS = {
    "a100_speedup_over_lucid_gpu": 2.5,
    "startup_s": 5.0,
    "weights_load_gb_per_s": 0.5,
    "warmup_s": 7.0,
    "cuda_context_mib": 500.0,
    "resnet26_flops_ratio": 1.3,
}


# ----------------------------------------------------------------------------- nearest_job


@pytest.mark.parametrize(("batch", "expected"), [(32, 32), (40, 32), (48, 32), (49, 64), (500, 64), (1, 32)])
def test_nearest_job_picks_the_closest_fp32_batch_size_ties_to_the_smaller(batch, expected):
    chosen = nearest_job(SINGLES, "ResNet50", "ImageNet", batch)
    assert (chosen.model, chosen.dataset, chosen.batch, chosen.amp) == ("ResNet50", "ImageNet", expected, False)


@pytest.mark.parametrize(
    ("model", "dataset"),
    [("GPT-3", "ImageNet"), ("BERT", "ImageNet"), ("VGG", "CIFAR-10")],  # unknown; wrong dataset; AMP only
)
def test_nearest_job_without_an_fp32_profile_is_a_clear_error(model, dataset):
    with pytest.raises(ValueError, match=f"^Lucid has no FP32 profile of {model} on {dataset}$"):
        nearest_job(SINGLES, model, dataset, 32)


# ----------------------------------------------------------------------------- busy_fraction


def test_busy_fraction_is_the_analogues_gpu_time_per_sample_scaled_to_the_a100():
    analogue = job("ResNet50", "ImageNet", 32, speed=400.0, gract=0.8)
    # 100 samples/s x (0.8 / 400 s of V100 time per sample) x 1.5 (FLOPs) / 2.5 (A100 speed-up) = 0.12
    assert busy_fraction(100.0, analogue, 1.5, 2.5) == pytest.approx(0.12)
    assert busy_fraction(400.0, analogue, 1.0, 1.0) == pytest.approx(0.8)  # the analogue's own pace
    assert busy_fraction(10_000.0, analogue, 1.5, 2.5) == 1.0  # 12 x the GPU's capacity: busy all the time


# ----------------------------------------------------------------------------- build_profiles


def table(text: str) -> list[dict[str, str]]:
    """Rows of a small CSV table written inline, read as calibration reads its CSV files."""
    return list(csv.DictReader(io.StringIO(text.strip())))


# One task per rule. BERT's measured memory (800 MiB) lies below its first-sighting memory.
WORKLOADS = table("""
task,model,dataset,batch_size,minutes_per_epoch,mem_mib
CNN,cnn,imgs,40,10,9000
BERT,bert,text,8,3,800
DLRM,dlrm,clicks,1024,,700
""")
ANALOGUES = table("""
model,dataset,rule,lucid_model,lucid_dataset,flops_ratio,params_m,smact,source
cnn,imgs,throughput,ResNet50,ImageNet,2.0,500,,FLOPs by hand
bert,text,gpu-bound,BERT,SQuAD,,110,,no input pipeline
dlrm,clicks,thesis,NeuMF,MovieLens,,,0.05,thesis Table 4.4: DLRM solo SMACT 5%
""")
DATASETS = table("""
dataset,samples_per_epoch,setup_s
imgs,120000,30
text,,10
clicks,,12
""")


@pytest.fixture(scope="module")
def profiles() -> dict[str, dict[str, object]]:
    rows = build_profiles(WORKLOADS, ANALOGUES, DATASETS, SINGLES, RELATION, CONSTANTS)
    assert [row["task"] for row in rows] == ["CNN", "BERT", "DLRM"]  # one row per task, in the table's order
    return {row["task"]: row for row in rows}


# Values are rounded to 3 decimals (utilization) and 0.1 s (TTFK): compared within half a unit.
UTIL = 5e-4
SECONDS = 0.05


def test_throughput_rule_scales_the_analogues_gpu_time_by_carmas_throughput(profiles):
    cnn = profiles["CNN"]
    # 120,000 samples in 10 min = 200/s; analogue ResNet50 batch 32 (nearest to 40): 0.9 / 400 s per sample
    gract = 200 * (0.9 / 400) * 2.0 / 2.5
    assert gract == pytest.approx(0.36)
    smact = 1.25 * (gract - 0.2)
    assert cnn["gract"] == pytest.approx(gract, abs=UTIL)
    assert cnn["smact"] == pytest.approx(smact, abs=UTIL)
    assert cnn["smocc"] == pytest.approx(0.5 * smact**1.5, abs=UTIL)
    assert cnn["drama"] == pytest.approx(gract * 0.45 / 0.9, abs=UTIL)  # the analogue's memory-busy share
    assert "ResNet50/ImageNet batch 32" in cnn["utilization_source"]
    assert "200 samples/s" in cnn["utilization_source"]


def test_gpu_bound_rule_keeps_the_analogues_busy_time(profiles):
    bert = profiles["BERT"]
    assert bert["gract"] == pytest.approx(0.96, abs=UTIL)
    assert bert["smact"] == pytest.approx(1.25 * (0.96 - 0.2), abs=UTIL)
    assert bert["smocc"] == pytest.approx(0.5 * (1.25 * 0.76) ** 1.5, abs=UTIL)
    assert bert["drama"] == pytest.approx(0.6, abs=UTIL)
    assert "GPU-bound (no input pipeline)" in bert["utilization_source"]


def test_thesis_rule_takes_the_measured_smact_and_inverts_the_relation(profiles):
    dlrm = profiles["DLRM"]
    gract = 0.05 / 1.25 + 0.2  # 0.24
    assert dlrm["smact"] == pytest.approx(0.05, abs=UTIL)
    assert dlrm["gract"] == pytest.approx(gract, abs=UTIL)
    assert dlrm["smocc"] == pytest.approx(0.5 * 0.05**1.5, abs=UTIL)
    assert dlrm["drama"] == pytest.approx(gract * 0.15 / 0.3, abs=UTIL)  # NeuMF's memory-busy share
    assert dlrm["utilization_source"].startswith("thesis Table 4.4")


@pytest.mark.parametrize(
    ("task", "setup_s", "params_m"),
    [("CNN", 30, 500), ("BERT", 10, 110), ("DLRM", 12, 0)],  # DLRM has no parameter count: no weights to load
)
def test_time_to_first_kernel_is_startup_setup_and_loading_the_weights(profiles, task, setup_s, params_m):
    weights_s = params_m * 1e6 * 4 / (0.5 * 1e9)  # FP32 bytes at 0.5 GB/s: 4 s for 500 M parameters
    assert profiles[task]["ttfk_s"] == pytest.approx(5.0 + setup_s + weights_s, abs=SECONDS)
    assert profiles[task]["warmup_s"] == 7.0


@pytest.mark.parametrize(
    ("task", "expected_mib"),
    [
        ("CNN", round(500 + 500e6 * 4 / 2**20)),  # context + 1,907 MiB of weights = 2,407 MiB, under 9,000
        ("BERT", 800),  # context + 420 MiB = 920 MiB, more than the task ever uses (800): capped
        ("DLRM", 500),  # no weights: the context alone
    ],
)
def test_memory_at_first_sighting_is_context_and_weights_capped_by_the_tasks_need(profiles, task, expected_mib):
    assert profiles[task]["mem_first_mib"] == expected_mib


def test_every_profile_names_its_sources(profiles):
    for task, row in profiles.items():
        assert tuple(row) == FIELDS, task  # what `carma twin calibrate` writes as the CSV header
        for column in ("utilization_source", "ttfk_source", "memory_source"):
            assert isinstance(row[column], str) and row[column].strip(), (task, column)


# ----------------------------------------------------------------------------- small_workload


def test_small_workload_follows_the_throughput_rule_at_lucids_own_pace():
    load = small_workload(SINGLES, RELATION, CONSTANTS)
    # ResNet18/CIFAR-10 batch 32 at its own speed: busy 0.8 on Lucid's GPU, x1.3 FLOPs / 2.5 speed-up
    gract = 0.8 * 1.3 / 2.5
    assert load.gract == pytest.approx(gract)
    assert load.smact == pytest.approx(1.25 * (gract - 0.2))
    assert load.smocc == pytest.approx(0.5 * (1.25 * (gract - 0.2)) ** 1.5)
    assert load.drama == pytest.approx(gract * 0.4 / 0.8)


# ----------------------------------------------------------------------------- the shipped profiles


def read(name: str) -> list[dict[str, str]]:
    with open(data_file(name), newline="") as f:
        return list(csv.DictReader(f))


def test_shipped_profiles_cover_every_task_with_its_sources():
    rows = read("profiles.csv")
    tasks = [row["task"] for row in read("workloads.csv")]
    assert tasks, "workloads.csv is empty"
    assert sorted(row["task"] for row in rows) == sorted(tasks)  # one profile per task, none twice, none extra
    profiles = {row["task"]: row for row in rows}
    for task in tasks:
        for column in ("utilization_source", "ttfk_source", "memory_source"):
            assert profiles[task][column].strip(), (task, column)
