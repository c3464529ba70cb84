"""Train the GPUMemNet-style memory-bin classifier on the GPUMemNet MLP runs and export its weights.

    python scripts/train_gpumemnet.py [--data DATASETS] [--bin-mib 1000] [--out FILE] [--seed 0] [--folds K]

Each run's features come from its columns (per-layer list, parameters, activations, batch size, depth; the
batch size is checked against the encoded file name); its class is the bin of its measured peak. An MLP
classifier (scikit-learn, a training-time dependency only; the recipe is `carma.estimate.gpumemnet_training`)
is fit on a stratified 80% of the runs and scored on the other 20%; the file written holds its
standardization and weight matrices for `carma.estimate.gpumemnet`, which needs only NumPy. `--folds K` also
scores the recipe by stratified K-fold cross-validation, each run estimated by the fold that never saw it,
as `benchmarks/estimators.py` judges GPUMemNet.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from carma.calibration.sources import GPUMEMNET_RUNS, find_datasets
from carma.estimate.gpumemnet_training import Runs, Split, folds, load_runs, shipped_split, upper_edges_mib

ROOT = Path(__file__).resolve().parents[1]
SOURCE = f"GPUMemNet MLP runs ({GPUMEMNET_RUNS})"


def scored(what: str, splits: list[Split], runs: Runs) -> str:
    held_out = np.concatenate([s.held_out for s in splits])
    edge, peak = np.concatenate([upper_edges_mib(s, runs) for s in splits]), runs.peaks_mib[held_out]
    accuracy = np.mean(edge // runs.bin_mib - 1 == runs.bins[held_out])
    return (
        f"{what}: accuracy {accuracy:.3f} ({len(held_out)} runs); estimate (bin's upper edge) vs measured peak: "
        f"median relative error {np.median(np.abs(edge - peak) / peak):.1%}, "
        f"underestimates {np.mean(edge < peak):.2%} ({np.sum(edge < peak)} runs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="Public datasets folder (holding gpumemnet/); found if beside.")
    parser.add_argument("--bin-mib", type=int, default=1000, help="Bin width (GPUMemNet: 1000 for MLPs, 8000 CNNs).")
    parser.add_argument("--out", type=Path, default=ROOT / "src" / "carma" / "estimate" / "data" / "gpumemnet.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folds", type=int, default=0, help="Also cross-validate the recipe with this many folds.")
    args = parser.parse_args()
    if args.folds == 1 or args.folds < 0:
        parser.error(f"--folds must be 0 (none) or at least 2, not {args.folds}")

    path = find_datasets(args.data, GPUMEMNET_RUNS) / GPUMEMNET_RUNS
    runs = load_runs(path, args.bin_mib)
    bins, counts = np.unique(runs.bins, return_counts=True)
    per_bin = dict(zip(bins.tolist(), counts.tolist(), strict=True))
    print(f"{len(runs.bins)} runs from {path}; runs per {args.bin_mib} MiB bin: {per_bin}")
    if len(bins) < 2:
        raise SystemExit(f"every run falls in one {args.bin_mib} MiB bin: nothing to learn; use a smaller --bin-mib")
    shipped = shipped_split(runs, args.seed, SOURCE)
    print(scored("held-out 20%", [shipped], runs))
    if args.folds:
        print(scored(f"{args.folds}-fold cross-validation", folds(runs, args.folds, args.seed, SOURCE), runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(shipped.weights) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
