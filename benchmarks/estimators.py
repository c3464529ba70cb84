"""The memory estimators against real GPU measurements: the GPUMemNet MLP runs, and the time of a BERT-base estimate.

Each run of shared/datasets/gpumemnet/mlp_training_runs.csv is trained as it was measured, by
`gpumemnet_mlp.py` (the GPUMemNet generator rebuilds the MLP from the run's encoded name; a 4,096-sample
host dataset, shuffled batches moved to the device, Adam, cross-entropy), captured once on the CPU as
`carma estimate -- python gpumemnet_mlp.py RUN` captures it (in a process of its own) and estimated by
every method for one device. The measured peak, `Max GPU Memory (MiB)` (nvidia-smi, context included),
is the truth.

Figures per estimator, on the rows it could estimate:
- MRE total: median of |estimate - measured| / measured;
- MRE above baseline: the same for the parts above the empty-process baseline, on the rows whose measured
  part is at least 256 MiB. The baseline is the device's context constant (`carma.estimate.devices`; for
  a100-40gb it comes from these runs' smallest models), so this isolates what the job itself adds;
- underestimates: share of rows estimated below the measured peak (each an OOM if the estimate were a cap),
  and (under >1%) those below it by more than 1% (nvidia-smi reads whole MiB, sampled once a second);
- mean overestimate: mean of (estimate - measured) / measured over the rows it overestimates;
- s/estimate: mean seconds per estimate, the CPU capture included (it runs the script's first steps under
  the profiler, whatever the method; the interpreter's start and imports are not counted); own s: the
  method's own part (Horus, FakeTensor and GPUMemNet need only the model, batch and optimizer, not the
  profiled steps).
GPUMemNet is a classifier trained on these very runs: its shipped weights saw 80% of them, and on those it
recalls the bin it learnt (it misses none of them; its only misses are among the 20% held out). So it is
judged as a learnt estimator is, by cross-validation: `gpumemnet-cv` estimates each run with the recipe's
weights trained on the four fifths of a stratified 5-fold split that do not hold it
(`carma.estimate.gpumemnet_training`, seed 0), and the check against the baselines takes that row; the
shipped weights' row (`gpumemnet`) is printed beside it, in-sample on most runs.

Then one BERT-base estimate (BertConfig() defaults, batch 32 x 128 tokens, AdamW) is timed per method,
for fine-tuning (sequence classification, GLUE's setting; target: at most 20 s for xMem, the capture
included) and for the masked-LM head of pre-training (whose 500 MB of logits make it slower).

    python benchmarks/estimators.py [--sample N | --all] [--seed 0] [--device a100-40gb] [--jobs 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from carma.calibration.sources import GPUMEMNET_RUNS, DataNotFound, find_datasets
from carma.estimate.base import Capture, Estimate, EstimateError, TrainingJob
from carma.estimate.devices import get_device
from carma.estimate.gpumemnet import classifier_from_json, parse_run_name, shipped_classifier
from carma.estimate.job import capture_job
from carma.estimate.registry import CPU_METHODS, estimate_captured
from carma.estimate.runner import capture_environment
from carma.estimate.script import capture_script
from carma.estimate.session import DEFAULT_STEPS
from gpumemnet_mlp import build_mlp
from options import machine_line, positive_int

MIB = 2**20
ABOVE_MIN_MIB = 256
JOBS = Path(__file__).stem  # this file as a module: its folder is on sys.path when it runs as a script
TRAIN = Path(__file__).with_name("gpumemnet_mlp.py")
HELD_OUT = "gpumemnet-cv"  # GPUMemNet by weights that never saw the run (see above)
FOLDS = 5


def bert_job() -> TrainingJob:
    """BERT-base fine-tuning as GLUE runs it: sequence classification, batch 32 x 128 tokens, AdamW."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig()
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (32, 128)), "labels": torch.randint(0, 2, (32,))}
    loss = lambda m, b: m(**b).loss  # noqa: E731
    return TrainingJob(model, batch, loss, torch.optim.AdamW(model.parameters(), lr=2e-5))


