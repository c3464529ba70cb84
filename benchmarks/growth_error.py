"""The growth prediction's peak error read at 10% of a run, over a mix of growing jobs (MIGM: a mean error of at most
15% at 10% of the iterations).

Each job of MIGM's small and large mixes grows from its need to 1.25, 1.5 and 2 times it, and MIGM's Qwen2-7B
example (past 10 GB at iteration 94 of 150, 2 s an iteration, a peak of 12.23 GB) is one job more. Each runs alone
in the twin, whose memory series is the easy case: linear in progress from the need to the peak, one allocation
every `GROWTH_STEP_S`. The series is read at 1 Hz from the end of the warm-up, as the scheduler reads it, and
predicted by `carma.core.growth` at 10% of the time from there to the end, over the time left; the error is
against the series' own maximum over the whole run. To be honest about the twin's easy case the same series is
also read with normal noise, rounded up to the 20 MiB segments PyTorch's caching allocator reserves for mid-sized
blocks, and reserved in steps of 512 MiB (a KV cache's block pool, or large allocations in their own segments).

An underestimate is a crash not foreseen: the band's top is meant to lie above the peak. Two fits: the whole
series since the warm-up (`growth.predict`, MIGM's check) and its later half, which the scheduler fits
(`carma.core.early.RECENT`).

    python benchmarks/growth_error.py [--seeds 20] [--read-at 0.1]
"""

from __future__ import annotations

import argparse
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from carma.core.early import RECENT
from carma.core.growth import Prediction, Sample, predict
from carma.sim.experiment import RunConfig, TwinConfig, simulate
from carma.sim.gpus import parse_gpus
from carma.sim.twin import GROWTH_STEP_S
from carma.traces.catalog import Workload, load_catalog
from carma.traces.loaders import Trace, TraceEntry
from mig_mix import MIXES

GIB = 1024
FACTORS = (1.25, 1.5, 2.0)  # peak over need
GPU = "1xA100-80GB"  # room for every peak: the series is what matters here, not a crash
NOISE_MIB = 100.0
SEGMENT_MIB = 20  # PyTorch's caching allocator: blocks of 1 to 10 MiB come from 20 MiB segments
STEP_MIB = 512


@dataclass(frozen=True)
class Series:
    """A job's memory from the end of its warm-up at 1 Hz, and the time its run ends."""

    label: str
    samples: list[Sample]
    end_s: float


def qwen2_7b() -> tuple[Workload, int]:
    """MIGM's Qwen2-7B inference shaped as in tests/test_growth.py: 150 iterations of 2 s, past 10 GiB at iteration
    94, 12.23 GiB at the end; BERT-large's load."""
    total, crash_at, peak = 150, 94, round(12.23 * GIB)
    need = round(10 * GIB - crash_at * (peak - 10 * GIB) / (total - crash_at))
    like = load_catalog()["BERT_large"]
    start_s = like.ttfk_s + like.warmup_s
    job = replace(like, name="qwen2-7b", mem_mib=need, solo_s=start_s + 2 * total)
    return job, peak


def jobs() -> list[tuple[str, Workload, int]]:
    """(label, workload, peak MiB) of each growing job."""
    catalog = load_catalog()
    names = dict.fromkeys(MIXES["small"] + MIXES["large"])
    mix = [(f"{n} x{f:g}", catalog[n], round(catalog[n].mem_mib * f)) for n in names for f in FACTORS]
    return [*mix, ("Qwen2-7B", *qwen2_7b())]


def twin_series(label: str, workload: Workload, peak_mib: int) -> Series:
    """The job's memory as the twin produces it, alone on a whole GPU: its GPU's memory at each second from the end
    of its warm-up to the end of its run."""
    trace = Trace(label, (TraceEntry(0.0, workload),))
    result = simulate(
        trace, RunConfig("exclusive", "oracle"), TwinConfig(gpus=parse_gpus(GPU)), {workload.name: peak_mib}
    )
    (task,), (timeline,) = result.tasks, result.timelines
    assert task.ended_s is not None
    start = task.attempts[0].dispatched_s + workload.ttfk_s + workload.warmup_s
    times = [s.t for s in timeline]
    samples = [
        (float(t), float(timeline[bisect_right(times, t) - 1].used_mib))
        for t in range(math.ceil(start), math.ceil(task.ended_s))
    ]
    return Series(label, samples, task.ended_s)


