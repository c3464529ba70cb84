"""The baseline estimators (Horus, FakeTensor, GPUMemNet), the registry and the device constants."""

from __future__ import annotations

import csv
import dataclasses
import itertools

import pytest

torch = pytest.importorskip("torch", reason="estimating needs PyTorch (pip install 'carma-gpu[estimate]')")

from torch import nn  # noqa: E402

from carma.calibration.sources import DataNotFound, find_datasets  # noqa: E402
from carma.estimate import devices, gpumemnet  # noqa: E402
from carma.estimate.base import Capture, EstimateError, TrainingJob  # noqa: E402
from carma.estimate.faketensor import estimate_faketensor  # noqa: E402
from carma.estimate.horus import estimate_horus, summarize  # noqa: E402
from carma.estimate.registry import METHODS, estimate_captured, history_estimate  # noqa: E402

MIB = 2**20
CONTEXT = 100 * MIB


def cross_entropy(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def tiny_job(optimizer=torch.optim.SGD, **options) -> TrainingJob:
    """Linear(4, 3) -> ReLU -> Linear(3, 2) on a batch of 5: 23 parameters, 40 output elements."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    batch = (torch.randn(5, 4), torch.randint(0, 2, (5,)))
    return TrainingJob(model, batch, cross_entropy, optimizer(model.parameters(), lr=0.1, **options))


def captured(job: TrainingJob, seconds: float = 0.0) -> Capture:
    return Capture(job, trace=[], steps=3, seconds=seconds)


# --- Horus -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "options", "state_floats"),
    [
        (torch.optim.SGD, {}, 0),
        (torch.optim.SGD, {"momentum": 0.9}, 23),
        (torch.optim.Adam, {}, 46),
        (torch.optim.AdamW, {"amsgrad": True}, 69),
        (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}, 69),
    ],
)
def test_horus_sums_parameters_gradients_optimizer_state_and_layer_outputs(optimizer, options, state_floats):
    estimate = estimate_horus(captured(tiny_job(optimizer, **options)), CONTEXT, "a100-40gb")
    b = estimate.breakdown
    assert (b.parameters, b.gradients, b.optimizer_state) == (23 * 4, 23 * 4, state_floats * 4)
    assert b.activations == (15 + 15 + 10) * 4  # both Linear outputs and the ReLU's, batch of 5
    assert (b.allocator, b.context) == (0, CONTEXT)
    assert estimate.peak_bytes == b.total == (23 + 23 + state_floats + 40) * 4 + CONTEXT
    assert estimate.method == "horus" and estimate.device == "a100-40gb"


def test_horus_counts_no_gradients_or_state_for_frozen_parameters():
    job = tiny_job(torch.optim.Adam)
    job.model[0].requires_grad_(False)  # 15 of the 23 parameters
    b = estimate_horus(captured(job), 0, "a100-40gb").breakdown
    assert (b.parameters, b.gradients, b.optimizer_state) == (23 * 4, 8 * 4, 16 * 4)


def test_horus_refuses_an_optimizer_it_has_no_rule_for():
    model = nn.Linear(2, 2)
    job = TrainingJob(model, torch.randn(3, 2), lambda m, b: m(b).sum(), torch.optim.LBFGS(model.parameters()))
    with pytest.raises(EstimateError, match="no state rule for the optimizer LBFGS"):
        estimate_horus(captured(job), 0, "a100-40gb")


def test_model_summary_counts_leaf_layers_and_the_batch():
    summary = summarize(tiny_job())
    assert summary.layers == {"Linear": 2, "ReLU": 1}
    assert (summary.weight_layers, summary.parameters, summary.activations, summary.batch_size) == (2, 23, 40, 5)


# --- FakeTensor --------------------------------------------------------------------------------------


def mlp_job(loss=cross_entropy, batch_size=64) -> TrainingJob:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    batch = (torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,)))
    return TrainingJob(model, batch, loss, torch.optim.Adam(model.parameters()))


def test_faketensor_peak_holds_the_model_state_and_stays_plausible():
    job = mlp_job()
    param_bytes = sum(p.numel() * 4 for p in job.model.parameters())
    estimate = estimate_faketensor(captured(job), CONTEXT, "a100-40gb")
    b = estimate.breakdown
    assert b.parameters == param_bytes
    assert b.optimizer_state == 2 * param_bytes + 4 * 4  # Adam: exp_avg, exp_avg_sq and a float step per tensor
    assert b.context == CONTEXT and b.allocator == 0 and estimate.peak_bytes == b.total
    assert estimate.peak_bytes >= 4 * param_bytes + CONTEXT  # parameters, gradients and state at least once
    layer_outputs = 64 * (512 + 512 + 10) * 4
    assert estimate.peak_bytes <= 5 * param_bytes + 4 * layer_outputs + CONTEXT


def test_faketensor_leaves_the_captured_job_untouched():
    job = mlp_job()
    weight = job.model[0].weight
    estimate_faketensor(captured(job), 0, "a100-40gb")
    assert job.model[0].weight is weight and type(weight) is nn.Parameter and weight.grad is None
    assert not job.optimizer.state


class ModelWithLoss(nn.Module):
    """A model that computes its own loss, as transformers models do when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 4)

    def forward(self, x, labels):
        out = type("Output", (), {})()
        out.loss = nn.functional.cross_entropy(self.linear(x), labels)
        return out


