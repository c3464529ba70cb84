"""Validate carma on a real GPU: replay a mini-trace of PyTorch training tasks under several configurations.

    python validation/run.py                          # every configuration, results in docs/validation/
    python validation/run.py --configs magm-mps       # one (e.g. to stay within a time limit per command)
    python validation/run.py --dry-run                # the same on a fake H100 (carma.fakejob tasks; magm-mps
                                                      # only where nvidia-cuda-mps-control is on the PATH)

For each configuration it starts `carma server` (the NVML backend; fake GPUs with --dry-run) in a fresh
state directory, submits the mini-trace's tasks (validation/workloads.py) at their arrival times, waits
for all of them, and writes `<config>.json`: makespan, GPU energy (NVML's counter), completed and
failed tasks, OOM crashes, and per attempt the peak memory carma observed through NVML beside PyTorch's
own peak. `report.md` is rebuilt from every configuration's file found in the output directory.

Configurations: exclusive (one task per GPU), magm (collocation, memory unknown: recovery only), and
magm-mps (collocation as MPS clients; each task declares the peak the exclusive run observed, when that
run's file is there, so its MPS memory limit applies).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from carma.server.client import Client, ClientError, run_figures

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = HERE / "workloads.py"
CARMA = Path(sys.executable).with_name("carma")
MARKER = "carma-workload "


class RunError(Exception):
    """A configuration could not be run (e.g. no MPS here); the others still are."""


class ServerDidNotStart(RunError):
    """carma's server did not start (no NVML, say): the other configurations would start it alike."""


@dataclass(frozen=True)
class Config:
    policy: str
    mps: bool
    declare_memory: bool  # declare each task's peak observed by the exclusive run


CONFIGS = {
    "exclusive": Config("exclusive", mps=False, declare_memory=False),
    "magm": Config("magm", mps=False, declare_memory=False),
    "magm-mps": Config("magm", mps=True, declare_memory=True),
}


@dataclass(frozen=True)
class TraceTask:
    name: str
    arrival_s: float
    args: tuple[str, ...]
    steps: int
    fake: dict[str, Any]

    def command(self, dry_run: bool, steps_scale: float) -> list[str]:
        if dry_run:
            f = self.fake
            seconds = f"{f['seconds'] * steps_scale:g}"
            return [
                sys.executable, "-m", "carma.fakejob", "--mem", f["mem"], "--seconds", seconds,
                "--smact", f"{f['smact']:g}", "--smocc", f"{f['smocc']:g}", "--drama", f"{f['drama']:g}",
            ]  # fmt: skip
        steps = max(1, round(self.steps * steps_scale))
        return [sys.executable, str(WORKLOADS), *self.args, "--steps", str(steps)]


def load_trace(path: Path) -> list[TraceTask]:
    try:
        data = tomllib.loads(path.read_text())
        tasks = [
            TraceTask(t["name"], float(t["arrival_s"]), tuple(shlex.split(t["args"])), int(t["steps"]), t["fake"])
            for t in data["task"]
        ]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: cannot read the mini-trace {path}: {e}") from None
    return sorted(tasks, key=lambda t: t.arrival_s)


@contextlib.contextmanager
def carma_server(config: Config, args: argparse.Namespace, log_copy: Path) -> Iterator[Client]:
    """A carma server in a fresh state directory (short, for the unix socket), stopped and removed afterwards;
    its log is kept as `log_copy`."""
    home = Path(tempfile.mkdtemp(prefix="carma-val-", dir="/tmp"))
    settings = home / "carma.toml"
    settings.write_text(f"[scheduler]\nwindow_samples = {args.window}\n")
    options = ["--policy", config.policy, "--config", str(settings), *(["--mps"] if config.mps else [])]
    if args.dry_run:
        options += ["--fake-gpus", "1xH100-80GB", "--time-scale", f"{args.time_scale:g}"]
    log_path = home / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(CARMA), "server", "--home", str(home), *options], stdout=log, stderr=log)
    client = Client(home / "carma.sock")
    started = False
    try:
        _wait_for_server(client, proc, log_path)
        started = True
        yield client
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        if config.mps:
            subprocess.run([str(CARMA), "mps", "stop", "--home", str(home)], check=False, capture_output=True)
        if started:  # a server that never started said why in the error: no log left in the results
            shutil.copyfile(log_path, log_copy)
        shutil.rmtree(home, ignore_errors=True)