Reading = Callable[[Sequence[Sample], random.Random], list[Sample]]


def exact(samples: Sequence[Sample], rng: random.Random) -> list[Sample]:
    return list(samples)


def noisy(samples: Sequence[Sample], rng: random.Random) -> list[Sample]:
    return [(t, max(0.0, mib + rng.gauss(0, NOISE_MIB))) for t, mib in samples]


def segments(size_mib: int) -> Reading:
    """Growth above the first reading reserved in whole segments of `size_mib`."""

    def reserved(samples: Sequence[Sample], rng: random.Random) -> list[Sample]:
        base = samples[0][1]
        return [(t, base + size_mib * math.ceil((mib - base) / size_mib)) for t, mib in samples]

    return reserved


READINGS: dict[str, tuple[Reading, bool]] = {  # name: (reading, random)
    f"the twin's: linear, one allocation every {GROWTH_STEP_S:g} s": (exact, False),
    f"noise of {NOISE_MIB:g} MiB (normal)": (noisy, True),
    f"rounded up to {SEGMENT_MIB} MiB segments": (segments(SEGMENT_MIB), False),
    f"in steps of {STEP_MIB} MiB": (segments(STEP_MIB), False),
    f"in steps of {STEP_MIB} MiB, noise of {NOISE_MIB:g} MiB": (lambda s, r: noisy(segments(STEP_MIB)(s, r), r), True),
}


def predicted_peak(samples: Sequence[Sample], end_s: float, later_half: bool) -> float:
    """The peak predicted at the last sample over the time left (the maximum seen when there is no prediction: the
    scheduler then does nothing)."""
    if later_half:
        start, last = samples[0][0], samples[-1][0]
        samples = [s for s in samples if s[0] >= start + (last - start) * (1 - RECENT)]
    p = predict(samples, end_s - samples[-1][0])
    return p.peak_mib if isinstance(p, Prediction) else max(mib for _, mib in samples)


def errors(series: Series, reading: Reading, seed: int, read_at: float) -> tuple[float, float, float]:
    """The true peak and the peaks predicted at `read_at` of the run, whole series and later half."""
    samples = reading(series.samples, random.Random(seed))
    start = samples[0][0]
    read = [s for s in samples if s[0] - start <= read_at * (series.end_s - start)]
    peak = max(mib for _, mib in samples)
    return peak, predicted_peak(read, series.end_s, False), predicted_peak(read, series.end_s, True)


def summary(pairs: Sequence[tuple[float, float]]) -> str:
    """Mean and worst error, and how many predictions fell below the peak (by how much at most)."""
    errs = [abs(p - peak) / peak * 100 for peak, p in pairs]
    short = [(peak - p) / peak * 100 for peak, p in pairs if p < peak]
    below = f"{len(short)} of {len(pairs)}" + (f", by up to {max(short):.1f}%" if short else "")
    return f"{sum(errs) / len(errs):.1f}% | {max(errs):.1f}% | {below}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="noisy readings of each job")
    parser.add_argument("--read-at", type=float, default=0.1, help="the share of each run read before predicting")
    args = parser.parse_args()
    series = [twin_series(*job) for job in jobs()]
    print(
        f"{len(series)} growing jobs alone on {GPU} in the twin, read at {args.read_at:.0%} of each run; "
        f"noisy readings {args.seeds} times each\n"
    )
    print("| reading | whole series: mean error | worst | below the peak | later half: mean error | worst | below |")
    print("|---|---|---|---|---|---|---|")
    qwen = []
    for name, (reading, noisy_) in READINGS.items():
        seeds = range(args.seeds if noisy_ else 1)
        results = [(s, errors(s, reading, seed, args.read_at)) for s in series for seed in seeds]
        whole = [(peak, p) for _, (peak, p, _) in results]
        half = [(peak, p) for _, (peak, _, p) in results]
        print(f"| {name} | {summary(whole)} | {summary(half)} |")
        qwen.append((name, next(e for s, e in results if s.label == "Qwen2-7B")))
    print("\nQwen2-7B (first seed)\n\n| reading | true peak (MiB) | predicted, whole series | predicted, later half |")
    print("|---|---|---|---|")
    for name, (peak, *predicted) in qwen:
        cells = " | ".join(f"{p:.0f} ({p / peak - 1:+.1%})" for p in predicted)
        print(f"| {name} | {peak:.0f} | {cells} |")


if __name__ == "__main__":
    main()
