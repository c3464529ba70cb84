"""GPUMemNet baseline: a small classifier from model features to a memory bin, whose upper edge is the estimate.

GPUMemNet (Yousefzadeh-Asl-Miandoab et al., "GPU Memory and Utilization Estimation for Training-Aware
Resource Management: Opportunities and Limitations", arXiv:2602.17817; itu-rad/GPUMemNet) trains an MLP
classifier on features of generated models (layer counts by type, parameters, activations, batch size,
depth) measured on a GPU, and reports the upper edge of the predicted bin: CARMA's estimator runs used its
8000 MiB bins (8000/16000/24000 MiB in its workload table). The weights carma ships
(`data/gpumemnet.json`, made by `scripts/train_gpumemnet.py`) come from the public MLP runs in
shared/datasets/gpumemnet, with GPUMemNet's bin width for that data, 1000 MiB (its MLP data loader): every
one of those runs peaked under 5 GB, so 8000 MiB bins would put them all in one class. The bin width is
recorded in the weights file.

The target, nvidia-smi's peak, includes the CUDA context of the GPU the data was measured on, so the
estimate is the bin's upper edge as it stands; in the breakdown the device's context is set apart and the
rest, undivided, is under `activations`. Inference is NumPy only.

Features come from the same model summary as Horus, for any model; but the classifier only saw MLPs
(2 to 12 linear layers, up to 160M parameters, up to 150k activations per sample, batches of 4 to 1023):
anything else, a CNN, a transformer, a bigger model or batch, is extrapolation, and a classifier
extrapolates by answering one of the bins it knows, here at most 5000 MiB.
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from carma.estimate.base import Breakdown, Estimate, EstimateError

MIB = 2**20
FEATURES = (
    "depth",
    "linear",
    "batch_norm",
    "dropout",
    "activation",
    "parameters",
    "activations",
    "batch_size",
    "batch_activations",
)
LOG_FEATURES = frozenset({"parameters", "activations", "batch_size", "batch_activations"})  # span decades
_ACTIVATIONS = frozenset(
    {"relu", "relu6", "leakyrelu", "prelu", "elu", "selu", "celu", "gelu", "silu", "mish", "softplus"}
    | {"tanh", "hardswish", "hardtanh", "identity"}
)

_OUTPUT_LAYERS = frozenset({"softmax", "sigmoid"})  # the MLP runs' last layers: in the data, but no feature


def layer_kind(name: str) -> str | None:
    """A layer's feature kind from its class name (`BatchNorm1d`) or the dataset's name (`batch_normalization`)."""
    key = name.lower().replace("_", "").removesuffix("activation")
    if key == "linear":
        return "linear"
    if key.startswith("batchnorm"):
        return "batch_norm"
    if key.startswith("dropout"):
        return "dropout"
    return "activation" if key in _ACTIVATIONS else None


def feature_vector(layers: Iterable[str], depth: int, parameters: int, activations: int, batch: int) -> np.ndarray:
    """The classifier's input: `layers` are layer names (one per layer), `activations` per sample."""
    kinds = Counter(layer_kind(name) for name in layers)
    values = {
        "depth": depth,
        "linear": kinds["linear"],
        "batch_norm": kinds["batch_norm"],
        "dropout": kinds["dropout"],
        "activation": kinds["activation"],
        "parameters": parameters,
        "activations": activations,
        "batch_size": batch,
        "batch_activations": activations * batch,
    }
    return np.array([np.log1p(values[f]) if f in LOG_FEATURES else values[f] for f in FEATURES], dtype=float)


def features_from_summary(summary: Any) -> np.ndarray:
    """Features of a captured model from its `carma.estimate.horus.ModelSummary`."""
    return feature_vector(
        summary.layers.elements(),
        summary.weight_layers,
        summary.parameters,
        summary.activations // summary.batch_size,
        summary.batch_size,
    )


# -- the GPUMemNet MLP runs: encoded file names and columns (shared/datasets/gpumemnet/mlp_training_runs.csv)

_RUN_NAME = re.compile(
    r"input:(?P<inputs>\d+)_output:(?P<outputs>\d+)_depth:(?P<depth>\d+)_arch:(?P<shape>[a-z]+)"
    r"_batch:(?P<batch>\d+)_act:(?P<activation>[a-z_]+?)_dropout:(?P<dropout_rate>[0-9.eE+-]+)"
    r"_dropout:(?P<dropout>True|False)_batchnorm:(?P<batch_norm>True|False)\.out"
)


@dataclass(frozen=True)
class RunName:
    """The generated MLP a run's file name encodes (see shared/datasets/README.md for the generator)."""

    inputs: int
    outputs: int
    depth: int  # hidden layers asked for (a bottleneck adds one)
    shape: str  # pyramid, uniform, bottleneck or gradual
    batch: int
    activation: str  # lower case, as the generator's option: relu, leaky_relu, swish, identity, ...
    dropout_rate: float
    dropout: bool
    batch_norm: bool


