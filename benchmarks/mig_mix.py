"""MIGM's ML mix on one A100-40GB in the twin: dynamic MIG (schemes A and B) against the full GPU one job at a time
(Exclusive, MIGM's baseline) and carma's MPS collocation (MAGM), all with the catalog's exact memory needs.

The mix is MIGM's four models (VGG16, ResNet50, InceptionV3, BERT) from CARMA's workload catalog, `--copies` of
each, all submitted at once, interleaved; `small` takes the catalog's smallest batch of each (ResNet50, VGG16 and
InceptionV3 at 32, BERT-large at 8), `large` its largest (128; BERT-base at 32).

    python benchmarks/mig_mix.py [--mix small|large] [--copies 3] [--margin-mib 2048]
"""

from __future__ import annotations

import argparse

from carma.core.config import SchedulerConfig
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import parse_gpus
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, TraceEntry

MIXES = {
    "small": ("vgg", "resnet", "Inception", "BERT_large"),
    "large": ("vgg3", "resnet3", "Inception3", "BERT_base"),
}
RUNS = (
    RunConfig("magm", "oracle", mig="dynamic", scheme="a"),
    RunConfig("magm", "oracle", mig="dynamic", scheme="b"),
    RunConfig("exclusive", "oracle"),
    RunConfig("magm", "oracle"),
)


def mix_trace(mix: str, copies: int) -> Trace:
    catalog = load_catalog()
    names = MIXES[mix] * copies
    return Trace(f"MIGM ML mix ({mix}, {copies} of each)", tuple(TraceEntry(0.0, catalog[n]) for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", choices=sorted(MIXES), default="small")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--margin-mib", type=int, default=SchedulerConfig().margin_mib)
    args = parser.parse_args()
    trace = mix_trace(args.mix, args.copies)
    twin = TwinConfig(gpus=parse_gpus("1xA100-40GB"), scheduler=SchedulerConfig(margin_mib=args.margin_mib))
    results = [simulate(trace, run, twin) for run in RUNS]
    exclusive = next(r for r in results if r.config.policy == "exclusive").metrics
    print(f"{trace.name} on 1xA100-40GB, margin {args.margin_mib} MiB")
    print(
        "| configuration | throughput (tasks/h) | makespan (h) | energy (MJ) | mean JCT (h) | OOM | reconfigurations |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        m = r.metrics
        speedup = exclusive.makespan_s / m.makespan_s
        energy = m.energy_mj / exclusive.energy_mj
        throughput = m.tasks_completed / (m.makespan_s / 3600)
        print(
            f"| {r.config.label} | {throughput:.2f} ({speedup:.2f}x) | {m.makespan_s / 3600:.2f} | "
            f"{m.energy_mj:.2f} ({energy:.2f}x) | {(m.jct_mean_s or 0) / 3600:.2f} | {m.oom_crashes} | "
            f"{'-' if r.reconfigurations is None else r.reconfigurations} |"
        )


if __name__ == "__main__":
    main()
