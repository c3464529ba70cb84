"""CARMA's trace 1 on three MIG A100-40GB in the twin: dynamic MIG (schemes A and B, with and without the growth
prediction) against the best static MIG layout (MISO's baseline), the full GPUs one job at a time (Exclusive) and
carma's MPS collocation (MAGM), on the trace's one-GPU tasks.

A process sees one MIG instance at most, so a MIG GPU runs one-GPU tasks only: the trace's multi-GPU tasks (3 of
trace 1's 60: GPT-2 large and XLNet base and large on 2 GPUs) are left out of every run, Exclusive and MAGM
included, so that all run the same tasks. Keeping GPUs whole for them instead would be no MIG experiment: each
needs two whole GPUs of the three.

The best static layout is searched over every full layout on every GPU, and with one or two GPUs kept whole (one
7g instance) beside the same layout on the rest (`carma.sim.experiment.static_layouts`).

    python benchmarks/mig_trace.py [--trace carma-t1] [--gpus 3xA100-40GB] [--memory oracle|none] [--jobs 1]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from carma.sim.experiment import RunConfig, TwinConfig, best_static, simulate
from carma.sim.gpus import parse_gpus
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, load_trace
from carma.units import pluralize
from mig_mix import print_table, with_best_static


def one_gpu_tasks(trace: Trace) -> tuple[Trace, int]:
    """The trace without its multi-GPU tasks, and how many those were."""
    kept = tuple(e for e in trace.entries if e.workload.gpus == 1)
    return replace(trace, entries=kept), len(trace.entries) - len(kept)


def runs(memory: str) -> list[RunConfig]:
    dynamic = [
        RunConfig("magm", memory, mig="dynamic", scheme=scheme, predict=predict)
        for scheme in ("a", "b")
        for predict in (True, False)
    ]
    return [*dynamic, RunConfig("exclusive", memory), RunConfig("magm", memory)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="carma-t1", help="a built-in trace or a trace file")
    parser.add_argument("--gpus", default="3xA100-40GB", help="MIG GPUs of one model")
    parser.add_argument("--memory", choices=("oracle", "none"), default="oracle", help="needs known, or not")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the static layout search")
    args = parser.parse_args()
    trace, left_out = one_gpu_tasks(load_trace(args.trace, load_catalog()))
    twin = TwinConfig(gpus=parse_gpus(args.gpus))
    results = [simulate(trace, run, twin) for run in runs(args.memory)]
    baseline = next(r for r in results if r.config.policy == "exclusive")
    best = best_static(trace, twin, args.memory, jobs=args.jobs)
    print(
        f"trace {trace.name}: {pluralize(len(trace.entries), 'one-GPU task')} ({left_out} multi-GPU left out) "
        f"on {args.gpus}; against {baseline.config.label}"
    )
    print_table(with_best_static(results, *best), baseline)


if __name__ == "__main__":
    main()
