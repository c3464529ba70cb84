"""The GPUMemNet classifier's training recipe: the shipped weights, and the cross-validation that judges it."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

pytest.importorskip("sklearn")

from carma.calibration.sources import GPUMEMNET_RUNS, DataNotFound, find_datasets
from carma.estimate.gpumemnet import FEATURES
from carma.estimate.gpumemnet_training import Runs, folds, load_runs, shipped_split, upper_edges_mib


def toy_runs(n: int = 60) -> Runs:
    """Runs whose bin follows their batch size (the fifth feature column here), two bins of 1000 MiB."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(n, len(FEATURES)))
    bins = (features[:, 4] > 0).astype(int) + 1
    peaks = bins * 1000 + rng.integers(1, 999, size=n)
    return Runs([f"run-{i}" for i in range(n)], features, bins, peaks, 1000)


def test_cross_validation_holds_out_every_run_exactly_once():
    """And the weights exported from each fold predict as scikit-learn did: with two bins its classifier has
    one logistic output, which the NumPy inference read as the first bin, always."""
    runs = toy_runs()
    splits = folds(runs, 5, 0, "toy runs")
    held_out = np.concatenate([s.held_out for s in splits])
    assert sorted(held_out.tolist()) == list(range(60))  # each run judged once, by the fold that left it out
    for i, split in enumerate(splits, 1):
        assert split.weights["trained_on"] == f"toy runs, fold {i} of 5 (seed 0): {60 - len(split.held_out)} runs"
        edges = upper_edges_mib(split, runs)
        assert edges.shape == split.held_out.shape and set(edges.tolist()) <= {2000, 3000}
        assert split.accuracy == np.mean(edges // 1000 - 1 == runs.bins[split.held_out])


def test_the_shipped_weights_are_the_recipes_on_the_published_runs():
    """scripts/train_gpumemnet.py reproduces the weights carma ships (to rounding), from the recipe the
    benchmark's cross-validation reuses."""
    try:
        path = find_datasets(needs=GPUMEMNET_RUNS) / GPUMEMNET_RUNS
    except DataNotFound as e:
        pytest.skip(f"public datasets not available ({e})")
    shipped = json.loads((resources.files("carma.estimate") / "data" / "gpumemnet.json").read_text())
    trained = shipped_split(load_runs(path, shipped["bin_mib"]), 0, f"GPUMemNet MLP runs ({GPUMEMNET_RUNS})").weights
    assert {k: v for k, v in trained.items() if k not in ("mean", "scale", "layers")} == {
        k: v for k, v in shipped.items() if k not in ("mean", "scale", "layers")
    }
    for key in ("mean", "scale"):
        np.testing.assert_allclose(trained[key], shipped[key], rtol=1e-9)
    for ours, theirs in zip(trained["layers"], shipped["layers"], strict=True):
        np.testing.assert_allclose(ours["weights"], theirs["weights"], rtol=1e-6, atol=1e-9)