def _wait_for_server(client: Client, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ServerDidNotStart(f"carma server exited: {tail[0] if tail else proc.returncode}")
        with contextlib.suppress(ClientError):
            client.status()
            return
        time.sleep(0.2)
    raise ServerDidNotStart("carma server did not answer within 120 s")


def energy_j(client: Client) -> float | None:
    """The GPUs' energy counters summed, or None when a GPU has none (e.g. a MIG instance)."""
    readings = [g["energy_j"] for g in client.gpus()]
    return None if any(e is None for e in readings) else sum(readings)


def run_config(name: str, trace: list[TraceTask], args: argparse.Namespace, observed: dict[str, int]) -> dict:
    config = CONFIGS[name]
    scale = args.time_scale if args.dry_run else 1.0
    with carma_server(config, args, args.out / f"{name}.server.log") as client:
        status = client.status()
        gpus = client.gpus()
        energy_before = energy_j(client)
        ids = submit_all(client, trace, config, args, observed, scale)
        tasks = client.wait(ids, timeout_s=args.timeout)
        energy_after = energy_j(client)
        history = {(h["task_id"], h["attempt"]): h for h in client.history()}
        attempts = [_attempt_row(client, t, a, history) for t in tasks for a in t["attempt_list"]]
    energy = None if energy_before is None or energy_after is None else energy_after - energy_before
    return {
        "config": name,
        "policy": config.policy,
        "mps": config.mps,
        "declared_memory": config.declare_memory and bool(observed),
        **run_settings(args, trace),
        "time_unit": "simulated s" if args.dry_run else "s",
        "trace": str(args.trace),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "gpus": [g["name"] for g in gpus],
        "missing_metrics": status.get("missing_metrics", {}),
        **run_figures(tasks),
        "energy_kj": None if energy is None else round(energy / 1000, 2),
        "mean_jct_s": round(sum(t["ended_s"] - t["submit_s"] for t in tasks) / len(tasks), 1),
        "attempts": attempts,
    }


def submit_all(client, trace, config, args, observed, scale) -> list[int]:  # type: ignore[no-untyped-def]
    """Submit each task at its arrival time (scaled to wall time on fake GPUs)."""
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARMA_") and k != "CUDA_VISIBLE_DEVICES"}
    ids = []
    for task in trace:
        delay = start + task.arrival_s / scale - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        spec: dict[str, Any] = {
            "name": task.name,
            "command": task.command(args.dry_run, args.steps_scale),
            "workdir": str(HERE),
            "env": {**env, "HF_HUB_OFFLINE": "1"},
        }
        if config.declare_memory and task.name in observed:
            spec["mem"] = observed[task.name]
        ids.append(client.submit(spec)["id"])
        print(f"[{task.arrival_s:6.1f}] submitted {task.name} as task {ids[-1]}", file=sys.stderr, flush=True)
    return ids


def _attempt_row(client: Client, task: dict, attempt: dict, history: dict) -> dict[str, Any]:
    seen = history.get((task["id"], attempt["number"]), {})
    return {
        "task": task["name"],
        "attempt": attempt["number"],
        "outcome": attempt["outcome"],
        "exclusive": attempt["exclusive"],
        "gpus": attempt["gpus"],
        "declared_mib": task.get("mem_mib"),
        "wait_s": round(attempt["dispatched_s"] - task["submit_s"], 1),
        "exec_s": round(seen["exec_s"], 1) if seen else None,
        "observed_peak_mib": seen.get("peak_mib"),
        "smact_mean": seen.get("smact_mean"),
        "workload": _workload_line(client, task["id"], attempt["number"]),
    }


def _workload_line(client: Client, task_id: int, attempt: int) -> dict[str, Any] | None:
    """The JSON the workload printed last (throughput, PyTorch's peaks), if it got that far."""
    text, offset = "", 0
    while True:
        chunk = client.logs(task_id, "stdout", attempt, offset)
        text += chunk["text"]
        if chunk["done"] or not chunk["text"]:
            break
        offset = chunk["offset"]
    lines = [line for line in text.splitlines() if line.startswith(MARKER)]
    return json.loads(lines[-1][len(MARKER) :]) if lines else None


def observed_peaks(out: Path) -> dict[str, int]:
    """Each task's peak memory in the exclusive run (its completed attempt), if that run was recorded."""
    path = out / "exclusive.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["attempts"]
    return {r["task"]: r["observed_peak_mib"] for r in rows if r["outcome"] == "success" and r["observed_peak_mib"]}


def run_settings(args: argparse.Namespace, trace: list[TraceTask]) -> dict[str, Any]:
    """What makes two configurations' results comparable in one report: they were run alike on the same tasks
    (each result records it; `other_settings` compares)."""
    return {
        "dry_run": args.dry_run,
        "steps_scale": args.steps_scale,
        "window_samples": args.window,
        "tasks": [t.name for t in trace],
    }


def other_settings(out: Path, settings: dict[str, Any]) -> str | None:
    """How results already in `out` were run otherwise than `settings` (None: alike, or none there): a report
    put a 2-task run at steps scale 0.25 against a 4-task one at 1, and the exclusive run's peaks, read as
    the memory to declare, would come from other tasks."""
    for name in CONFIGS:
        path = out / f"{name}.json"
        if not path.exists():
            continue
        kept = json.loads(path.read_text())
        differ = [key for key in settings if kept.get(key) != settings[key]]
        if differ:
            return f"{path.name} ({', '.join(_difference(key, kept.get(key), settings[key]) for key in differ)})"
    return None


def _difference(key: str, there: Any, now: Any) -> str:
    if key == "tasks" and isinstance(there, list) and len(there) == len(now):
        return "other tasks"
    shown = [len(v) if isinstance(v, list) else "not recorded" if v is None else v for v in (there, now)]
    return f"{key} {shown[0]} there, {shown[1]} now"


def write_report(out: Path) -> Path:
    """report.md from every configuration's results in `out`."""
    results = [json.loads((out / f"{name}.json").read_text()) for name in CONFIGS if (out / f"{name}.json").exists()]
    base = next((r for r in results if r["config"] == "exclusive"), None)
    first = results[0]
    unit = first["time_unit"]
    lines = [
        "# carma on a real GPU: mini-trace validation" if not first["dry_run"] else "# Mini-trace validation (dry run)",
        "",
        f"GPUs: {', '.join(first['gpus'])} on `{first['host']}`; steps scale {first['steps_scale']:g}; "
        f"monitor window {first['window_samples']} samples. "
        f"Generated by `validation/run.py`{' --dry-run (fake GPUs, not a measurement)' if first['dry_run'] else ''}.",
        "",
        f"| configuration | date | makespan ({unit}) | vs exclusive | energy (kJ) | mean JCT ({unit}) | "
        "completed | failed | OOM crashes | collocated attempts | declared memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['makespan_s'] / base['makespan_s']:.2f}x" if base and base["makespan_s"] else "-"
        lines.append(
            f"| {r['config']} | {r['date'][:10]} | {r['makespan_s']:g} | {ratio} | {_num(r['energy_kj'])} | "
            f"{r['mean_jct_s']:g} | {r['completed']} | {r['failed']} | {r['oom_crashes']} | "
            f"{r['collocated_attempts']} | {'yes' if r['declared_memory'] else 'no'} |"
        )
    missing = {k: v for r in results for k, v in r["missing_metrics"].items()}
    if missing:
        lines += [
            "",
            "Metrics the GPUs did not report: " + "; ".join(f"GPU {k}: {', '.join(v)}" for k, v in missing.items()),
        ]
    lines += [
        "",
        "## Per attempt",
        "",
        "Observed peak: the most memory carma saw the task's processes hold on its GPU (NVML, sampled once a "
        "second); PyTorch reserved: `torch.cuda.max_memory_reserved()` in the task (without the CUDA context).",
        "",
        f"| configuration | task | attempt | outcome | shared GPU | wait ({unit}) | run ({unit}) | "
        "observed peak (MiB) | PyTorch reserved (MiB) | declared (MiB) | samples/s | mean SMACT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for a in r["attempts"]:
            w = a["workload"] or {}
            shared = "no" if a["exclusive"] else "yes"
            lines.append(
                f"| {r['config']} | {a['task']} | {a['attempt']} | {a['outcome']} | {shared} | "
                f"{a['wait_s']:g} | {_num(a['exec_s'])} | {_num(a['observed_peak_mib'])} | "
                f"{_num(w.get('torch_peak_reserved_mib'))} | {_num(a['declared_mib'])} | "
                f"{_num(w.get('samples_per_s'))} | {_num(a['smact_mean'], '.2f')} |"
            )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _num(value: float | None, fmt: str = "g") -> str:
    return "-" if value is None else format(value, fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", help=f"comma list of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--trace", type=Path, default=HERE / "minitrace.toml")
    parser.add_argument("--out", type=Path, help="results directory (default docs/validation, or a temporary one)")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every task's steps (or fake seconds)")
    parser.add_argument("--limit", type=int, help="only the first N tasks")
    parser.add_argument("--dry-run", action="store_true", help="fake GPUs and carma.fakejob tasks (no GPU needed)")
    parser.add_argument("--time-scale", type=float, default=20.0, help="with --dry-run: simulated s per wall s")
    parser.add_argument(
        "--window", type=int, default=10, help="monitor window in samples (default 10; CARMA's 30 suits longer tasks)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up on a configuration after S seconds")
    args = parser.parse_args(argv)
    for option, value in (("--limit", args.limit), ("--steps-scale", args.steps_scale)):
        if value is not None and not value > 0:
            parser.error(f"{option} must be a positive number, not {value:g}")
    names = [n.strip() for n in (args.configs or ",".join(CONFIGS)).split(",") if n.strip()]
    if args.dry_run and args.configs is None and shutil.which("nvidia-cuda-mps-control") is None:
        names = [n for n in names if not CONFIGS[n].mps]  # a machine without a GPU seldom has NVIDIA's MPS tools
        print("note: the dry run leaves out magm-mps: nvidia-cuda-mps-control is not on the PATH", file=sys.stderr)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="carma-dry-run-")) if args.dry_run else HERE.parent / "docs" / "validation"
        )
    out = args.out
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder")
    trace = load_trace(args.trace)[: args.limit]
    if other := other_settings(out, run_settings(args, trace)):
        parser.error(f"{out} holds results run otherwise: {other}; give another --out, or remove them")
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names:
        print(f"== {name}: {len(trace)} tasks", file=sys.stderr, flush=True)
        try:
            result = run_config(name, trace, args, observed_peaks(out))
        except ServerDidNotStart as e:
            print(f"error: {name}: {e}", file=sys.stderr, flush=True)
            failed.append(name)
            rest = [] if CONFIGS[name].mps else names[names.index(name) + 1 :]  # an MPS server's may be MPS's own
            if rest:
                print(f"note: not run, their server would fail alike: {', '.join(rest)}", file=sys.stderr)
                failed += rest
                break
            continue
        except (RunError, ClientError) as e:
            print(f"error: {name}: {e}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"{name}: makespan {result['makespan_s']:g} {result['time_unit']}, energy {_num(result['energy_kj'])} kJ, "
            f"{result['completed']} completed, {result['failed']} failed, {result['oom_crashes']} OOM crashes",
            flush=True,
        )
    if any((out / f"{name}.json").exists() for name in CONFIGS):
        print(f"report: {write_report(out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
