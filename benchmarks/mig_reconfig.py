"""Dynamic MIG's sensitivity to the reconfiguration time, which no public measurement bounds: schemes A and B on
MIGM's small and large mixes (one A100-40GB) and on trace 1's one-GPU tasks (three A100-40GB, needs known and not),
each with a step (one instance created or destroyed) of 0.1 s to 5 s (`RECONFIGURATION_RANGE_S`, the plausible
range) and 30 s (a pessimistic point outside it), against the twin's default of 1 s.

    python benchmarks/mig_reconfig.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

from carma.sim.experiment import RunConfig, RunResult, TwinConfig, simulate
from carma.sim.gpus import parse_gpus
from carma.sim.migspeed import RECONFIGURATION_RANGE_S, RECONFIGURATION_S
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, load_trace
from mig_mix import mix_trace
from mig_trace import one_gpu_tasks

LOW_S, HIGH_S = RECONFIGURATION_RANGE_S
PESSIMISTIC_S = 30.0  # outside the range: a driver call as slow as a task's own start-up
STEPS_S = (LOW_S, 0.5, RECONFIGURATION_S, 2.0, HIGH_S, PESSIMISTIC_S)


def workloads() -> list[tuple[str, Trace, str, str]]:
    """(label, trace, GPUs, memory) of each workload swept."""
    trace1, _ = one_gpu_tasks(load_trace("carma-t1", load_catalog()))
    return [
        ("small mix", mix_trace("small", 3), "1xA100-40GB", "oracle"),
        ("large mix", mix_trace("large", 3), "1xA100-40GB", "oracle"),
        ("trace 1, needs known", trace1, "3xA100-40GB", "oracle"),
        ("trace 1, needs not known", trace1, "3xA100-40GB", "none"),
    ]


def print_pivot(
    title: str, rows: list[tuple[str, list[RunResult]]], value: Callable[[RunResult], float], relative: bool = True
) -> None:
    """One row per workload and scheme, one column per step time: `value` of each run and, if `relative`, its change
    against the default step's run."""
    steps = " | ".join(f"{s:g} s" + (" (outside)" if s > HIGH_S else "") for s in STEPS_S)
    print(f"\n{title}\n\n| run | {steps} |\n|---|{'---|' * len(STEPS_S)}")
    for label, runs in rows:
        values = [value(r) for r in runs]
        default = values[STEPS_S.index(RECONFIGURATION_S)]
        change = [f" ({round((v / default - 1) * 100, 1) + 0.0:+.1f}%)" if relative else "" for v in values]
        cells = " | ".join(f"{v:.{2 if relative else 0}f}{c}" for v, c in zip(values, change, strict=True))
        print(f"| {label} | {cells} |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help says what it measures
    rows = []
    for label, trace, gpus, memory in workloads():
        twin = TwinConfig(gpus=parse_gpus(gpus))
        for scheme in ("a", "b"):
            run = RunConfig("magm", memory, mig="dynamic", scheme=scheme)
            runs = [simulate(trace, run, replace(twin, reconfiguration_s=s)) for s in STEPS_S]
            rows.append((f"{label}, scheme {scheme.upper()}", runs))
    failed = sum(r.metrics.tasks_failed for _, runs in rows for r in runs)
    print(
        f"Dynamic MIG by reconfiguration time per step (default {RECONFIGURATION_S:g} s); "
        f"{failed} task{'' if failed == 1 else 's'} failed in all runs, so throughput is the tasks over the makespan"
    )
    print_pivot("makespan (h), against the default step", rows, lambda r: r.metrics.makespan_s / 3600)
    print_pivot("energy (MJ), against the default step", rows, lambda r: r.metrics.energy_mj)
    print_pivot("reconfigurations", rows, lambda r: r.reconfigurations or 0, relative=False)


if __name__ == "__main__":
    main()