@pytest.mark.parametrize(
    ("model", "batch"),
    [
        (nn.Linear(32, 4), torch.randn(8, 32)),  # surrogate: the sum of the output
        (ModelWithLoss(), {"x": torch.randn(8, 32), "labels": torch.randint(0, 4, (8,))}),  # the output's .loss
    ],
)
def test_faketensor_in_script_mode_backpropagates_a_surrogate_loss(model, batch):
    job = TrainingJob(model, batch, None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    b = estimate_faketensor(captured(job), 0, "a100-40gb").breakdown
    assert b.parameters == b.optimizer_state == (32 * 4 + 4) * 4  # SGD's momentum buffers


class ClosureSGD(torch.optim.SGD):
    """An optimizer whose step needs a closure (as sharpness-aware minimisation's does) but no values."""

    def step(self, closure):
        loss = closure()
        super().step()
        return loss


def test_faketensor_gives_an_optimizer_that_needs_a_closure_one():
    plain = estimate_faketensor(captured(mlp_job()), 0, "a100-40gb")
    job = mlp_job()
    job.optimizer = ClosureSGD(job.model.parameters(), lr=0.1)
    with_closure = estimate_faketensor(captured(job), 0, "a100-40gb")
    sgd = mlp_job()
    sgd.optimizer = torch.optim.SGD(sgd.model.parameters(), lr=0.1)
    assert with_closure.breakdown == estimate_faketensor(captured(sgd), 0, "a100-40gb").breakdown != plain.breakdown


@pytest.mark.parametrize("method", ["faketensor", "horus"])
def test_fake_tensor_methods_refuse_a_job_that_reads_values_in_one_line(method):
    def data_dependent(model, batch):
        out = model(batch[0])
        return out.sum() if out.sum().item() > 0 else -out.sum()  # .item() has no value to give

    job = mlp_job(data_dependent)
    with pytest.raises(
        EstimateError, match=rf"^{method} runs the job on fake tensors, which have no values.*use xmem$"
    ):
        estimate_captured(method, captured(job), "a100-40gb")


def test_faketensor_follows_a_job_functions_cpu_autocast_and_notes_only_the_cuda_one():
    """A job function's loss runs as written: CPU autocast works, CUDA autocast (CUDA hidden) turns itself off.
    Horus summarises the model by a forward of its own, in float32, whichever the job used."""

    def in_bfloat16(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cross_entropy(model, batch)

    float32 = estimate_captured("faketensor", captured(mlp_job(batch_size=4096)), "a100-40gb")
    cpu = Capture(mlp_job(in_bfloat16, batch_size=4096), [], 3, 0.0, mixed_precision=("CPU autocast",))
    followed = estimate_captured("faketensor", cpu, "a100-40gb")
    assert followed.notes == () and followed.breakdown.activations < float32.breakdown.activations
    cuda = Capture(mlp_job(), [], 3, 0.0, mixed_precision=("CUDA autocast",))
    left_out = "counts activations in float32: it leaves out the job's mixed precision ({}), which xmem follows"
    assert estimate_captured("faketensor", cuda, "a100-40gb").notes == (
        "faketensor " + left_out.format("CUDA autocast"),
    )
    assert estimate_captured("horus", cpu, "a100-40gb").notes == ("horus " + left_out.format("CPU autocast"),)


def test_faketensor_needs_an_output_that_depends_on_the_parameters():
    model = nn.Linear(4, 4)
    job = TrainingJob(model, torch.randn(2, 4), None, torch.optim.SGD(model.parameters(), lr=0.1))
    model.requires_grad_(False)
    with pytest.raises(EstimateError, match="nothing to backprop"):
        estimate_faketensor(captured(job), 0, "a100-40gb")


# --- GPUMemNet ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> list[dict[str, str]]:
    try:
        path = find_datasets() / "gpumemnet" / "mlp_training_runs.csv"
    except DataNotFound as e:
        pytest.skip(f"public datasets not available ({e}); set $CARMA_DATASETS to run the GPUMemNet checks")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run_named(runs: list[dict[str, str]], prefix: str) -> dict[str, str]:
    return next(row for row in runs if row["Filename"].startswith(prefix))


def test_run_names_parse_into_the_generated_mlp(runs):
    first = gpumemnet.parse_run_name(runs[0]["Filename"])
    assert first == gpumemnet.RunName(1873, 453, 8, "pyramid", 939, "softplus", 0.1748465288359581, True, False)
    leaky = next(gpumemnet.parse_run_name(r["Filename"]) for r in runs if "_act:leaky_relu_" in r["Filename"])
    assert leaky.activation == "leaky_relu"
    for row in runs:
        name = gpumemnet.parse_run_name(row["Filename"])
        assert name.batch == int(row["Batch Size"])
        assert name.batch_norm == (int(row["Batch Normalization Layers"]) > 0)
        assert name.dropout == (int(row["Dropout Layers"]) > 0)


def test_a_run_name_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="not a GPUMemNet MLP run name"):
        gpumemnet.parse_run_name("resnet50_batch:32.out")


def bottleneck_job() -> TrainingJob:
    """input:591_output:45_depth:2_arch:bottleneck_batch:518_act:mish, batch norm, no dropout, built by hand."""
    widths = [591, 295, 147, 73]
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.BatchNorm1d(n_out), nn.Mish()]
    model = nn.Sequential(*layers, nn.Linear(73, 45), nn.Softmax(dim=1))
    batch = (torch.randn(518, 591), torch.randint(0, 45, (518,)))
    return TrainingJob(model, batch, cross_entropy, torch.optim.Adam(model.parameters()))


