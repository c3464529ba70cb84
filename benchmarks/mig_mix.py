"""MIGM's ML mix on one A100-40GB in the twin: dynamic MIG (schemes A and B) against the best static MIG layout
(MISO's baseline: the best of every full layout, kept for the whole run), the full GPU one job at a time (Exclusive,
MIGM's baseline) and carma's MPS collocation (MAGM), all with the catalog's exact memory needs.

The mix is MIGM's four models (VGG16, ResNet50, InceptionV3, BERT) from CARMA's workload catalog, `--copies` of
each, all submitted at once, interleaved; `small` takes the catalog's smallest batch of each (ResNet50, VGG16 and
InceptionV3 at 32, BERT-large at 8), `large` its largest (128; BERT-base at 32).

`llm` is a mix whose memory grows: the small mix plus, per copy, two BERT-large-shaped jobs declared at 7.5 GB
that grow to MIGM's Qwen2-7B peak (12.23 GB) by their end, linearly in their progress; dynamic MIG with and
without the growth prediction, static MIG, and the whole GPU (Exclusive; MAGM with and without it).
`llm-shared` is growth where GPUs are shared: per copy three inference-like jobs (EfficientNet-B0's light load,
which lets three share a GPU past the risk filter) declared at 7.5 GB that grow to 16 GB (a longer context than
MIGM's example), and a MobileNet; MAGM with and without the prediction, declared needs and recovery only.

    python benchmarks/mig_mix.py [--mix small|large|llm|llm-shared] [--copies 3] [--margin-mib 2048]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from carma.core.config import SchedulerConfig
from carma.sim.experiment import RunConfig, RunResult, TwinConfig, best_static, simulate
from carma.sim.gpus import parse_gpus
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, TraceEntry

MIXES = {
    "small": ("vgg", "resnet", "Inception", "BERT_large"),
    "large": ("vgg3", "resnet3", "Inception3", "BERT_base"),
    "llm": ("vgg", "llm", "resnet", "Inception", "llm", "BERT_large"),
    "llm-shared": ("llm", "llm", "llm", "mobilenet"),
}
# MiB at the end of a growing job's run (MIGM: Qwen2-7B peaks at 12.23 GB)
GROWING = {"llm": {"llm": 12230}, "llm-shared": {"llm": 16000}}
LOOKS_LIKE = {"llm-shared": "efficientNet"}  # the catalog job whose load a growing job has (else BERT-large's)
RUNS = (
    RunConfig("magm", "oracle", mig="dynamic", scheme="a"),
    RunConfig("magm", "oracle", mig="dynamic", scheme="b"),
    RunConfig("exclusive", "oracle"),
    RunConfig("magm", "oracle"),
)
WHOLE_GPU_GROWTH_RUNS = (
    RunConfig("exclusive", "oracle"),
    RunConfig("magm", "oracle"),
    RunConfig("magm", "oracle", predict=False),
)
GROWTH_RUNS = {
    "llm": tuple(
        RunConfig("magm", "oracle", mig="dynamic", scheme=scheme, predict=predict)
        for scheme in ("a", "b")
        for predict in (True, False)
    )
    + WHOLE_GPU_GROWTH_RUNS,
    "llm-shared": (*WHOLE_GPU_GROWTH_RUNS, RunConfig("magm", "none"), RunConfig("magm", "none", predict=False)),
}


def mix_trace(mix: str, copies: int) -> Trace:
    catalog = dict(load_catalog())
    like = catalog[LOOKS_LIKE.get(mix, "BERT_large")]
    catalog["llm"] = replace(like, name="llm", mem_mib=7500, mem_first_mib=min(like.mem_first_mib, 7500))
    names = MIXES[mix] * copies
    return Trace(f"MIGM ML mix ({mix}, {copies} copies)", tuple(TraceEntry(0.0, catalog[n]) for n in names))


def with_best_static(results: list[RunResult], best: RunResult, tried: int) -> list[tuple[str, RunResult]]:
    """The runs by their labels, the best static layout's (with how many layouts it beat) after the dynamic ones."""
    rows = [(r.config.label, r) for r in results]
    rows.insert(sum(r.config.mig == "dynamic" for r in results), (f"{best.config.label}, best of {tried}", best))
    return rows


def print_table(rows: Sequence[tuple[str, RunResult]], baseline: RunResult) -> None:
    """The runs as a Markdown table, throughput and energy also against `baseline`."""
    print(
        "| configuration | throughput (tasks/h) | makespan (h) | energy (MJ) | mean JCT (h) | OOM | early restarts |",
        end="",
    )
    print(" reconfigurations |\n|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        m, row = r.metrics, r.row()
        speedup = baseline.metrics.makespan_s / m.makespan_s
        energy = m.energy_mj / baseline.metrics.energy_mj
        throughput = m.tasks_completed / (m.makespan_s / 3600)
        print(
            f"| {label} | {throughput:.2f} ({speedup:.2f}x) | {m.makespan_s / 3600:.2f} | "
            f"{m.energy_mj:.2f} ({energy:.2f}x) | {(m.jct_mean_s or 0) / 3600:.2f} | {row['oom_crashes']} | "
            f"{r.early_restarts} | {row.get('reconfigurations', '-')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", choices=sorted(MIXES), default="small")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--margin-mib", type=int, default=SchedulerConfig().margin_mib)
    args = parser.parse_args()
    trace = mix_trace(args.mix, args.copies)
    twin = TwinConfig(gpus=parse_gpus("1xA100-40GB"), scheduler=SchedulerConfig(margin_mib=args.margin_mib))
    growing = GROWING.get(args.mix, {})
    results = [simulate(trace, run, twin, growing) for run in GROWTH_RUNS.get(args.mix, RUNS)]
    baseline = next((r for r in results if r.config.policy == "exclusive"), results[0])
    print(f"{trace.name} on 1xA100-40GB, margin {args.margin_mib} MiB; against {baseline.config.label}")
    rows = [(r.config.label, r) for r in results]
    if any(r.config.mig == "dynamic" for r in results):
        rows = with_best_static(results, *best_static(trace, twin, growing=growing))
    print_table(rows, baseline)


if __name__ == "__main__":
    main()
