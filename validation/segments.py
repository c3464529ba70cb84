"""Which segments xMem's replay misses: each GPUMemNet job's allocator segments on the GPU against the replay's.

    python validation/segments.py DIR

DIR holds what `validation/estimates.py` wrote on a GPU machine (estimates.json and estimates-snapshots.zip);
no GPU is needed here. For each MLP job it reads the segments the GPU process held at the end (the caching
allocator keeps the segments of its peak, so these are the peak's), captures the run on the CPU as
`carma estimate` does and replays it (xMem's simulated segments at its peak, before the fragmentation
allowance), and prints the segment sizes whose counts differ; for each size the GPU holds more of, the
code that opened those segments, from the allocator history in the snapshot. That is what the allowance
stands in for (docs/estimate.md, The fragmentation allowance).
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from estimates import load_benchmarks

MIB = 2**20


def gpu_segments(snapshot: dict[str, Any]) -> list[int]:
    """The sizes of the segments a `torch.cuda.memory._snapshot()` holds."""
    return sorted(segment["total_size"] for segment in snapshot["segments"])


def openers(snapshot: dict[str, Any], size: int) -> list[str]:
    """Where each segment of `size` bytes was reserved, from the snapshot's allocator history (oldest
    first): the innermost Python frame, and the innermost one outside PyTorch (the job's line) if another."""
    return [
        _where(entry["frames"])
        for trace in snapshot.get("device_traces", [])
        for entry in trace
        if entry["action"] == "segment_alloc" and entry["size"] == size
    ]


def _where(frames: list[dict[str, Any]]) -> str:
    """`frames` innermost first, as the snapshot records them."""
    if not frames:
        return "?"
    text = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames]
    job = next((i for i, f in enumerate(frames) if "/torch/" not in f["filename"]), 0)
    return text[0] if job == 0 else f"{text[0]} (from {text[job]})"


def differences(gpu: list[int], replay: list[int]) -> list[tuple[int, int, int]]:
    """(segment size, count on the GPU, count in the replay) for each size whose counts differ."""
    on_gpu, replayed = Counter(gpu), Counter(replay)
    sizes = sorted(on_gpu | replayed)
    return [(size, on_gpu[size], replayed[size]) for size in sizes if on_gpu[size] != replayed[size]]


def replayed_segments(run: str) -> list[int]:
    """xMem's segments at the replay's peak for a GPUMemNet run, captured in a child with CUDA hidden."""
    from carma.estimate.runner import capture_environment

    child = [sys.executable, __file__, "--replay", run]
    done = subprocess.run(child, env=capture_environment(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"error: capturing {run} on the CPU failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def replay_in_this_process(run: str) -> None:
    """The capture child: the run captured as benchmarks/estimators.py captures it, and replayed."""
    from carma.estimate.session import DEFAULT_STEPS
    from carma.estimate.xmem.estimator import run_xmem

    capture = load_benchmarks().capture_run(run, DEFAULT_STEPS)
    print(json.dumps(run_xmem(capture).simulation.segments_at_peak))


def report(run: str, snapshot: dict[str, Any], replay: list[int]) -> list[str]:
    gpu = gpu_segments(snapshot)
    lines = [
        run,
        f"  GPU {sum(gpu) / MIB:.0f} MiB in {len(gpu)} segments, replay {sum(replay) / MIB:.0f} MiB in {len(replay)}",
    ]
    for size, on_gpu, replayed in differences(gpu, replay):
        lines.append(f"  {size / MIB:g} MiB segments: GPU {on_gpu}, replay {replayed}")
        if on_gpu > replayed:
            lines += [f"    opened at {where}" for where in openers(snapshot, size)]
    if len(lines) == 2:
        lines.append("  the same segments")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, nargs="?", help="what validation/estimates.py wrote")
    parser.add_argument("--replay", help=argparse.SUPPRESS)  # the capture child
    args = parser.parse_args()
    if args.replay:
        replay_in_this_process(args.replay)
        return
    if args.dir is None:
        parser.error("DIR is required")
    from carma.estimate.gpumemnet import parse_run_name

    try:
        jobs = json.loads((args.dir / "estimates.json").read_text())["jobs"]
        archive = zipfile.ZipFile(args.dir / "estimates-snapshots.zip")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        sys.exit(f"error: {args.dir} does not hold validation/estimates.py's results: {e}")
    with archive:
        for job in jobs:
            try:
                parse_run_name(job["job"])
            except ValueError:
                continue  # BERT-base: no GPUMemNet run to replay
            snapshot = pickle.loads(archive.read(job["snapshot"]))  # written by estimates.py, our own file
            print("\n".join(report(job["job"], snapshot, replayed_segments(job["job"]))), flush=True)


if __name__ == "__main__":
    main()
