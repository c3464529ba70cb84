"""The real-GPU validation suite, exercised where there is no GPU: the workloads on the CPU, the mini-trace
replay as a dry run on a fake H100 (with the MPS stand-in)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = ROOT / "validation"
STAND_IN = Path(__file__).resolve().parent / "bin"


def run(script: str, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(VALIDATION / script), *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_a_workload_trains_and_reports_on_the_cpu():
    pytest.importorskip("torch")
    result = run("workloads.py", "--model", "mlp", "--batch-size", "4", "--steps", "3", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["step 1", "step 2", "step 3"]
    report = json.loads(lines[-1].removeprefix("carma-workload "))
    assert (report["model"], report["steps"], report["device"]) == ("mlp", 3, "cpu")
    assert report["samples_per_s"] > 0 and report["torch_peak_reserved_mib"] is None


def test_results_run_otherwise_are_not_mixed_into_one_report(tmp_path):
    """A 2-task run at steps scale 0.25 was put against a 4-task one at 1 (0.18x), and its peaks declared."""
    kept = {"config": "exclusive", "dry_run": True, "steps_scale": 1.0, "window_samples": 10, "tasks": ["a", "b"]}
    (tmp_path / "exclusive.json").write_text(json.dumps(kept))
    result = run("run.py", "--dry-run", "--limit", "2", "--steps-scale", "0.25", "--configs", "magm", "--out", tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"run.py: error: {tmp_path} holds results run otherwise: exclusive.json (steps_scale 1.0 there, 0.25 now, "
        "other tasks); give another --out, or remove them"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exclusive.json"]


def test_runs_measured_on_a_gpu_are_estimated_on_the_cpu_and_written(tmp_path, monkeypatch):
    """The part of validation/estimates.py after the GPU's measurements (fabricated here): it called the
    benchmark's `measure` one argument short, a TypeError once the GPU's work was done."""
    pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location("validation_estimates", VALIDATION / "estimates.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the benchmarks' folder it adds goes with the test
    from carma.estimate.devices import get_device

    name = "input:6_output:1_depth:2_arch:pyramid_batch:318_act:mish_dropout:0.5_dropout:False_batchnorm:False.out"
    rows = [{"Filename": name, "Total Parameters": "27", "Batch Size": "318"}]
    held = {"held": 1460 * 2**20, "snapshot": "00-mlp.pickle", "steps": 4, "max_reserved": 2 * 2**20}
    module.estimate_measured(tmp_path, "Test GPU", get_device("a100-40gb"), rows, [held], bert=False)
    written = json.loads((tmp_path / "estimates.json").read_text())
    (job,) = written["jobs"]
    assert job["job"] == name and job["measured_bytes"] == held["held"]
    assert set(job["estimates"]) == {"xmem", "faketensor", "horus", "gpumemnet"}
    assert all(isinstance(peak, int) and peak > 0 for peak in job["estimates"].values())
    assert "| input:6_output:1_depth:2" in (tmp_path / "estimates.md").read_text()


def test_the_mini_trace_replays_under_each_configuration_on_a_fake_gpu(tmp_path):
    out = tmp_path / "results"
    result = run(
        "run.py", "--dry-run", "--limit", "4", "--time-scale", "100", "--steps-scale", "0.5", "--out", out,
        env={"PATH": f"{STAND_IN}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    runs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("exclusive", "magm", "magm-mps")}
    for name, r in runs.items():
        assert (r["completed"], r["failed"], r["dry_run"]) == (4, 0, True), name
        assert r["energy_kj"] > 0 and r["makespan_s"] > 0
        assert (out / f"{name}.server.log").exists()
    assert runs["exclusive"]["collocated_attempts"] == 0
    peaks = {a["task"]: a["observed_peak_mib"] for a in runs["exclusive"]["attempts"]}
    assert peaks["resnet50-bs64"] == 14 * 1024  # the fake job's memory, as the daemon observed it
    mps = runs["magm-mps"]
    assert mps["mps"] and mps["declared_memory"]
    assert all(a["declared_mib"] == peaks[a["task"]] for a in mps["attempts"])  # from the exclusive run
    report = (out / "report.md").read_text()
    assert "dry run" in report and report.count("| magm-mps |") == 1 + 4


def test_a_dry_run_without_nvidias_mps_tools_leaves_the_mps_configuration_out(tmp_path):
    """It ran the other configurations and then failed on magm-mps: "no GPU needed" but MPS tools were."""
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if Path(d) != STAND_IN)
    result = run(
        "run.py", "--dry-run", "--limit", "1", "--time-scale", "200", "--steps-scale", "0.2", "--out", tmp_path,
        env={"PATH": path},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "note: the dry run leaves out magm-mps: nvidia-cuda-mps-control is not on the PATH" in result.stderr
    assert sorted(f.name for f in tmp_path.glob("*.json")) == ["exclusive.json", "magm.json"]


def test_an_unknown_configuration_is_one_clear_error(tmp_path):
    result = run("run.py", "--dry-run", "--configs", "exclusive,fastest", "--out", tmp_path)
    assert result.returncode == 2 and "unknown configuration(s) fastest" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_estimator_validation_refuses_plainly_without_a_gpu(tmp_path):
    """It measures jobs on a real GPU; here (CUDA hidden) it says so in one line and writes nothing."""
    pytest.importorskip("torch")
    result = run("estimates.py", "--sample", "2", "--out", tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: no CUDA GPU here: this validation trains the jobs on a GPU; run it on the GPU machine"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_segment_comparison_names_what_the_replay_lacks_and_where_the_gpu_opened_it(tmp_path):
    """validation/segments.py on estimates.py's files: a GPU snapshot holding one 20 MiB segment more than
    the replay (opened in a Linear's forward) and one 2 MiB segment less."""
    pytest.importorskip("torch")
    mib = 2**20
    run_name = (
        "input:155_output:20_depth:7_arch:uniform_batch:819_act:prelu_dropout:0.5_dropout:True_batchnorm:True.out"
    )
    replayed = run("segments.py", "--replay", run_name)
    assert replayed.returncode == 0, replayed.stderr
    replay = json.loads(replayed.stdout.splitlines()[-1])
    assert 2 * mib in replay and sum(replay) > 0
    on_gpu = sorted([*replay, 20 * mib])
    on_gpu.remove(2 * mib)
    frames = [
        {"filename": "/v/lib/python3.12/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "/v/lib/python3.12/site-packages/torch/nn/modules/module.py", "line": 1751, "name": "_call_impl"},
        {"filename": "/repo/benchmarks/gpumemnet_mlp.py", "line": 97, "name": "train"},
    ]
    trace = [{"action": "alloc", "addr": 1, "size": 512, "frames": []}]
    trace.append({"action": "segment_alloc", "addr": 2, "size": 20 * mib, "frames": frames})
    snapshot = {"segments": [{"total_size": size} for size in on_gpu], "device_traces": [trace]}
    with zipfile.ZipFile(tmp_path / "estimates-snapshots.zip", "w") as archive:
        archive.writestr("00-mlp.pickle", pickle.dumps(snapshot))
    jobs = [{"job": run_name, "snapshot": "00-mlp.pickle"}, {"job": "BERT-base fine-tuning", "snapshot": "01.pickle"}]
    (tmp_path / "estimates.json").write_text(json.dumps({"jobs": jobs}))

    result = run("segments.py", tmp_path)
    assert result.returncode == 0, result.stderr
    total = sum(replay) // mib
    small, large = replay.count(2 * mib), replay.count(20 * mib)
    assert result.stdout.splitlines() == [
        run_name,
        f"  GPU {total + 18} MiB in {len(replay)} segments, replay {total} MiB in {len(replay)}",
        f"  2 MiB segments: GPU {small - 1}, replay {small}",
        f"  20 MiB segments: GPU {large + 1}, replay {large}",
        "    opened at linear.py:125 forward (from gpumemnet_mlp.py:97 train)",
    ]  # BERT-base is not a GPUMemNet run: left out


def test_the_segment_comparison_refuses_a_folder_without_the_validation_results(tmp_path):
    result = run("segments.py", tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {tmp_path} does not hold validation/estimates.py's results: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_named_runs_are_measured_in_their_order_and_an_unknown_one_is_refused(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("validation_estimates", VALIDATION / "estimates.py")
    estimates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(estimates)
    rows = [{"Filename": f"run{i}"} for i in range(5)]
    runs = tmp_path / "runs.txt"
    runs.write_text("# worst first\nrun3\n\nrun1\n")
    assert estimates.choose_runs(rows, runs, 2, 0) == [rows[3], rows[1]]
    assert len(estimates.choose_runs(rows, None, 2, 0)) == 2  # without a file: a seeded sample
    runs.write_text("run3\nrun9\n")
    with pytest.raises(ValueError, match="not a GPUMemNet run: run9"):
        estimates.choose_runs(rows, runs, 2, 0)


def _estimates_module(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("validation_estimates", VALIDATION / "estimates.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders it adds go with the test
    return module


def test_carmas_tasks_are_measured_as_named_and_the_benchmark_judges_its_estimates_by_them(tmp_path, monkeypatch):
    """`estimates.py --models`'s part after the GPU (its measurements fabricated here) writes the truth that
    `benchmarks/estimators_models.py --measured` then judges the CPU's estimates by, for the GPU's context: the
    task's outcome (its estimates above the context) taken from a results file, so nothing is captured."""
    pytest.importorskip("torch")
    from carma.estimate.devices import get_device

    estimates = _estimates_module(monkeypatch)
    covered = estimates.load_tasks().load(ROOT.parent / "shared" / "datasets" / "carma" / "workloads.csv")
    chosen = estimates.choose_models(["vgg", "resnet"], covered, gpus=1)
    assert [(t.name, t.model, t.batch_size) for t in chosen] == [("vgg", "vgg16", 32), ("resnet", "resnet50", 32)]
    with pytest.raises(ValueError, match="gpt2_large_2 trains on 2 GPUs, and this machine has 1"):
        estimates.choose_models(["vgg", "gpt2_large_2"], covered, gpus=1)
    with pytest.raises(ValueError, match="not a task validation/models covers: vgg99"):
        estimates.choose_models(["vgg99"], covered, gpus=1)
    with pytest.raises(ValueError, match="gpt2_large_2 trains on 2 GPUs from GPU 0: measure it with --gpu 0"):
        estimates.choose_models(["gpt2_large_2"], covered, gpus=4, first=1)
    assert estimates.choose_models([" vgg"], covered, gpus=1) == chosen[:1]

    held = [{"held": mib * 2**20, "snapshot": f"{i:02d}-script.pickle", "steps": 10, "max_reserved": 2**30,
             "max_allocated": 2**29} for i, mib in enumerate((8000, 4500))]  # fmt: skip
    monkeypatch.setattr(estimates, "measure_on_gpu", lambda jobs, gpu, archive: held)
    device = get_device("a100-40gb")
    estimates.measure_models(chosen, 10, 0, tmp_path, "Test GPU", device)
    written = json.loads((tmp_path / "models.json").read_text())
    assert [(t["task"], t["held_bytes"], t["carma_a100_mib"]) for t in written["tasks"]] == [
        ("vgg", 8000 * 2**20, 6684), ("resnet", 4500 * 2**20, 3934)
    ]  # fmt: skip
    written["context_bytes"] = 1000 * 2**20  # the GPU's calibrated context
    (tmp_path / "models.json").write_text(json.dumps(written))
    outcomes = tmp_path / "results.jsonl"
    above = {"xmem": 7000.0, "faketensor": 3500.0, "horus": None, "gpumemnet": None}
    rows = [("vgg", 6684, 7000.0), ("resnet", 3934, 3600.0)]  # CARMA's MiB, xMem's estimate above the context
    outcomes.write_text("".join(
        json.dumps({"task": task, "family": "CNN", "measured_mib": mib, "above": {**above, "xmem": xmem},
                    "errors": {}, "seconds": 1}) + "\n"
        for task, mib, xmem in rows
    ))  # fmt: skip
    bench = [sys.executable, str(ROOT / "benchmarks" / "estimators_models.py")]
    done = subprocess.run([*bench, "--measured", tmp_path / "models.json", "--results", outcomes],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("CARMA workload tasks: 2; measured on Test GPU, PyTorch")
    assert lines[1].endswith("context 1000 MiB")
    vgg = next(line for line in lines if line.startswith("vgg "))
    assert vgg.split()[1:4] == ["8000", "8000", "+0%"]  # 7,000 above a context of 1,000: the GPU's 8,000
    resnet = next(line for line in lines if line.startswith("resnet "))
    assert resnet.split()[1:4] == ["4500", "4600", "+2%"]
    only = subprocess.run([*bench, "--measured", tmp_path / "models.json", "--results", outcomes, "--tasks", "vgg"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert only.returncode == 0, only.stderr
    assert "CARMA workload tasks: 1;" in only.stdout and "\nresnet " not in only.stdout
    (tmp_path / "models.json").write_text("{}")
    refused = subprocess.run([*bench, "--measured", tmp_path / "models.json"], capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.startswith("error: ") and "--models" in refused.stderr