def parse_run_name(filename: str) -> RunName:
    match = _RUN_NAME.fullmatch(filename)
    if not match:
        raise ValueError(f"not a GPUMemNet MLP run name: {filename!r}")
    g = match.groupdict()
    return RunName(
        int(g["inputs"]),
        int(g["outputs"]),
        int(g["depth"]),
        g["shape"],
        int(g["batch"]),
        g["activation"],
        float(g["dropout_rate"]),
        g["dropout"] == "True",
        g["batch_norm"] == "True",
    )


def features_from_run(row: dict[str, str]) -> np.ndarray:
    """Features of one dataset row, from its per-layer list `[(name, outputs per sample, parameters), ...]`."""
    layers = ast.literal_eval(row["Activations-Params"])
    return feature_vector(
        [name for name, _, _ in layers],
        int(row["Depth"]),
        int(row["Total Parameters"]),
        int(row["Total Activations"]),
        int(row["Batch Size"]),
    )


# -- inference


@dataclass(frozen=True)
class Classifier:
    """A standardized-input MLP with ReLU hidden layers; class i means the bin [i, i+1) x bin_mib."""

    bin_mib: int
    classes: np.ndarray  # bin index of each output
    mean: np.ndarray
    scale: np.ndarray
    layers: list[tuple[np.ndarray, np.ndarray]]  # (weights, bias) per layer

    def predict_bin(self, features: np.ndarray) -> int:
        x = (features - self.mean) / self.scale
        for i, (weights, bias) in enumerate(self.layers):
            x = x @ weights + bias
            if i < len(self.layers) - 1:
                x = np.maximum(x, 0.0)
        if x.shape[-1] == 1:  # two classes: scikit-learn's one logistic output, the second class above 0
            return int(self.classes[int(x[0] > 0)])
        return int(self.classes[int(np.argmax(x))])


def classifier_from_json(data: dict[str, Any]) -> Classifier:
    if data.get("features") != list(FEATURES):
        raise EstimateError("the GPUMemNet weights were trained on other features: rerun scripts/train_gpumemnet.py")
    return Classifier(
        int(data["bin_mib"]),
        np.array(data["classes"]),
        np.array(data["mean"]),
        np.array(data["scale"]),
        [(np.array(layer["weights"]), np.array(layer["bias"])) for layer in data["layers"]],
    )


@cache
def shipped_classifier() -> Classifier:
    text = (resources.files("carma.estimate") / "data" / "gpumemnet.json").read_text()
    return classifier_from_json(json.loads(text))


def estimate_gpumemnet(capture: Any, context_bytes: int, device: str, classifier: Classifier | None = None) -> Estimate:
    """By the shipped weights, or by `classifier` (see `carma.estimate.registry.estimate_captured`)."""
    from carma.estimate.horus import summarize

    start = time.perf_counter()
    classifier = classifier or shipped_classifier()
    summary = summarize(capture.job)
    upper_edge = (classifier.predict_bin(features_from_summary(summary)) + 1) * classifier.bin_mib
    peak = upper_edge * MIB
    context = min(context_bytes, peak)
    breakdown = Breakdown(activations=peak - context, context=context)
    notes = _extrapolating(summary.layers, classifier) + _below_model_state(capture.job, summary, context_bytes, peak)
    return Estimate("gpumemnet", peak, breakdown, device, time.perf_counter() - start, notes)


def _below_model_state(job: Any, summary: Any, context_bytes: int, peak: int) -> tuple[str, ...]:
    """A note when the bin is below what the model's state alone takes: the classifier's bins end where its
    training runs did (5 GB), so a larger model gets a bin that cannot hold its weights. The answer is kept,
    as GPUMemNet gives it; the note says it is an underestimate."""
    from carma.estimate.horus import optimizer_state_bytes

    try:
        optimizer = optimizer_state_bytes(job.optimizer)
    except EstimateError:  # an optimizer without a state rule: the floor without its state
        optimizer = 0
    floor = context_bytes + summary.parameter_bytes + summary.trainable_bytes + optimizer
    if peak >= floor:
        return ()
    return (
        f"GPUMemNet's bin, {peak / MIB:,.0f} MiB, is below what this job's parameters, gradients and optimizer "
        f"state take with the context alone ({floor / MIB:,.0f} MiB): an underestimate, as the classifier's bins "
        "end where the models it learnt from did",
    )


def _extrapolating(layers: Iterable[str], classifier: Classifier) -> tuple[str, ...]:
    """A note when the model has layers of kinds the classifier never saw (it learnt from MLPs only)."""
    unseen = sorted({name for name in layers if layer_kind(name) is None and name.lower() not in _OUTPUT_LAYERS})
    if not unseen:
        return ()
    largest = (int(classifier.classes.max()) + 1) * classifier.bin_mib
    return (
        f"GPUMemNet's classifier learnt from MLPs only (linear, batch-norm, dropout and activation layers); "
        f"this model also has {', '.join(unseen)}, so its answer, one of the bins it knows (at most "
        f"{largest} MiB), is an extrapolation",
    )
