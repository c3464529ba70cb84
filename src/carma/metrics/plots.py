"""PNG charts of simulation results (matplotlib is an optional extra: `pip install 'carma[plot]'`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from carma.metrics.timeline import Segment
from carma.sim.experiment import RunResult


class PlotsUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install 'carma[plot]'") from None
    return plt


def _steps(segments: Sequence[Segment], metric: str, start: float, end: float, scale: float):
    xs, ys = [], []
    for seg in segments:
        if seg.t > end:
            break
        xs.append((max(seg.t, start) - start) / 3600)
        ys.append(getattr(seg, metric) * scale)
    xs.append((end - start) / 3600)
    ys.append(ys[-1])
    return xs, ys


def plot_makespan_energy(results: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    labels = [r.config.label for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(results) + 1.5), sharey=True)
    ax1.barh(labels, [r.metrics.makespan_s / 3600 for r in results], color="#4477aa")
    ax1.set_xlabel("makespan (h)")
    ax2.barh(labels, [r.metrics.energy_mj for r in results], color="#ee6677")
    ax2.set_xlabel("GPU energy (MJ)")
    for ax, value in ((ax1, results[0].metrics.makespan_s / 3600), (ax2, results[0].metrics.energy_mj)):
        ax.axvline(value, color="grey", linestyle="--", linewidth=1)
    ax1.invert_yaxis()
    fig.suptitle("Makespan and energy per configuration (dashed: first configuration)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(runs: Sequence[RunResult], path: Path, gpu: int = 0) -> Path:
    """GPU memory used and SMACT over time on one GPU, one line per run (CARMA figure 5)."""
    plt = _pyplot()
    fig, (mem_ax, smact_ax) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for run in runs:
        start = min(t.submit_s for t in run.tasks)
        end = start + run.metrics.makespan_s
        segments = run.timelines[gpu]
        mem_ax.step(*_steps(segments, "used_mib", start, end, 1 / 1024), where="post", label=run.config.label)
        smact_ax.step(*_steps(segments, "smact", start, end, 1.0), where="post", label=run.config.label)
    mem_ax.set_ylabel(f"GPU {gpu} memory used (GiB)")
    smact_ax.set_ylabel(f"GPU {gpu} SMACT")
    smact_ax.set_xlabel("time since first submission (h)")
    mem_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results: Sequence[RunResult], directory: Path) -> list[Path]:
    """The sweep's charts: makespan/energy per configuration; MAGM against Exclusive over time."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [plot_makespan_energy(results, directory / "makespan_energy.png")]
    by_label = {r.config.label: r for r in results}
    pair = [by_label.get("Exclusive"), by_label.get("MAGM recovery only")]
    if all(pair):
        written.append(plot_timelines(pair, directory / "timeline_magm_vs_exclusive.png"))
    return written
