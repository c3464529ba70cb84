"""Validate the memory estimators on a real GPU: what training jobs really peak at, against each estimate.

    python validation/estimates.py --out DIR                    # 24 GPUMemNet MLP runs (seed 0) and BERT-base
    python validation/estimates.py --sample 40 --seed 2 --skip-bert --out DIR
    python validation/estimates.py --runs validation/xmem-misses.txt --skip-bert --out DIR   # named runs
    python validation/estimates.py --models resnet,vgg,BERT_base --out DIR   # CARMA's tasks, measured

benchmarks/estimators.py takes its truth from the GPUMemNet dataset, measured with an unknown PyTorch on an
unnamed GPU. Here every figure comes from this machine, set up as a user would set carma up on it:

1. the GPU is calibrated (`carma estimate calibrate`, into this run's own CARMA_HOME): the device's
   context constant;
2. each job trains on the GPU in a process of its own with PyTorch's allocator history recorded: a
   GPUMemNet MLP run for two epochs of its loop (so an epoch's smaller last batch is among them), BERT-base
   fine-tuning for 5 steps. Its measured peak is the GPU memory the process holds at the end, as nvidia-smi
   counts it (the caching allocator keeps the segments of its peak), with PyTorch's
   `max_memory_reserved()` beside it; the allocator snapshots go to DIR/estimates-snapshots.zip (open one at
   https://pytorch.org/memory_viz) to show which segments an estimate misses;
3. each job is estimated on the CPU as `carma estimate` does it (CUDA hidden, a process of its own), by
   every method, for the calibrated device;
4. DIR/estimates.json and DIR/estimates.md: the benchmark's table with these measurements as the truth,
   and each job's misses.

With `--models`, the jobs are CARMA's workload tasks instead, as validation/models trains them (named as in
CARMA's table; a two-GPU task needs two GPUs here): each script trains `--model-steps` optimizer steps on
the GPU and is measured as above, into DIR/models.json (with the calibrated context and CARMA's own A100
figure beside each) and DIR/models-snapshots.zip. Their CPU estimates do not need the GPU:
`benchmarks/estimators_models.py --measured DIR/models.json` makes them and judges them against this
truth, here or on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import platform
import random
import runpy
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

from carma.calibration.sources import GPUMEMNET_RUNS, DataNotFound, find_datasets
from carma.estimate.base import EstimateError
from carma.estimate.devices import calibrate, memory_held_by
from carma.estimate.registry import CPU_METHODS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
BERT = "estimators:bert_job"  # benchmarks/estimators.py's job function (its folder is on the children's path)
BERT_STEPS = 5
MODEL_STEPS = 10  # past the first steps' growth (Adam's state, the allocator's segments) on every task
MIB = 2**20
MODELS = Path(__file__).resolve().parent / "models"  # CARMA's tasks as training scripts
WORKLOADS = "carma/workloads.csv"


class _Enough(BaseException):
    """Raised from an optimizer step hook once the measured job has run its steps."""


def load_benchmarks() -> ModuleType:
    """benchmarks/estimators.py, whose capture children and figures this reuses (its folder put on the path
    once: `main` and `estimate_measured` both load it)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import estimators

    return estimators


