"""What fake GPUs cost the machine that tests on them: the CPU that N computing fake jobs take together.

Each fake job looks up its speed several times a wall second; the device's registry is one file per job,
so a look that reads every file makes N jobs cost N^2 file reads. No target is set; the figure to watch is
the CPU per job as N grows (flat is linear cost).

    python benchmarks/fake_gpu_bench.py [--jobs 10,40,120] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from carma.sim.gpus import parse_gpus
from carma.telemetry.fake import FakeDevice, fake_env
from options import machine_line, positive_float, positive_ints


def measure(jobs: int, seconds: float) -> float:
    """CPU seconds per wall second that `jobs` fake jobs computing on 8 fake GPUs take together."""
    with tempfile.TemporaryDirectory(prefix="carma-fake-bench-") as root:
        FakeDevice.create(root, parse_gpus("8xA100-80GB"), time_scale=1.0)
        env = {**os.environ, **fake_env(root)}
        procs = []
        uuids = [g.uuid for g in FakeDevice.open(root).gpus()]
        for i in range(jobs):
            gpu = uuids[i % len(uuids)]
            argv = [sys.executable, "-m", "carma.fakejob", "--mem", "512MiB", "--seconds", "3600", "--ttfk", "0",
                    "--warmup", "0", "--smact", "0.3"]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    argv, env={**env, "CUDA_VISIBLE_DEVICES": gpu}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        device = FakeDevice.open(root)
        while sum(load is not None for g in device.gpus() for _, _, load in device.processes(g.uuid)) < jobs:
            time.sleep(0.5)  # imports and start-up, which are not the figure
        before = {p.pid: _cpu(p.pid) for p in procs}
        start = time.monotonic()
        time.sleep(seconds)
        used = sum(_cpu(p.pid) - before[p.pid] for p in procs)
        elapsed = time.monotonic() - start
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    return used / elapsed


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=positive_ints, default="10,40,120", help="comma-separated numbers of fake jobs")
    parser.add_argument("--seconds", type=positive_float, default=5.0, help="wall seconds measured per count")
    args = parser.parse_args()
    print(machine_line())
    print(f"{'jobs':>6} {'cores busy':>11} {'ms CPU per job per s':>21}")
    for n in args.jobs:
        cores = measure(n, args.seconds)
        print(f"{n:>6} {cores:>11.2f} {cores / n * 1000:>21.1f}")


if __name__ == "__main__":
    main()