def bert_mlm_job() -> TrainingJob:
    """BERT-base pre-training's masked-LM head: the same encoder plus 32 x 128 x 30,522 logits."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig()
    model = BertForMaskedLM(config)
    ids = torch.randint(0, config.vocab_size, (32, 128))
    loss = lambda m, b: m(**b).loss  # noqa: E731
    return TrainingJob(model, {"input_ids": ids, "labels": ids}, loss, torch.optim.AdamW(model.parameters(), lr=1e-4))


@dataclass
class Outcome:
    measured: int  # bytes
    estimates: dict[str, int | None]  # None: the method failed on this run
    seconds: dict[str, float]  # whole estimate, capture included
    capture_seconds: float


def measure(
    rows: list[dict[str, str]],
    measured: list[int],
    device: str,
    steps: int,
    jobs: int,
    strict: bool = True,
    held_out: dict[str, Path] | None = None,
) -> list[Outcome]:
    """Estimate each run with every method (one capture per run, in a process of its own, `jobs` of them
    at a time) beside its measured peak (bytes, context included); outcomes in the rows' order. A failed
    run stops the benchmark when its turn comes (`map` cancels the runs not started); not `strict` (a GPU
    validation, whose measurements are already taken), it counts as failed by every method. `held_out`
    names each run's GPUMemNet weights trained without it, for the `gpumemnet-cv` estimate."""

    def estimate(row: dict[str, str], truth: int) -> Outcome:
        run = parse_run_name(row["Filename"])
        counted = (m for m in build_mlp(run).modules() if isinstance(m, nn.Linear | nn.BatchNorm1d))  # as the CSV
        assert sum(p.numel() for m in counted for p in m.parameters()) == int(row["Total Parameters"]), row
        weights = held_out[row["Filename"]] if held_out else None
        return estimate_in_child(["--estimate-run", row["Filename"]], truth, device, steps, strict, weights)

    outcomes = []
    with ThreadPoolExecutor(jobs) as pool:  # threads only build the model to check it and wait on the child
        for i, outcome in enumerate(pool.map(estimate, rows, measured), 1):
            outcomes.append(outcome)
            print(f"\r{i}/{len(rows)} runs estimated", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return outcomes


def estimate_in_child(
    what: list[str], truth: int, device: str, steps: int, strict: bool = True, held_out: Path | None = None
) -> Outcome:
    """Capture and estimate with every method in a process of its own, as `carma estimate` runs a capture
    (stderr holds the profiler's warnings); `what` is ["--estimate-run", NAME] or ["--estimate-job", TARGET].
    A capture that fails stops the benchmark, or (not `strict`) is every method's failure on that run.
    `held_out`: GPUMemNet weights that never saw the run, also estimated with (as `gpumemnet-cv`)."""
    child = [sys.executable, __file__, *what, "--device", device, "--steps", str(steps)]
    child += ["--gpumemnet-weights", str(held_out)] if held_out else []
    done = subprocess.run(child, env=capture_environment(), capture_output=True, text=True)
    if done.returncode and strict:
        sys.exit(f"estimating {what[1]} failed:\n{done.stderr}")
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"  estimating {what[1]} failed: {why}", file=sys.stderr)
        return Outcome(truth, dict.fromkeys(CPU_METHODS), {}, 0.0)
    result = json.loads(done.stdout.splitlines()[-1])
    outcome = Outcome(truth, {}, {}, result["capture_seconds"])
    for method, (peak, seconds) in result["estimates"].items():
        outcome.estimates[method] = peak
        if peak is None:
            print(f"  {method} failed on {what[1]}: {seconds}", file=sys.stderr)
        else:
            outcome.seconds[method] = seconds
    return outcome


def capture_run(name: str, steps: int) -> Capture:
    """Capture a GPUMemNet run in this process as `carma estimate -- python gpumemnet_mlp.py NAME` does."""
    return capture_script([sys.executable, str(TRAIN), name, "--seconds", "3600"], steps=steps)


def print_estimates(capture: Capture, device: str, held_out: Path | None) -> None:
    """For the process that captured a job (as `carma estimate` does, in a process of its own): print
    `{"capture_seconds", "estimates": {method: [peak bytes, seconds] or [null, error]}}`, with `gpumemnet-cv`
    by the `held_out` weights when given."""
    results = every_method(capture, device)
    if held_out:
        results[HELD_OUT] = held_out_gpumemnet(capture, device, held_out)
    estimates = {
        method: (None, str(e)) if isinstance(e, EstimateError) else (e.peak_bytes, e.seconds)
        for method, e in results.items()
    }
    print(json.dumps({"capture_seconds": capture.seconds, "estimates": estimates}))


def every_method(capture: Capture, device: str) -> dict[str, Estimate | EstimateError]:
    """Each CPU method's estimate of the captured job, or why it failed."""
    results: dict[str, Estimate | EstimateError] = {}
    for method in CPU_METHODS:
        try:
            results[method] = estimate_captured(method, capture, device)
        except EstimateError as e:
            results[method] = e
    return results


