"""How fast the twin simulates CARMA's trace 1: one configuration, the whole sweep, the CLI end to end, and
`carma twin validate`.

Targets (issue "decision core and digital twin"): one configuration under 1 s, the sweep under 15 s on a
2-core machine, simulated time over wall time above 30,000.

    python benchmarks/twin_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from carma.sim.experiment import PAPER_SWEEP, simulate, sweep
from carma.traces.catalog import load_catalog
from carma.traces.loaders import load_trace
from options import machine_line, positive_int


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per figure, the median kept (default 5)")
    args = parser.parse_args()
    print(machine_line())
    trace = load_trace("carma-t1", load_catalog())

    print(f"\none configuration on carma-t1 (median of {args.repeats}):")
    print(f"{'configuration':32s} {'wall s':>8s} {'simulated h':>12s} {'sim/wall':>10s}")
    walls, ratios = [], []
    for config in PAPER_SWEEP:
        wall, result = timed(lambda c=config: simulate(trace, c), args.repeats)
        simulated = result.metrics.makespan_s
        walls.append(wall)
        ratios.append(simulated / wall)
        print(f"{config.label:32s} {wall:8.3f} {simulated / 3600:12.2f} {simulated / wall:10,.0f}")
    print(f"slowest configuration: {max(walls):.3f} s (target < 1 s)")
    print(f"lowest simulated/wall ratio: {min(ratios):,.0f} (target > 30,000)")

    for jobs in (1, os.cpu_count() or 1):
        wall, _ = timed(lambda j=jobs: sweep(trace, jobs=j), max(1, args.repeats // 2))
        print(f"whole sweep ({len(PAPER_SWEEP)} configurations, {jobs} process(es)): {wall:.2f} s (target < 15 s)")

    carma = Path(sys.executable).parent / "carma"
    start = time.perf_counter()
    subprocess.run(
        [str(carma), "simulate", "--trace", "carma-t1", "--sweep", "--json"], check=True, capture_output=True
    )
    elapsed = time.perf_counter() - start
    print(f"`carma simulate --trace carma-t1 --sweep --json` end to end (process start included): {elapsed:.2f} s")

    with tempfile.TemporaryDirectory() as tmp:  # the report elsewhere: docs/fidelity.md stays as it is
        start = time.perf_counter()
        validated = subprocess.run(
            [str(carma), "twin", "validate", "--report", str(Path(tmp) / "fidelity.md")], capture_output=True, text=True
        )
        elapsed = time.perf_counter() - start
    if validated.returncode:  # the public datasets are not here, say
        print(f"`carma twin validate`: skipped ({(validated.stderr.strip().splitlines() or ['failed'])[-1]})")
    else:
        print(f"`carma twin validate` (fits, cross-validation, the sweep, the report): {elapsed:.2f} s")


if __name__ == "__main__":
    main()
