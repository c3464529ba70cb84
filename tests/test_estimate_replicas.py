"""A model under torch.nn.DataParallel, captured as the first of the job's GPUs runs it."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from carma.estimate import replicas  # noqa: E402
from carma.estimate.base import Estimate  # noqa: E402
from carma.estimate.runner import estimate_script  # noqa: E402

MIB = 1 << 20

# An MLP whose classifier's outputs are small beside its activations; `dp` wraps it in DataParallel, `if
# several` when it sees several GPUs; Adam, or plain SGD (no state, no temporaries in its step).
SCRIPT = """
import sys, torch
batch, wrap, sgd = int(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["sgd"]
wrapped = wrap == "dp" or (wrap == "if several" and torch.cuda.device_count() > 1)  # PyTorch's tutorial
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                            torch.nn.ReLU(), torch.nn.Linear(2048, 10))
model = torch.nn.DataParallel(model) if wrapped else model
device = "cuda" if torch.cuda.is_available() else "cpu"
model = model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.Adam(model.parameters())
for _ in range(5):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(batch, 512, device=device)),
                                      torch.randint(0, 10, (batch,), device=device)).backward()
    optimizer.step()
"""


@pytest.fixture
def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    return "train.py"


_made: dict[tuple[int, bool | str, int, str], Estimate] = {}


def estimate(train: str, batch: int, wrapped: bool | str, gpus: int, optimizer: str = "adam") -> Estimate:
    """The script's estimate, made once per worker (a capture takes seconds; the folder changes nothing);
    `wrapped` True or False, or the script's own condition."""
    key = (batch, wrapped, gpus, optimizer)
    if key not in _made:
        wrap = wrapped if isinstance(wrapped, str) else "dp" if wrapped else "-"
        _made[key] = estimate_script(["python", train, str(batch), wrap, optimizer], "xmem", "a100-40gb", gpus=gpus)
    return _made[key]


def test_data_parallel_on_two_gpus_is_estimated_as_its_first_gpus_half_of_the_batch(train: str) -> None:
    """On the CPU DataParallel runs the whole batch on one device; told the job's 2 GPUs, the capture runs
    half of it, as the first GPU does, and gathers both halves' outputs there (4096 x 10 floats more)."""
    two = estimate(train, 8192, wrapped=True, gpus=2)
    half = estimate(train, 4096, wrapped=False, gpus=1)
    # the same to the allocator's rounding (the input is whole here, a chunk is a view of it), where the
    # whole batch's activations are 128 MiB more
    assert abs(two.peak_bytes - half.peak_bytes) <= 8 * MIB
    assert two.breakdown.optimizer_state == half.breakdown.optimizer_state  # the first GPU steps the optimizer
    assert any("DataParallel on 2 GPUs" in note for note in two.notes)
    assert not half.notes


def test_the_gradients_are_reduced_into_new_tensors_on_the_first_gpu(train: str) -> None:
    """DataParallel's backward holds the first replica's gradients until every replica's are in, then reduces
    them into new tensors there: with plain SGD and a tiny batch that moment is the peak, a copy of the
    gradients above the same model trained without DataParallel."""
    two = estimate(train, 2, wrapped=True, gpus=2, optimizer="sgd")
    one = estimate(train, 1, wrapped=False, gpus=1, optimizer="sgd")
    extra = two.breakdown.activations - one.breakdown.activations
    assert extra == pytest.approx(two.breakdown.gradients, rel=0.01)
    assert two.breakdown.gradients == one.breakdown.gradients


def test_a_script_that_wraps_its_model_when_it_sees_several_gpus_sees_the_jobs(train: str) -> None:
    """`if torch.cuda.device_count() > 1: model = DataParallel(model)` takes the branch on the job's 2 GPUs, the
    count is the machine's to PyTorch itself (`fork_rng` failed, "Torch not compiled with CUDA enabled"), and
    again to all after the capture."""
    seeing, wrapped = estimate(train, 8192, wrapped="if several", gpus=2), estimate(train, 8192, wrapped=True, gpus=2)
    assert (seeing.peak_bytes, seeing.notes) == (wrapped.peak_bytes, wrapped.notes)
    seen = torch.cuda.device_count()
    with replicas.data_parallel(3):
        assert torch.cuda.device_count() == 3
        with torch.random.fork_rng():  # PyTorch gets the machine's count: it would read each device's state
            torch.randn(2)
    assert torch.cuda.device_count() == seen


