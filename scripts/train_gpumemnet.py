"""Train the GPUMemNet-style memory-bin classifier on the GPUMemNet MLP runs and export its weights.

    python scripts/train_gpumemnet.py [--data DATASETS] [--bin-mib 1000] [--out FILE] [--seed 0]

Each run's features come from its columns (per-layer list, parameters, activations, batch size, depth; the
batch size is checked against the encoded file name); its class is the bin of its measured peak. An MLP
classifier (scikit-learn, a training-time dependency only) is fit on a stratified 80% of the runs and
scored on the other 20%; the file written holds its standardization and weight matrices for
`carma.estimate.gpumemnet`, which needs only NumPy.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.preprocessing import StandardScaler

from carma.calibration.sources import find_datasets
from carma.estimate.gpumemnet import FEATURES, features_from_run, parse_run_name

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path("gpumemnet") / "mlp_training_runs.csv"


def load_runs(path: Path, bin_mib: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, bin of each run, measured peak MiB) of every run in the CSV."""
    features, peaks = [], []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            name = parse_run_name(row["Filename"])
            if name.batch != int(row["Batch Size"]):
                raise ValueError(f"batch size {row['Batch Size']} disagrees with the file name {row['Filename']}")
            features.append(features_from_run(row))
            peaks.append(int(row["Max GPU Memory (MiB)"]))
    peak = np.array(peaks)
    return np.array(features), peak // bin_mib, peak


def export(scaler: StandardScaler, model: MLPClassifier, bin_mib: int, provenance: dict[str, object]) -> dict:
    return {
        "features": list(FEATURES),
        "bin_mib": bin_mib,
        "classes": [int(c) for c in model.classes_],
        "mean": scaler.mean_.tolist(),
        "scale": scaler.scale_.tolist(),
        "layers": [
            {"weights": w.tolist(), "bias": b.tolist()} for w, b in zip(model.coefs_, model.intercepts_, strict=True)
        ],
        **provenance,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="Public datasets folder (holding gpumemnet/); found if beside.")
    parser.add_argument("--bin-mib", type=int, default=1000, help="Bin width (GPUMemNet: 1000 for MLPs, 8000 CNNs).")
    parser.add_argument("--out", type=Path, default=ROOT / "src" / "carma" / "estimate" / "data" / "gpumemnet.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = find_datasets(args.data) / RUNS
    x, y, peak = load_runs(path, args.bin_mib)
    bins, counts = np.unique(y, return_counts=True)
    per_bin = dict(zip(bins.tolist(), counts.tolist(), strict=True))
    print(f"{len(y)} runs from {path}; runs per {args.bin_mib} MiB bin: {per_bin}")
    if len(bins) < 2:
        raise SystemExit(f"every run falls in one {args.bin_mib} MiB bin: nothing to learn; use a smaller --bin-mib")
    x_train, x_test, y_train, y_test, _, peak_test = train_test_split(
        x, y, peak, test_size=0.2, stratify=y, random_state=args.seed
    )
    scaler = StandardScaler().fit(x_train)
    model = MLPClassifier(hidden_layer_sizes=(32, 16), max_iter=3000, random_state=args.seed)
    model.fit(scaler.transform(x_train), y_train)
    predicted = model.predict(scaler.transform(x_test))
    accuracy = float(np.mean(predicted == y_test))
    edge = (predicted + 1) * args.bin_mib
    error = np.abs(edge - peak_test) / peak_test
    print(
        f"held-out accuracy {accuracy:.3f} ({len(y_test)} runs); estimate (bin's upper edge) vs measured peak: "
        f"median relative error {np.median(error):.1%}, underestimates {np.mean(edge < peak_test):.1%}"
    )
    provenance = {
        "trained_on": f"GPUMemNet MLP runs ({RUNS.as_posix()}), {len(y_train)} of {len(y)} runs, seed {args.seed}",
        "held_out_accuracy": round(accuracy, 4),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(export(scaler, model, args.bin_mib, provenance)) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