def test_gpumemnet_features_of_a_captured_model_match_its_dataset_row(runs):
    row = run_named(runs, "input:591_output:45_depth:2_arch:bottleneck_batch:518_act:mish")
    from_model = gpumemnet.features_from_summary(summarize(bottleneck_job()))
    assert from_model.tolist() == pytest.approx(gpumemnet.features_from_run(row).tolist())
    assert dict(zip(gpumemnet.FEATURES[:5], from_model[:5].tolist(), strict=False)) == {
        "depth": 4, "linear": 4, "batch_norm": 3, "dropout": 0, "activation": 3,
    }  # fmt: skip


def test_gpumemnet_predicts_the_upper_edge_of_a_bin_from_the_shipped_weights(runs):
    row = run_named(runs, "input:591_output:45_depth:2_arch:bottleneck_batch:518_act:mish")
    estimate = estimate_captured("gpumemnet", captured(bottleneck_job()), "a100-40gb")
    classifier = gpumemnet.shipped_classifier()
    assert estimate.peak_bytes % (classifier.bin_mib * MIB) == 0
    assert int(row["Max GPU Memory (MiB)"]) * MIB <= estimate.peak_bytes == 2000 * MIB  # measured 1457 MiB
    assert estimate.breakdown.context == devices.get_device("a100-40gb").context_bytes
    assert estimate.breakdown.total == estimate.peak_bytes


def test_gpumemnet_estimates_by_weights_given_in_place_of_the_shipped_ones():
    """The accuracy benchmark judges GPUMemNet by weights trained without the run; no other method takes them."""
    shipped = gpumemnet.shipped_classifier()
    wider = dataclasses.replace(shipped, bin_mib=2 * shipped.bin_mib)  # the same bin predicted, twice as wide
    by_shipped = estimate_captured("gpumemnet", captured(bottleneck_job()), "a100-40gb")
    by_given = estimate_captured("gpumemnet", captured(bottleneck_job()), "a100-40gb", classifier=wider)
    assert by_given.peak_bytes == 2 * by_shipped.peak_bytes == 4000 * MIB
    with pytest.raises(EstimateError, match="a classifier's weights are gpumemnet's only"):
        estimate_captured("horus", captured(bottleneck_job()), "a100-40gb", classifier=wider)


