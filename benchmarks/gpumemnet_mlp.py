"""Train one GPUMemNet MLP run the way the dataset's runs were trained, for `benchmarks/estimators.py`.

    python benchmarks/gpumemnet_mlp.py 'input:1873_output:453_depth:8_arch:pyramid_batch:939_...' [--seconds 60]

The run is rebuilt from its encoded name with the GPUMemNet generator (`depth` hidden Linear layers that
halve the width for pyramid, plus one more halving layer for bottleneck, never below the output size; keep
it for uniform; shrink it by (input - output) // depth for gradual; each Linear followed by optional
BatchNorm1d, the activation and optional Dropout; then the output Linear and Softmax(dim=1)) and trained as
`shared/datasets/README.md` describes the runs: a 4,096-sample random dataset kept on the host, shuffled
batches moved to the GPU one by one, Adam and cross-entropy, for a minute. The loop keeps the order of
the original script, which shapes the allocator's history: the next batch is moved to the GPU before
`zero_grad()`, and the previous step's outputs and loss stay alive until the next forward replaces them.
A forward pass of two samples comes first, as the model summary the runs printed did.

On a GPU this is the measured job itself (compare `torch.cuda.max_memory_reserved()` plus the context
with the run's `Max GPU Memory (MiB)`); on the CPU it is what `carma estimate -- python ...` captures.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from carma.estimate.gpumemnet import RunName, parse_run_name

SAMPLES = 4096
ACTIVATIONS = {
    "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "prelu": nn.PReLU, "elu": nn.ELU, "selu": nn.SELU,
    "gelu": nn.GELU, "swish": nn.SiLU, "mish": nn.Mish, "softplus": nn.Softplus, "tanh": nn.Tanh,
    "identity": nn.Identity,
}  # fmt: skip


def hidden_widths(run: RunName) -> list[int]:
    widths, width = [], run.inputs
    if run.shape in ("pyramid", "bottleneck"):
        for _ in range(run.depth + (run.shape == "bottleneck")):
            width = max(width // 2, run.outputs)
            widths.append(width)
    elif run.shape == "uniform":
        widths = [run.inputs] * run.depth
    elif run.shape == "gradual":
        step = (run.inputs - run.outputs) // run.depth
        for _ in range(run.depth):
            width = max(width - step, run.outputs)
            widths.append(width)
    else:
        raise ValueError(f"unknown MLP shape {run.shape!r}")
    return widths


def build_mlp(run: RunName) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = run.inputs
    for out in hidden_widths(run):
        layers.append(nn.Linear(width, out))
        if run.batch_norm:
            layers.append(nn.BatchNorm1d(out))
        layers.append(ACTIVATIONS[run.activation]())
        if run.dropout:
            layers.append(nn.Dropout(run.dropout_rate))
        width = out
    return nn.Sequential(*layers, nn.Linear(width, run.outputs), nn.Softmax(dim=1))


class FlatMLP(nn.Module):
    """The generated layers behind a forward that flattens its input, as the runs' model did."""

    def __init__(self, run: RunName) -> None:
        super().__init__()
        self.model = build_mlp(run)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.view(x.size(0), -1))


def train(run: RunName, seconds: float) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = TensorDataset(torch.randn(SAMPLES, run.inputs), torch.randint(0, run.outputs, (SAMPLES,)))
    loader = DataLoader(data, batch_size=run.batch, shuffle=True)
    model = FlatMLP(run).to(device)
    model(torch.rand(2, 1, run.inputs, device=device))  # the model summary's forward pass
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters())
    deadline = time.monotonic() + seconds
    while True:
        for inputs, labels in loader:
            if time.monotonic() > deadline:
                return
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run's encoded name (the Filename column of mlp_training_runs.csv)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to train (the runs: a minute)")
    args = parser.parse_args()
    train(parse_run_name(args.run), args.seconds)


if __name__ == "__main__":
    main()
