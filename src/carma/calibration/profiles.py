"""Per-task twin profiles for CARMA's workload table, each value with its source.

Busy time on the A100 (GRACT) comes from the GPU time a sample takes and how many samples CARMA's run
processed per second:

    GRACT = min(1, CARMA throughput * (Lucid analogue's GRACT / its throughput) * FLOPs ratio / A100 speed-up)

Lucid measured its analogues on a V100-class GPU with synthetic data (GPU-bound), so GRACT / throughput
is the V100's GPU time per sample; the FLOPs ratio carries it to CARMA's model and the A100/V100 speed-up
to CARMA's GPU. A job CARMA ran at the GPU's pace comes out near 1; a job held back by its input
pipeline comes out lower. Transformers (no input pipeline) keep their analogue's busy time. SMACT and
SMOCC follow from GRACT by the GPUMemNet relation; DRAMA keeps the analogue's memory-busy share of its
busy time. Time to first kernel and the memory at first sighting follow documented rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from carma.calibration.sources import LucidJob
from carma.calibration.utilization import UtilizationRelation

FIELDS = (
    "task",
    "gract",
    "smact",
    "smocc",
    "drama",
    "ttfk_s",
    "warmup_s",
    "mem_first_mib",
    "utilization_source",
    "ttfk_source",
    "memory_source",
)


def nearest_job(
    singles: Mapping[tuple[str, str, int, bool], LucidJob], model: str, dataset: str, batch: int
) -> LucidJob:
    """Lucid's FP32 profile of `model` on `dataset` at the batch size nearest to `batch`."""
    options = [job for (m, d, _, amp), job in singles.items() if (m, d) == (model, dataset) and not amp]
    if not options:
        raise ValueError(f"Lucid has no FP32 profile of {model} on {dataset}")
    return min(options, key=lambda job: (abs(job.batch - batch), job.batch))


def drama_share(gract: float, analogue: LucidJob) -> float:
    """DRAMA for a busy time `gract`, keeping the analogue's memory-busy share of its busy time."""
    return gract * analogue.drama / analogue.gract if analogue.gract else 0.0


def busy_fraction(throughput: float, analogue: LucidJob, flops_ratio: float, speedup: float) -> float:
    """GRACT of a job processing `throughput` samples/s on the A100, from its analogue's GPU time per sample."""
    return min(1.0, throughput * (analogue.gract / analogue.speed) * flops_ratio / speedup)


def build_profiles(
    workloads: Sequence[Mapping[str, str]],
    analogues: Sequence[Mapping[str, str]],
    datasets: Sequence[Mapping[str, str]],
    singles: Mapping[tuple[str, str, int, bool], LucidJob],
    relation: UtilizationRelation,
    constants: Mapping[str, float],
) -> list[dict[str, object]]:
    by_model = {(a["model"], a["dataset"]): a for a in analogues}
    by_dataset = {d["dataset"]: d for d in datasets}
    speedup = constants["a100_speedup_over_lucid_gpu"]
    rows = []
    for w in workloads:
        a = by_model[(w["model"], w["dataset"])]
        d = by_dataset[w["dataset"]]
        batch = int(w["batch_size"])
        job = nearest_job(singles, a["lucid_model"], a["lucid_dataset"], batch)
        lucid = f"Lucid {job.model}/{job.dataset} batch {job.batch} (GRACT {job.gract:.2f}, {job.speed:.0f}/s)"
        if a["rule"] == "throughput":
            throughput = float(d["samples_per_epoch"]) / (float(w["minutes_per_epoch"]) * 60)
            gract = busy_fraction(throughput, job, float(a["flops_ratio"]), speedup)
            smact = relation.smact(gract)
            util_source = (
                f"{lucid}; CARMA's {throughput:.0f} samples/s; FLOPs x{a['flops_ratio']}; "
                f"A100 speed-up {speedup:g}; SMACT/SMOCC by the GPUMemNet relation"
            )
        elif a["rule"] == "gpu-bound":
            gract = job.gract
            smact = relation.smact(gract)
            util_source = f"{lucid}, GPU-bound ({a['source']}); SMACT/SMOCC by the GPUMemNet relation"
        else:  # measured SMACT (the thesis)
            smact = float(a["smact"])
            gract = relation.gract(smact)
            util_source = f"{a['source']}; GRACT by the inverse GPUMemNet relation"
        drama = drama_share(gract, job)
        params_m = float(a["params_m"] or 0)
        weights_s = params_m * 4e6 / (constants["weights_load_gb_per_s"] * 1e9)
        ttfk = constants["startup_s"] + float(d["setup_s"]) + weights_s
        weights_mib = params_m * 4e6 / 2**20
        mem_first = min(int(w["mem_mib"]), round(constants["cuda_context_mib"] + weights_mib))
        rows.append(
            {
                "task": w["task"],
                "gract": round(gract, 3),
                "smact": round(smact, 3),
                "smocc": round(relation.smocc(smact), 3),
                "drama": round(drama, 3),
                "ttfk_s": round(ttfk, 1),
                "warmup_s": constants["warmup_s"],
                "mem_first_mib": mem_first,
                "utilization_source": util_source,
                "ttfk_source": (
                    f"rule: start-up {constants['startup_s']:g} s + {w['dataset']} set-up {d['setup_s']} s "
                    f"+ {params_m:g} M FP32 weights at {constants['weights_load_gb_per_s']:g} GB/s"
                ),
                "memory_source": (
                    f"rule: at first sighting the CUDA context ({constants['cuda_context_mib']:g} MiB) and "
                    f"{params_m:g} M FP32 weights; all of CARMA's measured {w['mem_mib']} MiB "
                    f"{constants['warmup_s']:g} s later"
                ),
            }
        )
    return rows