def test_data_parallel_on_one_gpu_and_a_plain_model_on_two_are_captured_as_they_run(train: str) -> None:
    """DataParallel on one GPU calls its module with the whole batch; a model without it trains its whole
    batch on each GPU it is given (a Trainer hands each its own batch): nothing to split, and no note."""
    plain = estimate(train, 4096, wrapped=False, gpus=1)
    for wrapped, gpus in ((True, 1), (False, 2)):
        same = estimate(train, 4096, wrapped=wrapped, gpus=gpus)
        assert (same.peak_bytes, same.notes) == (plain.peak_bytes, ())


class Scored(torch.nn.Module):
    """Returns a scalar loss and per-sample scores, as a Hugging Face model's output does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        self.seen.append(tuple(x.shape))
        scores = self.layer(x).squeeze(1) * scale
        return {"loss": scores.sum(), "scores": scores}


@pytest.mark.parametrize(("batch", "gpus", "chunk", "replicas_run"), [(7, 3, 3, 3), (6, 4, 2, 3), (1, 2, 1, 1)])
def test_each_forward_runs_the_first_chunk_and_gathers_every_replicas_outputs(
    batch: int, gpus: int, chunk: int, replicas_run: int
) -> None:
    """torch.chunk's split (7 on 3 GPUs: 3, 3, 1; 6 on 4: three chunks of 2; 1 on 2: one replica), keyword
    arguments passed on, a scalar gathered into a vector with one loss per replica (of one too, as
    DataParallel on several GPUs gathers what a single replica gives), and the gradient
    reaching the module's own weights through the gather."""
    module = Scored()
    with replicas.data_parallel(gpus) as calls:
        output = torch.nn.DataParallel(module)(torch.randn(batch, 4), scale=2.0)
    assert module.seen == [(chunk, 4)] and calls == [replicas_run]
    assert output["scores"].shape == (chunk * replicas_run,)
    assert output["loss"].shape == (replicas_run,)
    output["loss"].mean().backward()
    assert module.layer.weight.grad is not None
    plain = torch.nn.DataParallel(Scored())  # made after: DataParallel is itself again
    assert plain(torch.randn(batch, 4))["scores"].shape == (batch,)


def test_the_batch_is_split_along_the_dimension_data_parallel_is_given() -> None:
    layer, seen = torch.nn.Linear(4, 1), []
    layer.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    with replicas.data_parallel(2):
        output = torch.nn.DataParallel(layer, dim=1)(torch.randn(3, 8, 4))
    assert seen == [(3, 4, 4)] and output.shape == (3, 8, 1)


def test_a_subclass_with_a_forward_of_its_own_runs_as_on_the_cpu_and_the_class_is_left_as_it_was() -> None:
    """mmcv's and PyG's DataParallel unpack their own inputs: split as torch's, they would not run."""

    class Unpacking(torch.nn.DataParallel):
        def forward(self, packed: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.module(packed["x"])

    module = Scored()
    with replicas.data_parallel(2) as calls:
        output = Unpacking(module)({"x": torch.randn(6, 4)})
    assert module.seen == [(6, 4)] and output["scores"].shape == (6,) and calls == []
    assert "__call__" not in torch.nn.DataParallel.__dict__  # nn.Module's again


def test_a_call_without_inputs_runs_one_replica_and_gathers_values_not_garbage() -> None:
    """Without inputs DataParallel runs the module once; the other replicas' outputs are the first's values,
    so a script reading the gathered loss (an `isfinite` check) reads numbers."""

    class Constant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
            return self.w.sum() if x is None else (self.w * x).sum()

    with replicas.data_parallel(4) as calls:
        model = torch.nn.DataParallel(Constant())
        alone = model()
        gathered = model(torch.ones(8, 3))
    assert calls == [1, 4] and alone.tolist() == [3.0]
    assert gathered.tolist() == [6.0] * 4


def test_a_scripted_module_or_one_that_changes_its_weights_in_its_forward_still_trains() -> None:
    """The reduction's stateless call refuses TorchScript modules, and its weights, aliases of the module's,
    must take an in-place change (a forward that clamps its weights): both run, their gradients reach the
    module's weights."""

    class Clamped(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.clamp_(-0.5, 0.5)
            return super().forward(x)

    clamped = Clamped(4, 2)
    with torch.no_grad():
        clamped.weight.mul_(10)
    with warnings.catch_warnings():  # deprecated in favour of torch.compile, and still in users' scripts
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(torch.nn.Linear(4, 2))
    for module in (scripted, clamped):
        with replicas.data_parallel(2) as calls:
            torch.nn.DataParallel(module)(torch.randn(6, 4)).sum().backward()
        assert calls == [2] and module.weight.grad is not None
    assert float(clamped.weight.detach().abs().max()) <= 0.5