def test_gpumemnet_says_when_a_model_has_layers_its_classifier_never_saw():
    assert estimate_captured("gpumemnet", captured(bottleneck_job()), "a100-40gb").notes == ()  # an MLP
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    job = TrainingJob(model, torch.randn(4, 3, 32, 32), None, torch.optim.SGD(model.parameters(), lr=0.1))
    (note,) = estimate_captured("gpumemnet", captured(job), "a100-40gb").notes
    assert "MLPs only" in note and "this model also has Conv2d, Flatten" in note and "at most 5000 MiB" in note


def test_gpumemnet_says_when_its_bin_cannot_hold_the_models_own_state():
    """16 layers of 4096 x 4096 with Adam: 4 GiB of weights, gradients and moments, and a 4000 MiB bin,
    given silently as if it fitted."""
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(16)), nn.Linear(4096, 10))
    job = TrainingJob(
        model, (torch.randn(32, 4096), torch.randint(0, 10, (32,))), cross_entropy, torch.optim.Adam(model.parameters())
    )
    estimate = estimate_captured("gpumemnet", captured(job), "a100-40gb")
    floor = devices.get_device("a100-40gb").context_bytes + 4 * sum(p.numel() for p in model.parameters()) * 4
    (note,) = estimate.notes
    assert estimate.peak_bytes < floor and note == (
        f"GPUMemNet's bin, {estimate.peak_bytes / MIB:,.0f} MiB, is below what this job's parameters, gradients "
        f"and optimizer state take with the context alone ({floor / MIB:,.0f} MiB): an underestimate, as the "
        "classifier's bins end where the models it learnt from did"
    )


def test_gpumemnet_layer_kinds_read_class_names_and_dataset_names():
    kinds = {name: gpumemnet.layer_kind(name) for name in ("Linear", "batch_normalization", "BatchNorm2d")}
    assert kinds == {"Linear": "linear", "batch_normalization": "batch_norm", "BatchNorm2d": "batch_norm"}
    assert [gpumemnet.layer_kind(n) for n in ("Dropout", "LeakyReLU", "GELUActivation", "Softmax")] == [
        "dropout", "activation", "activation", None,
    ]  # fmt: skip


# --- registry ----------------------------------------------------------------------------------------


def test_registry_lists_the_methods_and_times_each_estimate_from_the_capture():
    assert METHODS == ("xmem", "faketensor", "horus", "gpumemnet", "history")
    estimate = estimate_captured("horus", captured(tiny_job(), seconds=2.5), "v100-32gb")
    assert estimate.seconds >= 2.5 and estimate.device == "v100-32gb"
    assert estimate.breakdown.context == devices.BUILTIN["v100-32gb"].context_bytes


@pytest.mark.parametrize(
    ("method", "device", "message"),
    [
        ("history", "a100-40gb", "needs that run recorded by the carma server"),
        ("guess", "a100-40gb", "unknown method 'guess'; choose one of xmem, faketensor, horus, gpumemnet"),
        ("horus", "tpu-v5", "unknown device 'tpu-v5'; known devices: a100-40gb, a100-80gb"),
    ],
)
def test_registry_errors_are_one_clear_line(method, device, message):
    with pytest.raises(EstimateError, match=message):
        estimate_captured(method, captured(tiny_job()), device)


def test_history_estimate_is_the_observed_peak_with_the_context_set_apart():
    estimate = history_estimate(5000 * MIB, "a100-40gb")
    context = devices.BUILTIN["a100-40gb"].context_bytes
    assert (estimate.method, estimate.peak_bytes, estimate.breakdown.context) == ("history", 5000 * MIB, context)
    assert estimate.breakdown.total == 5000 * MIB
    with pytest.raises(EstimateError, match="must be positive"):
        history_estimate(0, "a100-40gb")


# --- devices -----------------------------------------------------------------------------------------


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CARMA_HOME", str(tmp_path))
    return tmp_path


def test_builtin_devices_say_where_their_constant_comes_from(config_home):
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "v100-32gb"} <= set(devices.devices())
    assert "fitted on CARMA's A100-40GB measurements" in devices.BUILTIN["a100-40gb"].source
    assert "GPUMemNet" in devices.get_device("a100-40gb@cuda11-torch2-eager").source
    for device in devices.BUILTIN.values():
        assert device.context_bytes > 0 and device.total_bytes > device.context_bytes
        assert device.name in ("a100-40gb", "h100-80gb") or device.source.startswith("first estimate")
    assert devices.BUILTIN["h100-80gb"].source.startswith("measured by `carma estimate calibrate` on an NVIDIA H100")