def held_out_gpumemnet(capture: Capture, device: str, weights: Path) -> Estimate | EstimateError:
    """GPUMemNet's estimate by weights trained without this run."""
    try:
        classifier = classifier_from_json(json.loads(weights.read_text()))
        return estimate_captured("gpumemnet", capture, device, classifier=classifier)
    except EstimateError as e:
        return e


def held_out_weights(runs_csv: Path, folder: Path) -> dict[str, Path]:
    """Each run's GPUMemNet weights trained without it: the shipped recipe on a stratified 5-fold split of every
    run in `runs_csv`, one weights file per fold in `folder`."""
    from carma.estimate.gpumemnet_training import folds, load_runs  # scikit-learn: seconds, the parent's alone

    runs = load_runs(runs_csv, shipped_classifier().bin_mib)
    weights = {}
    for i, split in enumerate(folds(runs, FOLDS, 0, "the benchmark's GPUMemNet runs")):
        (folder / f"fold-{i}.json").write_text(json.dumps(split.weights))
        weights |= {runs.names[j]: folder / f"fold-{i}.json" for j in split.held_out}
    return weights


def figures(outcomes: list[Outcome], method: str, baseline: int) -> dict[str, float | int]:
    done = [(o.estimates[method], o.measured, o.seconds[method]) for o in outcomes if o.estimates.get(method)]
    captures = [o.capture_seconds for o in outcomes if o.estimates.get(method)]
    above = [(e - baseline, m - baseline) for e, m, _ in done if m - baseline >= ABOVE_MIN_MIB * MIB]
    over = [(e - m) / m for e, m, _ in done if e > m]
    return {
        "runs": len(done),
        "mre": statistics.median(abs(e - m) / m for e, m, _ in done),
        "mre_above": statistics.median(abs(e - m) / m for e, m in above) if above else float("nan"),
        "above_runs": len(above),
        "under": sum(e < m for e, m, _ in done) / len(done),
        "under_1pct": sum(e < 0.99 * m for e, m, _ in done) / len(done),
        "over": statistics.mean(over) if over else float("nan"),  # never overestimates: printed as "-"
        "seconds": statistics.mean(s for _, _, s in done),
        "own": statistics.mean(s for _, _, s in done) - statistics.mean(captures),
    }


def per_run(names: list[str], outcomes: list[Outcome]) -> None:
    print("measured MiB, then each estimate less the measured peak (MiB), and the run")
    for name, o in zip(names, outcomes, strict=True):
        misses = "  ".join(
            f"{m} {'-' if e is None else f'{(e - o.measured) / MIB:+.0f}'}" for m, e in o.estimates.items()
        )
        print(f"{o.measured / MIB:6.0f}  {misses}  {name}")


def pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"


def report(stats: dict[str, dict[str, float | int]]) -> None:
    """The table, the error of the total to four decimals (over all 2,000 runs xMem and FakeTensor part only in
    the fourth), then the issue's checks."""
    print(f"{'estimator':12s} {'runs':>5s} {'MRE total':>10s} {'MRE above baseline':>19s} {'(runs)':>6s} "
          f"{'underestimates':>15s} {'under >1%':>10s} {'mean overestimate':>18s} "
          f"{'s/estimate':>11s} {'own s':>6s}")  # fmt: skip
    for method, s in stats.items():
        print(
            f"{method:12s} {s['runs']:5d} {s['mre']:>10.4%} {pct(s['mre_above']):>19s} {s['above_runs']:6d} "
            f"{pct(s['under']):>15s} {pct(s['under_1pct']):>10s} {pct(s['over']):>18s} "
            f"{s['seconds']:11.2f} {s['own']:6.2f}"
        )
    in_sample = "gpumemnet" if HELD_OUT in stats else None  # judged by its cross-validated row instead
    x, others = stats["xmem"], [s for m, s in stats.items() if m not in ("xmem", in_sample)]
    above = bool(x["above_runs"])  # without such runs the checks on that part have nothing to judge: n/a
    checks = [
        ("xMem MRE of the total <= 3%", x["mre"] <= 0.03),
        ("xMem MRE above the baseline <= 10%", x["mre_above"] <= 0.10 if above else None),
        ("xMem underestimates <= 5% of runs", x["under"] <= 0.05),
        ("xMem better than every baseline on each", all(
            x["mre"] < o["mre"] and (not above or x["mre_above"] < o["mre_above"]) and x["under"] <= o["under"]
            for o in others
        )),
    ]  # fmt: skip
    for claim, holds in checks:
        print(f"{'n/a' if holds is None else 'yes' if holds else 'NO '}  {claim}")
    if in_sample:
        print(f"(GPUMemNet judged by {HELD_OUT}: its shipped weights were trained on most of these runs)")
    if not above:
        print(f"(no run is {ABOVE_MIN_MIB} MiB above the baseline: the part above it is judged on none, and left out)")


