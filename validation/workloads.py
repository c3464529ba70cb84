"""Real PyTorch training workloads on synthetic data, for validating carma on a GPU.

    python validation/workloads.py --model resnet50 --batch-size 64 --steps 300

Each run builds its model, makes one synthetic batch on the device, trains `--steps` optimizer steps
(or for `--seconds`), and ends with one line `carma-workload {json}`: throughput, the time to its first
step, and PyTorch's own peak allocated/reserved memory, to set beside what NVML saw. The models are the
kinds CARMA's traces hold: an MLP, ResNet-18/50 (torchvision), BERT-base and GPT-2-small (transformers
configurations, no weights downloaded). It runs on CUDA when there is one, else on the CPU (for tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

STARTED = time.monotonic()
MODELS = ("mlp", "resnet18", "resnet50", "bert-base", "gpt2-small")


def build(name: str, batch: int, seq_len: int, device: Any) -> tuple[Any, Callable[[], Any]]:
    """The model on `device` and a function computing one step's loss on a fixed synthetic batch."""
    import torch

    if name == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 1000),
        )  # fmt: skip
        x, y = torch.randn(batch, 1024), torch.randint(0, 1000, (batch,))
        return _classifier(model, x, y, device)
    if name in ("resnet18", "resnet50"):
        try:
            import torchvision
        except ImportError:
            raise SystemExit(f"error: {name} needs torchvision (pip install torchvision)") from None
        model = getattr(torchvision.models, name)(num_classes=1000)
        x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
        return _classifier(model, x, y, device)
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"error: {name} needs transformers (pip install transformers)") from None
    if name == "bert-base":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).to(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
        labels = torch.randint(0, 2, (batch,), device=device)
        return model, lambda: model(input_ids=ids, labels=labels).loss
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(device)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _classifier(model: Any, x: Any, y: Any, device: Any) -> tuple[Any, Callable[[], Any]]:
    import torch

    model = model.to(device)
    x, y = x.to(device), y.to(device)
    return model, lambda: torch.nn.functional.cross_entropy(model(x), y)


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    model, loss_fn = build(args.model, args.batch_size, args.seq_len, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
    first_step_s = None
    steps = 0
    began = time.monotonic()
    while steps < args.steps and (args.seconds is None or time.monotonic() - began < args.seconds):
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        steps += 1
        if first_step_s is None:
            if cuda:
                torch.cuda.synchronize()
            first_step_s = time.monotonic() - STARTED
        if args.log_every and steps % args.log_every == 0:
            print(f"step {steps}: loss {loss.item():.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.monotonic() - began
    mib = 1 << 20
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": steps,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "amp": args.amp,
        "train_s": round(seconds, 3),
        "first_step_s": round(first_step_s or 0.0, 3),
        "samples_per_s": round(steps * args.batch_size / seconds, 2) if seconds > 0 else None,
        "torch_peak_allocated_mib": round(torch.cuda.max_memory_allocated() / mib) if cuda else None,
        "torch_peak_reserved_mib": round(torch.cuda.max_memory_reserved() / mib) if cuda else None,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--seconds", type=float, help="stop after this many seconds of training instead")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample for BERT and GPT-2")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="auto: CUDA when present")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps (0: never)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.batch_size < 1 or args.steps < 1:
        print("error: --batch-size and --steps must be positive", file=sys.stderr)
        return 2
    print("carma-workload " + json.dumps(train(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
