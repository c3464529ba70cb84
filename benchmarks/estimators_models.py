"""The memory estimators on real models: CARMA's own workload tasks against the peaks CARMA measured.

Each task of shared/datasets/carma/workloads.csv that `validation/models/tasks.py` covers (the CNNs, UNet,
the BERTs, and the two-GPU GPT-2 and XLNets; `mem_mib`: nvidia-smi's peak on an A100-40GB, context
included) is trained by its script in validation/models (random data of the task's shapes), captured once
on the CPU as `carma estimate --gpus N -- python SCRIPT ...` captures it (in a process of its own), and
estimated by every method for the device.

Printed: each task's measured MiB and each method's error; per method and family (CNN, transformer, all)
the median absolute error and the underestimates (counted, and those by more than 3%); then the issue's
checks. `--results FILE` keeps each task's outcome as a JSON line and skips the tasks already there, so
a long run can be resumed and its figures printed again (`--tasks` none left to run). `--measured FILE`
takes the truth from a GPU of ours instead (`validation/estimates.py --models` writes the file: each task's
peak as its process held it, and the device's calibrated context): only its tasks are estimated, for that
context (an outcome keeps each estimate above the context, so a results file serves both truths).

    python benchmarks/estimators_models.py [--tasks NAME,...] [--max-mib N] [--results FILE] [--measured FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from carma.calibration.sources import DataNotFound, find_datasets
from carma.estimate.base import EstimateError
from carma.estimate.devices import get_device
from carma.estimate.registry import CPU_METHODS
from carma.estimate.runner import capture_environment
from carma.estimate.script import capture_script
from carma.estimate.session import DEFAULT_STEPS
from estimators import every_method
from options import machine_line, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "validation" / "models"))
import tasks as carma_tasks  # validation/models, a folder of scripts

WORKLOADS = "carma/workloads.csv"
MIB = 2**20
UNDER_LIMIT = 0.03  # the issue's: no underestimate larger than 3% (an MPS memory limit that low is a crash)
FAMILIES = ("CNN", "transformer", "all")
WHOLE = ("gpumemnet",)  # estimates of the whole peak, which do not move with the context constant


def estimate_task(task: carma_tasks.Task, device: str, steps: int, data: Path) -> dict:
    """Capture and estimate one task in a process of its own: {"task", "family", "measured_mib", "above":
    {method: MiB above the device's context, or None}, "errors": {method: why}, "seconds"}. The part above
    the context is kept, so that the outcome holds for another context constant (`--stack`)."""
    started = time.perf_counter()
    child = [sys.executable, __file__, "--estimate-task", task.name, "--device", device, "--steps", str(steps)]
    child += ["--data", str(data)]
    done = subprocess.run(child, env=capture_environment(), capture_output=True, text=True)
    outcome = {"task": task.name, "family": task.family, "measured_mib": task.mem_mib, "above": {}, "errors": {}}
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        outcome["errors"] = dict.fromkeys(CPU_METHODS, why)
        outcome["above"] = dict.fromkeys(CPU_METHODS)
    else:
        result = json.loads(done.stdout.splitlines()[-1])
        for method, e in result["estimates"].items():
            outcome["above"][method] = None if "error" in e else (e["peak"] - e["context"]) / MIB
            outcome.setdefault("peak", {})[method] = None if "error" in e else e["peak"] / MIB
            if "error" in e:
                outcome["errors"][method] = e["error"]
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    return outcome


def measured_on_a_gpu(path: Path) -> tuple[dict[str, int], float, str]:
    """`validation/estimates.py --models`'s file: each task's measured MiB, the device's context (MiB) and the
    machine it was measured on. A file that is not one is a ValueError."""
    try:
        data = json.loads(path.read_text())
        held = {t["task"]: round(t["held_bytes"] / MIB) for t in data["tasks"]}
        return held, data["context_bytes"] / MIB, str(data["machine"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not validation/estimates.py --models's file ({type(e).__name__}: {e})") from None


def estimate_mib(outcome: dict, method: str, context_mib: float) -> float | None:
    """The method's estimate with the device's context; GPUMemNet's is a bin of the whole, context inside."""
    if method in WHOLE:
        return outcome.get("peak", {}).get(method)
    above = outcome["above"].get(method)
    return None if above is None else above + context_mib


def error(outcome: dict, method: str, context_mib: float) -> float | None:
    estimate = estimate_mib(outcome, method, context_mib)
    return None if estimate is None else (estimate - outcome["measured_mib"]) / outcome["measured_mib"]


def per_task(outcomes: list[dict], context_mib: float) -> None:
    print(f"{'task':30s} {'MiB':>6s} " + " ".join(f"{m:>12s}" for m in CPU_METHODS) + "  seconds")
    for o in outcomes:
        cells = []
        for method in CPU_METHODS:
            e = error(o, method, context_mib)
            cells.append(f"{'-':>12s}" if e is None else f"{estimate_mib(o, method, context_mib):6.0f} {e:+5.0%}")
        print(f"{o['task']:30s} {o['measured_mib']:6d} " + " ".join(cells) + f"  {o['seconds']:.0f}")


def figures(outcomes: list[dict], method: str, family: str, context_mib: float) -> dict[str, float | int] | None:
    chosen = [o for o in outcomes if family in ("all", o["family"])]
    errors = [e for o in chosen if (e := error(o, method, context_mib)) is not None]
    if not errors:
        return None
    return {
        "tasks": len(errors),
        "median": statistics.median(abs(e) for e in errors),
        "under": sum(e < 0 for e in errors),
        "under_limit": sum(e < -UNDER_LIMIT for e in errors),
        "worst_under": min(errors),
    }


def report(outcomes: list[dict], context_mib: float) -> None:
    per_task(outcomes, context_mib)
    print(f"\n{'estimator':11s} {'family':12s} {'tasks':>5s} {'median |error|':>15s} {'under':>6s} "
          f"{'under >3%':>10s} {'worst':>7s}")  # fmt: skip
    stats = {}
    for method in CPU_METHODS:
        for family in FAMILIES:
            s = figures(outcomes, method, family, context_mib)
            stats[method, family] = s
            if s:
                print(
                    f"{method:11s} {family:12s} {s['tasks']:5d} {s['median']:>15.1%} {s['under']:6d} "
                    f"{s['under_limit']:10d} {s['worst_under']:>+7.1%}"
                )
    x = stats["xmem", "all"]
    if not x:
        return
    others = [s for (m, f), s in stats.items() if m != "xmem" and f == "all" and s]
    checks = [
        ("xMem median absolute error <= 5%", x["median"] <= 0.05),
        ("xMem no underestimate larger than 3%", x["under_limit"] == 0),
        ("xMem better than every baseline on median error and underestimates", all(
            x["median"] < o["median"] and x["under"] <= o["under"] for o in others
        )),
    ]  # fmt: skip
    for claim, holds in checks:
        print(f"{'yes' if holds else 'NO '}  {claim}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100-40gb", help="The GPU the tasks were measured on.")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS)
    parser.add_argument("--tasks", help="Comma-separated task names (default: every covered task).")
    parser.add_argument("--max-mib", type=positive_int, help="Only tasks measured at most this many MiB.")
    parser.add_argument("--results", type=Path, help="JSON lines of outcomes: read, skipped, appended to.")
    parser.add_argument("--data", type=Path, help="The public datasets' folder (default: $CARMA_DATASETS, shared/).")
    parser.add_argument("--measured", type=Path, help="The truth measured on a GPU (validation/estimates.py --models).")
    parser.add_argument("--estimate-task", help=argparse.SUPPRESS)  # one task's capture, in its own process
    args = parser.parse_args()
    try:
        device = get_device(args.device)
        data = find_datasets(args.data, WORKLOADS)
        tasks = carma_tasks.load(data / WORKLOADS)
        measured = measured_on_a_gpu(args.measured) if args.measured else None
    except (EstimateError, DataNotFound, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    context_mib = device.context_bytes / MIB
    if args.estimate_task:
        task = next(t for t in tasks if t.name == args.estimate_task)
        capture = capture_script(task.argv(), steps=args.steps, gpus=task.gpus)
        results = {
            method: {"error": str(e)}
            if isinstance(e, EstimateError)
            else {"peak": e.peak_bytes, "context": e.breakdown.context}
            for method, e in every_method(capture, device.name).items()
        }
        print(json.dumps({"capture_seconds": capture.seconds, "estimates": results}))
        return
    if measured:
        held, context_mib, machine = measured
        if unknown := set(held) - {t.name for t in tasks}:
            sys.exit(f"error: {args.measured}: no covered task {', '.join(sorted(unknown))}")
        tasks = [replace(t, mem_mib=held[t.name]) for t in tasks if t.name in held]
    if args.tasks:
        wanted = [name.strip() for name in args.tasks.split(",")]
        if unknown := set(wanted) - {t.name for t in tasks}:
            among = f"measured in {args.measured}" if measured else "covered"
            sys.exit(f"error: no task {among}: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.name in wanted]
    if args.max_mib:
        tasks = [t for t in tasks if t.mem_mib <= args.max_mib]
    print(machine_line())
    truth = f"measured on {machine}" if measured else f"CARMA's measurements, device {device.name}"
    print(f"CARMA workload tasks: {len(tasks)}; {truth}, context {context_mib:.0f} MiB")
    done = []
    if args.results and args.results.exists():
        done = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    known = {o["task"] for o in done}
    for i, task in enumerate(t for t in tasks if t.name not in known):
        print(f"\r{i + 1} estimating {task.name}", end="", file=sys.stderr, flush=True)
        outcome = estimate_task(task, device.name, args.steps, data)
        done.append(outcome)
        if args.results:
            with args.results.open("a") as f:
                f.write(json.dumps(outcome) + "\n")
    print(file=sys.stderr)
    order = {t.name: (i, t.mem_mib) for i, t in enumerate(tasks)}
    chosen = [{**o, "measured_mib": order[o["task"]][1]} for o in done if o["task"] in order]
    report(sorted(chosen, key=lambda o: order[o["task"]][0]), context_mib)


if __name__ == "__main__":
    main()