def time_bert(device: str, steps: int) -> None:
    jobs = (
        ("bert_job", "fine-tuning (BertForSequenceClassification)", " (target: at most 20 s)"),
        ("bert_mlm_job", "masked LM (BertForMaskedLM)", ""),
    )
    for function, title, target in jobs:
        print(f"\nBERT-base {title}, BertConfig() defaults, batch 32 x 128 tokens, AdamW; one estimate each:")
        capture = capture_job(f"{JOBS}:{function}", steps=steps)
        print(f"capture ({steps} profiled steps on the CPU): {capture.seconds:.1f} s")
        for method, estimate in every_method(capture, device).items():
            if isinstance(estimate, EstimateError):
                print(f"{method:11s} failed: {estimate}")
                continue
            own, peak = estimate.seconds - capture.seconds, estimate.peak_bytes / 2**30
            mark = target if method == "xmem" else ""
            print(f"{method:11s} {estimate.seconds:6.1f} s{mark} ({own:.1f} s its own), peak {peak:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=positive_int, default=40, help="Runs to estimate, drawn at random (seeded).")
    parser.add_argument(
        "--all", action="store_true", help="Every run (2,000: 85 minutes with --jobs 2 on a 2-core machine)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="a100-40gb@cuda11-torch2-eager",
        help="The GPU the runs were measured on, and their software stack (see carma.estimate.devices).",
    )
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS)
    parser.add_argument("--skip-bert", action="store_true", help="Leave out the BERT-base timing.")
    parser.add_argument("--per-run", action="store_true", help="Also print each run's measured peak and estimates.")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="Captures run at once (faster for --all; seconds per estimate then include contention).",
    )
    parser.add_argument("--data", type=Path, help="The public datasets' folder (default: $CARMA_DATASETS, shared/).")
    parser.add_argument("--bert-only", action="store_true", help=argparse.SUPPRESS)  # the timing's own process
    parser.add_argument("--estimate-run", help=argparse.SUPPRESS)  # one run's capture, in its own process
    parser.add_argument("--estimate-job", help=argparse.SUPPRESS)  # the same for a job function
    parser.add_argument("--gpumemnet-weights", type=Path, help=argparse.SUPPRESS)  # its gpumemnet-cv weights
    args = parser.parse_args()
    if args.estimate_run:
        print_estimates(capture_run(args.estimate_run, args.steps), args.device, args.gpumemnet_weights)
        return
    if args.estimate_job:
        print_estimates(capture_job(args.estimate_job, steps=args.steps), args.device, args.gpumemnet_weights)
        return
    if args.bert_only:
        time_bert(args.device, args.steps)
        return
    print(machine_line(f"torch {torch.__version__}"))

    try:
        device = get_device(args.device)
        runs_csv = find_datasets(args.data, GPUMEMNET_RUNS) / GPUMEMNET_RUNS
        with runs_csv.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (EstimateError, DataNotFound, OSError) as e:
        sys.exit(f"error: {e}")
    if not args.all:
        rows = random.Random(args.seed).sample(rows, min(args.sample, len(rows)))
    print(
        f"GPUMemNet MLP runs: {len(rows)} (seed {args.seed}{', all' if args.all else ''}); device {device.name}, "
        f"baseline = its context constant, {device.context_bytes / MIB:.0f} MiB; {args.jobs} capture(s) at a time"
    )
    measured = [int(row["Max GPU Memory (MiB)"]) * MIB for row in rows]
    with tempfile.TemporaryDirectory(prefix="carma-gpumemnet-folds-") as folder:
        held_out = held_out_weights(runs_csv, Path(folder))
        outcomes = measure(rows, measured, device.name, args.steps, args.jobs, held_out=held_out)
    if args.per_run:
        per_run([row["Filename"] for row in rows], outcomes)
    report({method: figures(outcomes, method, device.context_bytes) for method in (*CPU_METHODS, HELD_OUT)})
    if not args.skip_bert:  # in a process of its own, as a `carma estimate` would be: its captures peak at ~6 GB
        sys.stdout.flush()
        bert = [sys.executable, __file__, "--bert-only", "--device", device.name, "--steps", str(args.steps)]
        subprocess.run(bert, check=True, env=capture_environment())  # as `carma estimate` runs a capture


if __name__ == "__main__":
    main()