def hold(kind: str, target: str, steps: int, gpu: int, snapshot: Path) -> None:
    """The measured job, in a process of its own: train `steps` optimizer steps on GPU `gpu` with the
    allocator's history recorded, save its snapshot, print one JSON line and hold the memory until stdin
    closes (so that `memory_held_by` reads what the process holds)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.cuda.set_device(gpu)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    done = 0

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal done
        done += 1
        if done >= steps:
            raise _Enough

    handle = register_optimizer_step_post_hook(count)
    with contextlib.suppress(_Enough), contextlib.redirect_stdout(sys.stderr):  # stdout: the one line below
        if kind == "mlp":
            from carma.estimate.gpumemnet import parse_run_name

            load_benchmarks()  # its folder on the path: gpumemnet_mlp
            from gpumemnet_mlp import train

            train(parse_run_name(target), seconds=math.inf)
        elif kind == "script":  # `python SCRIPT ARGS...`, run as python runs it
            argv = json.loads(target)
            sys.argv = argv[1:]
            sys.path.insert(0, str(Path(argv[1]).parent))
            runpy.run_path(argv[1], run_name="__main__")
        else:
            train_job(load_benchmarks(), target)
    handle.remove()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(str(snapshot))
    torch.cuda.memory._record_memory_history(enabled=None)
    report = {
        "steps": done,
        "max_reserved": torch.cuda.max_memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
    }
    print(json.dumps(report), flush=True)
    sys.stdin.read()


def train_job(estimators: ModuleType, target: str) -> None:
    """A job function's training loop on the GPU, as `carma estimate --job` runs it on the CPU."""
    job = getattr(estimators, target.partition(":")[2])()
    job.model.cuda()  # in place: the optimizer keeps its parameters
    batch = {k: v.cuda() for k, v in job.batch.items()} if isinstance(job.batch, dict) else job.batch.cuda()
    while True:
        job.optimizer.zero_grad()
        job.loss(job.model, batch).backward()
        job.optimizer.step()


def measure_on_gpu(jobs: list[tuple[str, str, int]], gpu: int, archive: Path) -> list[dict[str, Any] | None]:
    """Each job's GPU memory as its own process holds it after its steps (None: it failed, reported); the
    allocator snapshots go into one zip `archive` (one file: the GPU machine returns few)."""
    results: list[dict[str, Any] | None] = []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as snapshots:
        for i, (kind, target, steps) in enumerate(jobs):
            name = f"{i:02d}-{kind}.pickle"
            argv = [sys.executable, __file__, "--hold", kind, target, "--steps", str(steps), "--gpu", str(gpu)]
            try:
                held, line = memory_held_by([*argv, "--snapshot", str(Path(tmp) / name)], gpu)
            except EstimateError as e:
                print(f"measuring {target} on the GPU failed: {e}", file=sys.stderr)
                results.append(None)
                continue
            snapshots.write(Path(tmp) / name, name)
            results.append({"held": held, "snapshot": name, **json.loads(line)})
            print(f"\r{i + 1}/{len(jobs)} jobs measured on the GPU", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return results


def choose_runs(rows: list[dict[str, str]], runs: Path | None, sample: int, seed: int) -> list[dict[str, str]]:
    """The dataset rows to measure: those `runs` names (one per line; blank lines and `#` comments
    skipped), or `sample` of them drawn with `seed`. A name not in the dataset is a ValueError."""
    if runs is None:
        return random.Random(seed).sample(rows, sample)
    by_name = {row["Filename"]: row for row in rows}
    names = [line.strip() for line in runs.read_text().splitlines()]
    names = [name for name in names if name and not name.startswith("#")]
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"{runs}: not a GPUMemNet run: {unknown[0]}")
    return [by_name[name] for name in names]


def machine_of(gpu_name: str) -> str:
    """The GPU and software a measurement was made with, as the written results name it."""
    import torch

    return f"{gpu_name}, PyTorch {torch.__version__}, CUDA {torch.version.cuda}, {platform.machine()}"


def load_tasks() -> ModuleType:
    """validation/models/tasks.py (its folder, of scripts, put on the path once)."""
    if str(MODELS) not in sys.path:
        sys.path.insert(0, str(MODELS))
    import tasks

    return tasks


def choose_models(names: list[str], covered: list[Any], gpus: int, first: int = 0) -> list[Any]:
    """The named tasks of those validation/models covers, in the order named, measured from GPU `first`; a
    name it does not cover, a task on more GPUs than `gpus`, or one on several measured from another GPU than
    the first (DataParallel and Trainer start on cuda:0) is a ValueError."""
    by_name = {task.name: task for task in covered}
    names = [name.strip() for name in names]
    if unknown := [name for name in names if name not in by_name]:
        raise ValueError(f"not a task validation/models covers: {unknown[0]} (CARMA's table names them)")
    chosen = [by_name[name] for name in names]
    if wide := [task for task in chosen if task.gpus > gpus]:
        raise ValueError(f"{wide[0].name} trains on {wide[0].gpus} GPUs, and this machine has {gpus}")
    if first and (wide := [task for task in chosen if task.gpus > 1]):
        raise ValueError(f"{wide[0].name} trains on {wide[0].gpus} GPUs from GPU 0: measure it with --gpu 0")
    return chosen