def test_the_calibration_step_trains_as_a_job_does():
    """Backward (autograd's thread: a cuBLAS workspace of its own on a GPU) and an optimizer step (its kernels)
    run before the calibration child is measured; a forward product alone measured 98 MiB short on an H100."""
    torch = pytest.importorskip("torch")
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stepped = []
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: stepped.append(optimizer))
    try:
        devices.train_one_step("cpu")
    finally:
        handle.remove()
    [optimizer] = stepped
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params if p.dim() > 1)
    assert all("exp_avg" in optimizer.state[p] for p in params)
    assert isinstance(optimizer, torch.optim.Adam)


def test_calibrated_values_take_precedence_and_keep_each_other(config_home):
    path = devices.save_calibrated(devices.Device("a100-40gb", 500 * MIB, 40 * 2**30, "measured here"))
    devices.save_calibrated(devices.Device("rtx-4090-24gb", 400 * MIB, 24 * 2**30, 'a "quoted" source'))
    assert path == config_home / "devices.toml"
    assert devices.get_device("a100-40gb") == devices.Device("a100-40gb", 500 * MIB, 40 * 2**30, "measured here")
    assert devices.get_device("rtx-4090-24gb").source == 'a "quoted" source'
    assert devices.get_device("h100-80gb") == devices.BUILTIN["h100-80gb"]


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ("context_bytes = 'many'", "a100-40gb: context_bytes must be a whole number of bytes, not 'many'"),
        # int() took these as 1 byte and 3 bytes
        ("context_bytes = true\ntotal_bytes = 100\nsource = 'hand-edited'", "context_bytes must be a whole .*not True"),
        ("context_bytes = 5\ntotal_bytes = 3.7\nsource = 'hand-edited'", "total_bytes must be a whole .*not 3.7"),
        ("context_bytes = -5\ntotal_bytes = 100\nsource = 'hand-edited'", "context_bytes must be at least 0"),
        ("context_bytes = 200\ntotal_bytes = 100\nsource = 'hand-edited'", "and below total_bytes \\(100\\), not 200"),
        ("context_bytes = 5\ntotal_bytes = 0\nsource = 'hand-edited'", "total_bytes must be positive, not 0"),
        ("context_bytes = 5\ntotal_bytes = 100", "\\[a100-40gb\\] has no source"),  # it said only 'source'
    ],
)
def test_a_broken_calibration_file_is_one_clear_error(config_home, table, why):
    (config_home / "devices.toml").write_text(f"[a100-40gb]\n{table}\n")
    with pytest.raises(EstimateError, match=rf"devices\.toml: .*{why}.*run `carma estimate calibrate` again"):
        devices.get_device("a100-40gb")


def test_a_calibration_file_that_cannot_be_read_is_one_clear_error(config_home):
    (config_home / "devices.toml").mkdir()  # was a traceback (IsADirectoryError)
    with pytest.raises(EstimateError, match=r"^cannot read .*devices\.toml: Is a directory; run `carma estimate cal"):
        devices.get_device("a100-40gb")


def test_calibration_file_lives_in_the_xdg_config_dir_without_carma_home(tmp_path, monkeypatch):
    monkeypatch.delenv("CARMA_HOME", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert devices.calibration_path() == tmp_path / "carma" / "devices.toml"


def test_gpu_names_map_to_builtin_devices_or_their_own():
    assert devices.device_name_for("NVIDIA A100-SXM4-80GB", 85_100_000_000) == "a100-80gb"
    assert devices.device_name_for("NVIDIA A100-PCIE-40GB", 42_300_000_000) == "a100-40gb"
    assert devices.device_name_for("NVIDIA H100 80GB HBM3", 85_000_000_000) == "h100-80gb"
    assert devices.device_name_for("NVIDIA GeForce RTX 4090", 25_390_000_000) == "nvidia-geforce-rtx-4090-24gb"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_calibration_without_a_gpu_is_a_clear_error(config_home):
    with pytest.raises(EstimateError, match="no CUDA GPU found"):
        devices.calibrate()
    assert not (config_home / "devices.toml").exists()
