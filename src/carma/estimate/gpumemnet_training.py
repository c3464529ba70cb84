"""How carma's GPUMemNet classifier is trained, for the shipped weights and for judging it on runs it never saw.

One recipe (standardized features, an MLP classifier of two hidden layers) serves `scripts/train_gpumemnet.py`,
which fits it on a stratified 80% of the GPUMemNet MLP runs and ships the weights, and the accuracy benchmark,
which fits it once per fold of a k-fold split so that each run is estimated by weights that were not trained
on it: the shipped weights have seen 80% of the very runs the benchmark measures, and a classifier scored on
its training rows is scored on what it memorised. Needs scikit-learn (the `dev` extra), at training time only:
`carma.estimate.gpumemnet` runs the exported weights with NumPy alone.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import StratifiedKFold, train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.preprocessing import StandardScaler

from carma.estimate.gpumemnet import FEATURES, classifier_from_json, features_from_run, parse_run_name

HIDDEN = (32, 16)


@dataclass(frozen=True)
class Runs:
    """The GPUMemNet MLP runs as the classifier sees them, in the CSV's order."""

    names: list[str]  # each run's encoded file name
    features: np.ndarray
    bins: np.ndarray  # the class: measured peak // bin width
    peaks_mib: np.ndarray
    bin_mib: int


def load_runs(path: Path, bin_mib: int) -> Runs:
    """Every run of the CSV, its batch size checked against its encoded file name."""
    names, features, peaks = [], [], []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if parse_run_name(row["Filename"]).batch != int(row["Batch Size"]):
                raise ValueError(f"batch size {row['Batch Size']} disagrees with the file name {row['Filename']}")
            names.append(row["Filename"])
            features.append(features_from_run(row))
            peaks.append(int(row["Max GPU Memory (MiB)"]))
    peak = np.array(peaks)
    return Runs(names, np.array(features), peak // bin_mib, peak, bin_mib)


def fit(features: np.ndarray, bins: np.ndarray, seed: int) -> tuple[StandardScaler, MLPClassifier]:
    scaler = StandardScaler().fit(features)
    model = MLPClassifier(hidden_layer_sizes=HIDDEN, max_iter=3000, random_state=seed)
    return scaler, model.fit(scaler.transform(features), bins)


def export(scaler: StandardScaler, model: MLPClassifier, bin_mib: int, provenance: dict[str, object]) -> dict:
    """The weights file `carma.estimate.gpumemnet.classifier_from_json` reads."""
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


@dataclass(frozen=True)
class Split:
    """Trained on the runs outside `held_out` (indices into `Runs`), scored on those."""

    weights: dict[str, Any]
    held_out: np.ndarray
    accuracy: float


def shipped_split(runs: Runs, seed: int, source: str) -> Split:
    """The shipped weights: trained on a stratified 80% of the runs, scored on the other 20%."""
    train, test = train_test_split(np.arange(len(runs.bins)), test_size=0.2, stratify=runs.bins, random_state=seed)
    return _split(runs, train, test, seed, f"{source}, {len(train)} of {len(runs.bins)} runs, seed {seed}")


def folds(runs: Runs, k: int, seed: int, source: str) -> list[Split]:
    """k classifiers, one per fold of a stratified k-fold split: every run is held out by exactly one."""
    splitter = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    return [
        _split(runs, train, test, seed, f"{source}, fold {i} of {k} (seed {seed}): {len(train)} runs")
        for i, (train, test) in enumerate(splitter.split(runs.features, runs.bins), 1)
    ]


def _split(runs: Runs, train: np.ndarray, test: np.ndarray, seed: int, trained_on: str) -> Split:
    scaler, model = fit(runs.features[train], runs.bins[train], seed)
    accuracy = float(np.mean(model.predict(scaler.transform(runs.features[test])) == runs.bins[test]))
    provenance = {"trained_on": trained_on, "held_out_accuracy": round(accuracy, 4)}
    return Split(export(scaler, model, runs.bin_mib, provenance), test, accuracy)


def upper_edges_mib(split: Split, runs: Runs) -> np.ndarray:
    """The estimates (each predicted bin's upper edge, MiB) of the split's held-out runs, from the runs' CSV
    features (the benchmark estimates from the captured model instead, the same features)."""
    classifier = classifier_from_json(split.weights)
    return np.array([(classifier.predict_bin(runs.features[i]) + 1) * runs.bin_mib for i in split.held_out])