def measure_models(chosen: list[Any], steps: int, gpu: int, out: Path, gpu_name: str, device: Any) -> None:
    """Train each task's script on the GPU and write DIR/models.json (the truth `benchmarks/estimators_models.py
    --measured` reads) and its snapshots."""

    jobs = [("script", json.dumps(task.argv(sys.executable)), steps) for task in chosen]
    measured = measure_on_gpu(jobs, gpu, out / "models-snapshots.zip")
    done = [
        {"task": task.name, "held_bytes": m.pop("held"), "carma_a100_mib": task.mem_mib, **m}
        for task, m in zip(chosen, measured, strict=True)
        if m is not None
    ]
    if failed := [task.name for task, m in zip(chosen, measured, strict=True) if m is None]:
        print(f"not measured (their errors above): {', '.join(failed)}", file=sys.stderr)
    machine = machine_of(gpu_name)
    data = {"machine": machine, "device": device.name, "context_bytes": device.context_bytes, "tasks": done}
    (out / "models.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"{'task':30s} {'steps':>5s} {'held MiB':>9s} {'max reserved':>12s} {'CARMA A100-40GB':>15s}")
    for t in done:
        print(f"{t['task']:30s} {t['steps']:5d} {t['held_bytes'] / MIB:9.0f} {t['max_reserved'] / MIB:12.0f} "
              f"{t['carma_a100_mib']:15d}")  # fmt: skip
    print(f"estimate them (no GPU needed): python benchmarks/estimators_models.py --measured {out / 'models.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=24, help="GPUMemNet MLP runs, drawn at random (seeded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, help="the public datasets' folder (default: $CARMA_DATASETS, shared/)")
    parser.add_argument("--runs", type=Path, help="a file naming the GPUMemNet runs to measure, one per line")
    parser.add_argument("--skip-bert", action="store_true", help="leave out BERT-base fine-tuning")
    parser.add_argument("--gpu", type=int, default=0, help="the local GPU to measure on")
    parser.add_argument("--models", help="CARMA's tasks to measure instead (comma-separated, as its table names them)")
    parser.add_argument("--model-steps", type=int, default=MODEL_STEPS, help="optimizer steps each task trains")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "docs" / "validation",
        help="where estimates.json, estimates.md and the snapshots' zip go (default docs/validation; git ignores "
        "the zip)",
    )
    parser.add_argument("--hold", nargs=2, metavar=("KIND", "TARGET"), help=argparse.SUPPRESS)  # a measured job
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(*args.hold, args.steps, args.gpu, args.snapshot)
        return
    try:
        import torch
    except ImportError:
        sys.exit("error: validating the estimators needs PyTorch: pip install 'carma-gpu[estimate]'")
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here: this validation trains the jobs on a GPU; run it on the GPU machine")

    try:
        if args.models:
            covered = load_tasks().load(find_datasets(args.data, WORKLOADS) / WORKLOADS)
            chosen = choose_models(args.models.split(","), covered, torch.cuda.device_count(), args.gpu)
        else:
            with (find_datasets(args.data, GPUMEMNET_RUNS) / GPUMEMNET_RUNS).open(newline="") as f:
                rows = choose_runs(list(csv.DictReader(f)), args.runs, args.sample, args.seed)
    except (DataNotFound, OSError, ValueError) as e:
        sys.exit(f"error: {e}")

    os.environ["CARMA_HOME"] = tempfile.mkdtemp(prefix="carma-validate-")  # the user's calibration is untouched
    try:
        device, _ = calibrate(index=args.gpu)
    except EstimateError as e:
        sys.exit(f"error: calibrating GPU {args.gpu} failed: {e}")
    gpu_name = torch.cuda.get_device_name(args.gpu)
    print(f"{gpu_name}: context {device.context_bytes / MIB:.0f} MiB, calibrated as {device.name}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.models:
        measure_models(chosen, args.model_steps, args.gpu, args.out, gpu_name, device)
        return

    load_benchmarks()  # its folder on the path: gpumemnet_mlp
    from gpumemnet_mlp import SAMPLES

    jobs = [("mlp", row["Filename"], 2 * math.ceil(SAMPLES / int(row["Batch Size"]))) for row in rows]
    if not args.skip_bert:
        jobs.append(("job", BERT, BERT_STEPS))
    measured = measure_on_gpu(jobs, args.gpu, args.out / "estimates-snapshots.zip")
    estimate_measured(args.out, gpu_name, device, rows, measured, bert=not args.skip_bert)


def estimate_measured(
    out: Path, gpu_name: str, device: Any, rows: list[dict[str, str]], measured: list[dict[str, Any] | None],
    bert: bool,
) -> None:  # fmt: skip
    """Estimate on the CPU every job the GPU measured (`measured`: the MLP `rows`' measurements, then
    BERT's with `bert`; None where the GPU run failed) and write both files. The GPU's work is done by now:
    a capture that fails is that run's failure, not the end of them all."""
    estimators = load_benchmarks()
    done = [(row, m) for row, m in zip(rows, measured[: len(rows)], strict=True) if m is not None]  # MLPs
    outcomes = estimators.measure([row for row, _ in done], [m["held"] for _, m in done], device.name, 3, 2, False)
    names, held = [row["Filename"] for row, _ in done], [m for _, m in done]
    if bert and measured[-1] is not None:
        held_bytes = measured[-1]["held"]
        outcomes.append(estimators.estimate_in_child(["--estimate-job", BERT], held_bytes, device.name, 3, False))
        names.append("BERT-base fine-tuning (benchmarks/estimators.py:bert_job)")
        held.append(measured[-1])
    write(out, gpu_name, device, estimators, names, outcomes, held)


def write(
    out: Path, gpu_name: str, device: Any, estimators: ModuleType, names: list[str], outcomes: list[Any],
    measured: list[dict[str, Any]],
) -> None:  # fmt: skip
    """estimates.json (every figure) and estimates.md (the benchmark's table and each job's misses)."""

    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        stats = {m: estimators.figures(outcomes, m, device.context_bytes) for m in CPU_METHODS}
        estimators.report(stats)
        print()
        estimators.per_run(names, outcomes)
    print(table.getvalue())
    machine = machine_of(gpu_name)
    jobs = [
        {"job": name, "measured_bytes": o.measured, "estimates": o.estimates, **m}
        for name, o, m in zip(names, outcomes, measured, strict=True)
    ]
    figures = {  # JSON has no NaN: a figure with no rows is null
        method: {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in s.items()}
        for method, s in stats.items()
    }
    data = {"machine": machine, "context_bytes": device.context_bytes, "figures": figures, "jobs": jobs}
    (out / "estimates.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    lines = [
        "# Memory estimators on a real GPU",
        "",
        f"Measured by `validation/estimates.py` on {machine}; calibrated context "
        f"{device.context_bytes / MIB:.0f} MiB. Each job's truth is the GPU memory its process held after its "
        "steps (the allocator's snapshots are in estimates-snapshots.zip).",
        "",
        "```",
        table.getvalue().rstrip(),
        "```",
        "",
        "What each process held beside PyTorch's own peak (the rest is the CUDA context and memory outside the",
        "caching allocator, e.g. library workspaces):",
        "",
        "| job | steps | held MiB | max reserved MiB | held - context - reserved MiB |",
        "|---|---|---|---|---|",
        *(
            f"| {j['job'][:60]} | {j['steps']} | {j['held'] / MIB:.0f} | {j['max_reserved'] / MIB:.0f} | "
            f"{(j['held'] - device.context_bytes - j['max_reserved']) / MIB:+.0f} |"
            for j in jobs
        ),
        "",
    ]
    (out / "estimates.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
