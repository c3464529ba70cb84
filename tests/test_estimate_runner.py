"""The CPU runner end to end: user scripts and job functions in a child process (or a job in this one), xMem on them."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from carma.estimate import cuda_on_cpu, libraries  # noqa: E402
from carma.estimate.base import Capture, Estimate, EstimateError  # noqa: E402
from carma.estimate.job import capture_job  # noqa: E402
from carma.estimate.runner import COMPUTED_NOTE, _read_result, estimate_job, estimate_script  # noqa: E402
from carma.estimate.session import BACKWARDS_WITHOUT_STEP, module_window  # noqa: E402
from carma.estimate.xmem import estimate_xmem, run_xmem  # noqa: E402
from carma.server import proctree  # noqa: E402
from support import wait_until  # noqa: E402

MIB = 1024 * 1024

# The registry (method -> estimator) is not needed here: the child imports this estimator instead.
ESTIMATOR = """
from carma.estimate.xmem import estimate_xmem

def estimate(method, capture, device, **options):
    assert method == "xmem"
    return estimate_xmem(capture, 300 * 1024 * 1024, device, **options)
"""

# Reports the first dimension of the captured batch as its "peak".
BATCH_PROBE = """
from carma.estimate.base import Breakdown, Estimate

def estimate(method, capture, device, **options):
    return Estimate(method, capture.job.batch.shape[0], Breakdown(), device, 0.0)
"""

# Falls back to the CPU without CUDA, logs each finished step, and prepares data the loop never uses.
MLP_SCRIPT = """
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--log", required=True)
parser.add_argument("--summary", action="store_true")
parser.add_argument("--check", type=int, default=0)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
unused = torch.randn(2048, 1024)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(512, 10))
model = model.to(device)
if args.summary:  # a model summary's forward pass, before training
    model(torch.randn(2, 256, device=device))
if args.check:  # a model check of its own batch size, gradients on, its outputs dropped
    model(torch.randn(args.check, 256, device=device))
optimizer = torch.optim.Adam(model.parameters())
for step in range(50):
    x = torch.randn(args.batch_size, 256, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    with open(args.log, "a") as log:
        log.write(f"step {step} on {device}\\n")
"""

# A GAN: the discriminator's update, then the generator's, each with its own Adam; logs each iteration.
GAN_SCRIPT = """
import torch
from torch import nn
G = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 784), nn.Tanh())
D = nn.Sequential(nn.Linear(784, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
for iteration in range(50):
    real = torch.randn(64, 784)
    fake = G(torch.randn(64, 64))
    opt_d.zero_grad()
    (bce(D(real), torch.ones(64, 1)) + bce(D(fake.detach()), torch.zeros(64, 1))).backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(D(fake), torch.ones(64, 1)).backward()
    opt_g.step()
    with open("iterations.log", "a") as log:
        log.write(f"iteration {iteration}\\n")
"""

JOB_MODULE = """
import torch
from carma.estimate.base import TrainingJob

def mlp():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    batch = (torch.randn(128, 1024), torch.randint(0, 10, (128,)))
    optimizer = torch.optim.Adam(model.parameters())
    return TrainingJob(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), optimizer)

def layers():  # every operator whose arithmetic the capture skips, in one small network
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512), torch.nn.SiLU(), torch.nn.BatchNorm1d(512), torch.nn.GroupNorm(8, 512),
        torch.nn.Linear(512, 10), torch.nn.Softmax(dim=1),
    )
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    optimizer = torch.optim.AdamW(model.parameters())
    return TrainingJob(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), optimizer)

def on_cuda():
    job = mlp()
    batch = tuple(t.cuda() for t in job.batch)
    return TrainingJob(job.model.cuda(), batch, job.loss, job.optimizer)

def as_tuple():
    job = mlp()
    return job.model, job.batch, job.loss, job.optimizer

def not_a_job():
    return 42

def parts_only():  # the loss calls the container's parts, never the container
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(64, 128), "head": torch.nn.Linear(128, 10)})
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m["head"](m["body"](b[0])), b[1])
    return TrainingJob(model, batch, loss, torch.optim.SGD(model.parameters(), lr=0.1))

def lbfgs():  # its step takes a closure
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    batch = (torch.randn(32, 256), torch.randint(0, 10, (32,)))
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=10)
    return TrainingJob(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), optimizer)

def records_its_process():
    import os
    open("job.pid", "w").write(str(os.getpid()))
    return mlp()
"""


# Compiles MLP_SCRIPT's model with a backend that leaves a mark when the compiler calls it.
COMPILE = """model = model.to(device)
def backend(graph, example_inputs):
    open("compiled", "w").write("the model was compiled")
    return graph.forward
model = torch.compile(model, backend=backend)"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "xmem_only.py").write_text(ESTIMATOR)
    (tmp_path / "batch_probe.py").write_text(BATCH_PROBE)
    (tmp_path / "jobs.py").write_text(textwrap.dedent(JOB_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # capture_job hides CUDA in this process: undone after
    monkeypatch.delitem(sys.modules, "jobs", raising=False)
    return tmp_path


def script(workdir: Path, name: str, body: str) -> str:
    (workdir / name).write_text(textwrap.dedent(body))
    return name


def tiny_script(workdir: Path, name: str, steps: int, each_step: str = "pass") -> str:
    """A script training a 4-2 linear model for `steps` SGD steps, running `each_step` after each."""
    body = f"""
    import torch
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range({steps}):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        {each_step}
    """
    return script(workdir, name, body)


def estimate(argv: list[str], **kwargs: object):
    return estimate_script(argv, "xmem", "test-gpu", estimator="xmem_only:estimate", **kwargs)


def test_the_capture_enters_the_working_directory_itself(tmp_path):
    """As the job's user, after root's rights are dropped (a root `chdir` before would let a user's capture into
    a folder below one closed to them); a directory it cannot enter is the estimate's one-line error."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "xmem_only.py").write_text(ESTIMATOR)  # the test's estimator, found in the job's directory
    tiny_script(workdir, "t.py", 10, each_step="open('where', 'w').write(__import__('os').getcwd())")
    estimate(["python", "t.py"], cwd=workdir)
    assert (workdir / "where").read_text() == str(workdir)
    gone = tmp_path / "gone"
    with pytest.raises(EstimateError, match=rf"^cannot enter the working directory '{gone}': No such file"):
        estimate(["python", "-c", "pass"], cwd=gone)


@pytest.mark.parametrize(
    "forged",
    [
        '{"estimate": {"method": "xmem", "device": "d", "peak_bytes": "boom", "breakdown": {}}}',
        '{"estimate": {"method": "xmem", "device": "d", "peak_bytes": Infinity, "breakdown": {}}}',
        '{"estimate": {"method": "xmem", "device": "d", "peak_bytes": 1e400, "breakdown": {}}}',
        '{"estimate": {"method": {}, "device": "d", "peak_bytes": 1, "breakdown": {"parameters": 1}}}',
        '{"estimate": {"method": "xmem", "device": "d", "peak_bytes": 1, "breakdown": {"mine": 1}}}',
        '{"estimate": {"method": "xmem", "device": "d", "peak_bytes": 99999999999999999999, "breakdown": {}}}',
        '{"values_read": [1], "error": "x"}',
        "[1]",
    ],
)
def test_a_result_the_job_forged_is_a_malformed_estimate_never_taken(tmp_path, forged):
    """The capture child runs the job's code, as its user, which may write the result file itself and exit: a
    server that took its figures as they came stopped at them (and at every start, the estimate being kept)."""
    body = f"""
    import json, os
    argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    spec = json.loads(next(a for a in argv if a.startswith(b'{{"')))
    open(spec["result"], "w").write({forged!r})
    os._exit(0)
    """
    with pytest.raises(EstimateError, match=r"^the estimating process wrote a malformed (estimate|result)"):
        estimate(["python", str(tmp_path / script(tmp_path, "forge.py", body))])


MLP_ARGV = ("--batch-size", "64", "--log", "steps.log")
_references: dict[tuple[str, ...], Estimate] = {}


def reference(workdir: Path, body: str, *argv: str) -> Estimate:
    """`estimate` of the script `body`, which several tests compare a variant's estimate to: made once per
    worker, as a capture takes seconds. Its result does not depend on the folder it was captured in."""
    key = (body, *argv)
    if key not in _references:
        _references[key] = estimate(["python", script(workdir, "reference.py", body), *argv])
    return _references[key]


def test_a_timeline_that_cannot_be_written_after_the_capture_leaves_the_estimate_with_a_note(workdir: Path) -> None:
    """The capture's work was thrown away: `estimating with xmem failed: IsADirectoryError ...`."""
    train = script(workdir, "train.py", MLP_SCRIPT)
    (workdir / "taken.png").mkdir()  # as a folder made there after the CLI checked the name
    result = estimate(["python", train, "--batch-size", "8", "--log", "steps.log"], timeline=workdir / "taken.png")
    assert result.peak_bytes > 0
    (note,) = result.notes
    assert note.startswith("the timeline was not written: [Errno 21] Is a directory:")


def registered(argv: list[str], method: str = "xmem"):
    """The estimate `carma estimate` makes: the method's estimator from the registry, its notes included."""
    return estimate_script(argv, method, "a100-40gb")


def test_script_runs_on_the_cpu_and_stops_after_three_steps(workdir: Path) -> None:
    train = script(workdir, "train.py", MLP_SCRIPT)
    timeline = workdir / "timeline.png"
    result = estimate(["python", train, "--batch-size", "64", "--log", "steps.log"], timeline=timeline)
    # The third step is stopped inside optimizer.step(): the script logs only the first two.
    assert (workdir / "steps.log").read_text().splitlines() == ["step 0 on cpu", "step 1 on cpu"]
    assert result.method == "xmem" and result.device == "test-gpu" and result.notes == ()
    assert result.breakdown.total == result.peak_bytes
    assert result.breakdown.context == 300 * MIB
    parameters = (256 * 512 + 512 + 512 * 10 + 10) * 4
    assert parameters <= result.breakdown.parameters < parameters + 10 * 512  # each tensor rounded to 512 B
    assert result.breakdown.optimizer_state >= 2 * parameters  # Adam's two moments
    assert timeline.stat().st_size > 0


@pytest.mark.parametrize("caught_by", ["except:", "except BaseException:"])
def test_a_script_that_catches_the_stop_and_goes_on_is_not_waited_for(workdir: Path, caught_by: str) -> None:
    """A loop that skips any failing batch with a bare `except:` catches the capture's stop too: it is
    ended at its next model call with the capture it had, not left to train on until the timeout."""
    loop = """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters())
    while True:
        try:
            optimizer.zero_grad()
            model(torch.randn(32, 256)).sum().backward()
            optimizer.step()
        CAUGHT_BY
            with open("caught.log", "a") as log:
                log.write("went on\\n")
    """
    plain = estimate(["python", script(workdir, "plain.py", loop.replace("CAUGHT_BY", "except ValueError:"))])
    caught = script(workdir, "caught.py", loop.replace("CAUGHT_BY", caught_by))
    assert estimate(["python", caught], timeout_s=60).peak_bytes == plain.peak_bytes
    assert (workdir / "caught.log").read_text() == "went on\n"


def test_a_helper_the_script_leaves_running_holds_nothing_up(workdir: Path) -> None:
    """The capture read the script's error output to its end: a helper process that inherited it (here in a
    session of its own, out of reach of the capture's kill) kept the estimate waiting past its timeout."""
    body = """
    import subprocess, sys, torch
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(90)"], start_new_session=True)
    open("helper.pid", "w").write(str(helper.pid))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    """
    try:
        assert estimate(["python", script(workdir, "with_helper.py", body)], timeout_s=30).peak_bytes > 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int((workdir / "helper.pid").read_text()), signal.SIGKILL)


def test_error_output_that_is_not_utf8_is_read_all_the_same(workdir: Path) -> None:
    """It was a UnicodeDecodeError: in the server, after the estimate had been made."""
    latin1 = "import sys; sys.stderr.buffer.write(bytes([99, 97, 102, 233, 10])); sys.stderr.flush()"
    trains = tiny_script(workdir, "trains.py", 10)
    (workdir / trains).write_text(latin1 + "\n" + (workdir / trains).read_text())
    assert estimate(["python", trains]).peak_bytes > 0
    fails = script(workdir, "fails.py", latin1 + "; sys.exit(3)\n")
    with pytest.raises(EstimateError, match=r"the script exited with status 3 after 0 optimizer steps: caf\ufffd$"):
        estimate(["python", fails])


def test_a_reason_printed_on_stdout_is_given_when_stderr_has_none(workdir: Path) -> None:
    prints = script(workdir, "prints.py", "import sys\nprint('loading')\nprint('data/x not found')\nsys.exit(1)\n")
    with pytest.raises(EstimateError, match=r"exited with status 1 after 0 optimizer steps: data/x not found$"):
        estimate(["python", prints])
    both = script(workdir, "both.py", "import sys\nprint('step 0')\nsys.exit('no labels')\n")
    with pytest.raises(EstimateError, match=r"exited after 0 optimizer steps: no labels$"):  # stderr's comes first
        estimate(["python", both])
    bar = "".join(f"\rloading {i * 20}%|{'#' * i:5}| {i}/5" for i in range(5))  # tqdm's, on stderr
    loads = script(workdir, "loads.py", f"import sys\nsys.stderr.write({bar!r})\nprint('no /data/x')\nsys.exit(1)\n")
    with pytest.raises(EstimateError, match=r"exited with status 1 after 0 optimizer steps: no /data/x$"):
        estimate(["python", loads])  # was "loading 80%|#### | 4/5"


def test_a_script_failing_before_its_training_is_captured_once(workdir: Path) -> None:
    """Nothing is skipped before the first model call: a capture computing every value would fail the same
    way, and the user waited for both (bad arguments, a missing data file, no GPU)."""
    fails = script(workdir, "fails.py", "import torch\nopen('runs', 'a').write('ran\\n')\nopen('data/x.csv')\n")
    with pytest.raises(EstimateError, match=r"crashed after 0 optimizer steps: FileNotFoundError: .*data/x\.csv"):
        estimate(["python", fails])
    assert (workdir / "runs").read_text() == "ran\n"


def test_a_very_long_reason_is_cut_to_a_line(workdir: Path) -> None:
    """A 65 KB exception message was the whole error line."""
    long = script(workdir, "long.py", "raise ValueError('x' * 70_000)\n")
    with pytest.raises(EstimateError) as failed:
        estimate(["python", long])
    assert str(failed.value).startswith("the script crashed after 0 optimizer steps: ValueError: xxx")
    assert len(str(failed.value)) < 600
    says = script(workdir, "says.py", "import sys\nsys.exit('z' * 70_000)\n")
    with pytest.raises(EstimateError, match=r"^the script exited after 0 optimizer steps: z{499}…$"):
        estimate(["python", says])
    died = script(
        workdir, "died.py", "import os, sys\nsys.stderr.write('y' * 70_000 + '\\n')\nsys.stderr.flush()\nos._exit(4)\n"
    )
    with pytest.raises(EstimateError, match=r"^the estimating process died \(exit status 4\): y{499}…$"):
        estimate(["python", died])


def test_the_device_constants_are_the_asking_processs_not_the_jobs_environments(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server captures a task with its owner's environment, which has no CARMA_HOME: the capture read
    the owner's calibration (or none) where the server's was meant, and the cache kept the result."""
    monkeypatch.setenv("CARMA_HOME", str(workdir / "home"))
    (workdir / "home").mkdir()
    (workdir / "home" / "devices.toml").write_text(
        '["a100-40gb"]\ncontext_bytes = 104857600\ntotal_bytes = 42949672960\nsource = "calibrated"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir)}  # the job's: no CARMA_HOME
    result = estimate_script(["python", tiny_script(workdir, "t.py", 10)], "horus", "A100-40GB", env=env)
    assert (result.device, result.breakdown.context) == ("a100-40gb", 100 * MIB)  # any case names the device


def test_a_result_swapped_for_a_link_or_a_fifo_is_no_result(tmp_path: Path) -> None:
    """The capture's folder is the job owner's (the child runs as them) and a root daemon reads the result
    from it: a link there must not be followed (to any file root can read), nor a FIFO waited on."""
    secret = tmp_path / "secret"
    secret.write_text('{"estimate": "not the child\'s"}')
    (tmp_path / "link.json").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "real.json").write_text('{"error": "x"}')
    assert _read_result(tmp_path / "link.json") is None and _read_result(tmp_path / "fifo.json") is None
    assert _read_result(tmp_path / "none.json") is None
    assert _read_result(tmp_path / "real.json") == '{"error": "x"}'


def test_a_summary_forward_before_training_changes_nothing(workdir: Path) -> None:
    """Scripts often print a model summary first (torchsummary, torchinfo: a forward pass of a tiny batch);
    the captured batch is still the training batch and the estimate is the same."""
    train = script(workdir, "train.py", MLP_SCRIPT)
    argv = ["python", train, "--batch-size", "64", "--log", "steps.log"]
    assert estimate_script([*argv, "--summary"], "xmem", "test-gpu", estimator="batch_probe:estimate").peak_bytes == 64
    with_summary = estimate([*argv, "--summary"])
    assert with_summary.peak_bytes == reference(workdir, MLP_SCRIPT, *MLP_ARGV).peak_bytes and with_summary.notes == ()


def test_a_model_check_larger_than_the_training_batch_is_the_peak(workdir: Path) -> None:
    """A check of 65,536 samples with gradients on holds its activations (over 256 MiB) until its outputs
    are dropped, on the GPU, whose caching allocator keeps them reserved: more than training at 64 takes."""
    train = script(workdir, "train.py", MLP_SCRIPT)
    with_check = estimate(["python", train, *MLP_ARGV, "--check", "65536"])
    assert with_check.peak_bytes > reference(workdir, MLP_SCRIPT, *MLP_ARGV).peak_bytes + 256 * MIB


# A model check of 256 samples before training at 128, as the script's argument says (0: none).
CHECKED_SCRIPT = """
import sys, torch
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(256, 12288).to(device)
if int(sys.argv[1]):
    model(torch.randn(int(sys.argv[1]), 256, device=device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    optimizer.zero_grad()
    model(torch.randn(128, 256, device=device)).square().mean().backward()
    optimizer.step()
"""


def test_a_model_check_never_lowers_the_estimate(workdir: Path) -> None:
    """The check leaves a 12 MiB segment cached, where training's 6 MiB activations pack (46 MiB reserved in
    all) that alone open a 20 MiB segment each (54 MiB): the replay with the check is the smaller, and the
    estimate is the larger of the two, the script's without its check."""
    train = script(workdir, "train.py", CHECKED_SCRIPT)
    assert estimate(["python", train, "256"]).peak_bytes == estimate(["python", train, "0"]).peak_bytes


def test_a_module_called_in_another_thread_leaves_the_capture_alone(workdir: Path) -> None:
    """A background thread inside a module's forward (a transform of a prefetching thread) while the loop
    trains: module calls are tracked per thread, so the training loop is captured as without it."""
    blocked = """import threading
class Blocked(torch.nn.Module):
    def forward(self, x):
        entered.set()
        threading.Event().wait()
        return x
entered = threading.Event()
threading.Thread(target=Blocked(), args=(torch.zeros(1),), daemon=True).start()
entered.wait()
model = model.to(device)"""
    threaded = script(workdir, "threaded.py", MLP_SCRIPT.replace("model = model.to(device)", blocked))
    assert estimate(["python", threaded, *MLP_ARGV]).peak_bytes == reference(workdir, MLP_SCRIPT, *MLP_ARGV).peak_bytes


def test_an_executable_python_script_is_captured_as_run_by_python(workdir: Path) -> None:
    train = tiny_script(workdir, "train.py", 5)
    (workdir / train).write_text("#!/usr/bin/env python3\n" + (workdir / train).read_text())
    assert estimate([f"./{train}"]).peak_bytes > 0


def test_the_capture_hides_cuda_and_records_no_experiment_run(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")
    seen = 'import os; open("env", "w").write(os.environ["WANDB_MODE"] + os.environ["CUDA_VISIBLE_DEVICES"])'
    estimate(["python", tiny_script(workdir, "env.py", 5, seen)])
    assert (workdir / "env").read_text() == "disabled"  # and CUDA_VISIBLE_DEVICES empty


def test_script_as_a_module(workdir: Path) -> None:
    script(workdir, "trainmod.py", MLP_SCRIPT)
    result = estimate(["python3", "-u", "-m", "trainmod", "--log", "steps.log"])
    assert result.peak_bytes > 300 * MIB
    assert len((workdir / "steps.log").read_text().splitlines()) == 2


def test_python_c_runs_its_code_as_a_script(workdir: Path) -> None:
    by_c = estimate(["python", "-c", MLP_SCRIPT, *MLP_ARGV])
    assert by_c.peak_bytes == reference(workdir, MLP_SCRIPT, *MLP_ARGV).peak_bytes
    with pytest.raises(EstimateError, match="`python -c` needs the code to run"):
        estimate(["python", "-c"])


def test_script_that_never_steps_is_a_clear_error(workdir: Path) -> None:
    train = script(
        workdir,
        "nostep.py",
        """
        import torch
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        print("done without a step")
        """,
    )
    with pytest.raises(EstimateError, match="never reached an optimizer step; the capture needs 3 training steps"):
        estimate(["python", train])
    by_hand = script(
        workdir,
        "by_hand.py",
        """
        import torch
        model = torch.nn.Linear(4, 2)
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        """,
    )
    with pytest.raises(EstimateError, match=r"each a torch\.optim optimizer's step\(\) \(weights updated by hand"):
        estimate(["python", by_hand])
    helps = script(workdir, "helps.py", "import argparse\nargparse.ArgumentParser().parse_args()\n")
    with pytest.raises(EstimateError, match=r"^the script exited \(status 0\) before its first optimizer step"):
        estimate(["python", helps, "--help"])  # it said the script never reached one


def test_a_script_training_tensors_no_module_holds_is_stopped_and_told_why(workdir: Path) -> None:
    """The capture finds the model and where training begins by module calls: a loop stepping bare tensors
    is stopped after ten times the steps asked, not left to train for the whole timeout."""
    train = script(
        workdir,
        "bare.py",
        """
        import torch
        w = torch.randn(64, 64, requires_grad=True)
        optimizer = torch.optim.SGD([w], lr=0.1)
        for step in range(100000):
            optimizer.zero_grad()
            (torch.randn(8, 64) @ w).pow(2).mean().backward()
            optimizer.step()
            with open("steps.log", "a") as log:
                log.write(f"{step}\\n")
        """,
    )
    with pytest.raises(EstimateError, match=r"took 30 optimizer steps without calling a torch\.nn\.Module with param"):
        estimate(["python", train])
    assert len((workdir / "steps.log").read_text().splitlines()) == 29  # the 30th is stopped inside its step


def test_a_module_trained_by_hand_in_a_long_loop_is_stopped_and_told_why(workdir: Path) -> None:
    """A loop of backward passes that never calls an optimizer's step trained under the profiler until the
    capture's timeout (900 s), then said only that it did not reach its steps: it is stopped after
    `BACKWARDS_WITHOUT_STEP` backward passes, with the reason."""
    train = script(
        workdir,
        "by_hand_long.py",
        """
        import os, torch
        model = torch.nn.Linear(16, 4)
        for step in range(1000000):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            if step % 2:
                grads = torch.autograd.grad(loss, list(model.parameters()))
            else:
                loss.backward()
                grads = [p.grad for p in model.parameters()]
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= 0.01 * g
            with open("steps.log", "a") as log:
                log.write(f"{os.getpid()}\\n")
        """,
    )
    with pytest.raises(EstimateError, match=rf"ran {BACKWARDS_WITHOUT_STEP} backward passes without an optimizer st"):
        estimate(["python", train], timeout_s=120)
    # each capture (the fast one, and the one computing every value: a step skipped on a value it left out
    # would look the same) is stopped inside its 256th backward pass
    per_capture = collections.Counter((workdir / "steps.log").read_text().split())
    assert set(per_capture.values()) == {BACKWARDS_WITHOUT_STEP - 1}


def test_lbfgs_is_estimated_by_xmem_with_a_note_on_its_growing_history(workdir: Path) -> None:
    """L-BFGS fills a history of parameter-sized vectors over many iterations, more than a capture's few
    steps see: the note bounds what later steps may add. FakeTensor cannot run its step, which branches on
    the loss's value, and says so in one line."""
    lbfgs = script(
        workdir,
        "lbfgs.py",
        """
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        optimizer = torch.optim.LBFGS(model.parameters(), history_size=10)
        x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        for step in range(50):
            optimizer.step(closure)
        """,
    )
    estimated = registered(["python", lbfgs])
    parameters = (256 * 512 + 512 + 512 * 10 + 10) * 4
    assert estimated.breakdown.parameters >= parameters
    assert estimated.notes == (
        "LBFGS keeps up to 10 pairs of parameter-sized vectors, filled over its first iterations: later steps "
        f"than those captured may hold up to {20 * parameters / 2**20:,.1f} MiB more optimizer state",
    )
    with pytest.raises(EstimateError, match=r"^faketensor runs the job on fake tensors, which have no values, and"):
        registered(["python", lbfgs], "faketensor")
    as_job = estimate_job("jobs:lbfgs", "xmem", "a100-40gb")  # was "LBFGS.step() missing ... 'closure'"
    # Not the same peak to the byte: the uncomputed values decide how many inner iterations L-BFGS runs.
    assert (as_job.breakdown.parameters, as_job.notes) == (estimated.breakdown.parameters, estimated.notes)


AMP_SCRIPT = """
import sys, torch
overflow = "--overflow" in sys.argv
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
optimizer = torch.optim.Adam(model.parameters())
scaler = torch.amp.GradScaler("cpu")
for step in range(20):
    for micro in range(2):  # gradient accumulation
        x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y) / 2
        scaler.scale(loss).backward()
    if overflow:  # what uncomputed values often hold, and what an fp16 run's first steps meet
        for p in model.parameters():
            p.grad.fill_(float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
"""


def test_mixed_precision_steps_are_captured_whatever_the_gradients_hold(workdir: Path) -> None:
    """GradScaler skips the optimizer steps whose gradients overflow; the capture skips the arithmetic, so
    its gradients may hold anything: it still reaches its steps, and the estimate is the same."""
    train = script(workdir, "amp.py", AMP_SCRIPT)
    assert estimate(["python", train, "--overflow"]).peak_bytes == estimate(["python", train]).peak_bytes


# Skips the step when the gradient norm is not finite, as many training loops do (and clipping can refuse it).
GUARDED_SCRIPT = """
import math, torch
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                            torch.nn.ReLU(), torch.nn.Linear(4096, 10))
optimizer = torch.optim.AdamW(model.parameters())
for step in range(20):
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    if not torch.isfinite(norm) or math.isnan(loss.item()):
        continue
    optimizer.step()
"""


def test_a_script_asking_for_input_fails_at_once_and_says_why(workdir: Path) -> None:
    """Its prompt hidden with its output, it waited on the terminal until the capture's timeout (15 min)."""
    train = tiny_script(workdir, "asks.py", 5, 'input("resume from the checkpoint? [y/N] ")')
    with pytest.raises(EstimateError, match=r"EOFError: .* \(the capture gives the script no input: let it run wit"):
        estimate(["python", train], timeout_s=60)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_loop_that_skips_non_finite_steps_is_captured_computing_its_values(workdir: Path, refuse: bool) -> None:
    """The skipped arithmetic leaves its outputs uninitialised, NaNs and infinities among them: this loop
    never stepped ("never reached an optimizer step"), or its clipping crashed. It is captured again
    computing them (the next test checks the note on a script that fails every time)."""
    train = script(
        workdir, "guarded.py", GUARDED_SCRIPT.replace("error_if_nonfinite=True", f"error_if_nonfinite={refuse}")
    )
    estimated = estimate(["python", train])
    parameters = (1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10) * 4
    assert estimated.breakdown.optimizer_state >= 2 * parameters
    assert estimated.notes in ((), (COMPUTED_NOTE,))  # () if what the memory held happened to be finite


def test_a_script_checking_a_product_is_captured_again_computing_it_and_says_so(workdir: Path) -> None:
    """A product's value, compared with the same sum computed elementwise (arithmetic the capture keeps),
    is never right with the product skipped: the first capture always fails, the second computes it."""
    check = "assert torch.allclose(x @ w, (x[:, :, None] * w[None]).sum(1), atol=1e-4), 'product mismatch'"
    body = f"""
    import torch
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    for step in range(5):
        {check}
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    """
    estimated = estimate(["python", script(workdir, "checks.py", body)])
    assert estimated.notes == (COMPUTED_NOTE,) and estimated.breakdown.parameters >= 10 * 4


VALUE_SHAPED_SCRIPT = """
import torch
model = torch.nn.Linear(64, 1024)
head = torch.nn.Linear(1, 64)
optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
torch.manual_seed(0)
batch = torch.randn(256, 64)
for step in range(10):
    h = model(batch)
    {select}
    loss = head(selected.unsqueeze(1)).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize(
    "select",
    [
        "selected = h[h > 0]",  # about half of h: 32 MiB of head's output in the real run
        "try:\n        selected = h[h > 0]\n    except RuntimeError:\n        selected = h.flatten()[:8]",  # caught
    ],
)
def test_shapes_set_by_uncomputed_values_are_captured_computing_them(workdir: Path, select: str) -> None:
    """The skipped product left h uninitialised, so the mask picked what chance gave (nearly nothing):
    the estimate was hundreds of MiB short, without a note."""
    train = script(workdir, "masked.py", VALUE_SHAPED_SCRIPT.format(select=select))
    result = estimate(["python", train])
    assert result.notes[-1].startswith("the job's shapes depend on values the capture leaves uncomputed (nonzero")
    assert result.breakdown.activations > 30 * MIB  # head's output alone, 64 x ~131,000 floats: 32 MiB


DATA_MASK_SCRIPT = """
import torch
model = torch.nn.Linear(64, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(0)
batch, labels = torch.randn(256, 64), torch.randint(0, 8, (256,))
for step in range(10):
    keep = torch.bernoulli(torch.full((256,), 0.25)).bool()  # a masked-LM collator's masks, as drawn
    labels[~keep] = -100  # index_put_ with a boolean mask: nonzero
    x = batch[keep]  # masked indexing: nonzero
    loss = torch.nn.functional.cross_entropy(model(x), labels[keep], ignore_index=-100)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_boolean_masks_of_the_data_are_computed_without_redoing_the_capture(workdir: Path) -> None:
    """A masked-LM collator's boolean masks (drawn outside the model, from computed values) sent the whole
    capture down the path computing every value: BERT-base's masked LM took 493 s instead of 20."""
    train = script(workdir, "collated.py", DATA_MASK_SCRIPT)
    result = estimate_script(["python", train], "xmem", "test-gpu", estimator="batch_probe:estimate")
    assert not [note for note in result.notes if "computing" in note]  # VALUES_NOTE, COMPUTED_NOTE
    assert 32 < result.peak_bytes < 96  # the batch the mask kept: about a quarter of 256 rows, not by chance


def test_the_skipped_products_refuse_shapes_as_cuda_does() -> None:
    from carma.estimate.kernels import value_free_arithmetic

    with value_free_arithmetic():
        assert torch.mm(torch.randn(4, 8), torch.randn(8, 3)).shape == (4, 3)
        with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(4x20 and 30x5\)$"):
            torch.nn.functional.linear(torch.randn(4, 20), torch.randn(5, 30), torch.randn(5))
        with pytest.raises(RuntimeError, match=r"^Expected size for first two dimensions of batch2 tensor"):
            torch.bmm(torch.randn(2, 4, 20), torch.randn(2, 30, 5))


def test_a_shape_bug_crashes_the_capture_as_it_crashes_the_script(workdir: Path) -> None:
    """A product of mismatched shapes was allocated at the shape of its operands' ends: under no_grad the
    capture returned an estimate of a script that crashes; else the backward reported a confusing error."""
    train = tiny_script(workdir, "bug.py", 5, "with torch.no_grad(): torch.randn(3, 4) @ torch.randn(7, 3)")
    with pytest.raises(EstimateError, match=r"crashed after 1 optimizer step: .*shapes cannot be multiplied \(3x4"):
        estimate(["python", train])


def test_cuda_mixed_precision_runs_as_cpu_autocast_and_says_so(workdir: Path) -> None:
    """Without CUDA, `torch.autocast("cuda")` would turn itself off and leave the job in float32: the capture
    runs it as CPU autocast (float16, CUDA's default) and notes it. Half precision is two bytes in either
    dtype, so the estimate is that of the same job under CPU autocast in bfloat16 (AMP_SCRIPT), which
    runs as written, without a note; so is one whose CUDA autocast is turned off (and so differs)."""
    cuda_amp = AMP_SCRIPT.replace('torch.autocast("cpu", dtype=torch.bfloat16)', 'torch.autocast("cuda")')
    emulated = registered(["python", script(workdir, "cuda_amp.py", cuda_amp)])
    assert len(emulated.notes) == 1 and "CUDA autocast (mixed precision) ran as CPU autocast" in emulated.notes[0]
    as_written = registered(["python", script(workdir, "amp.py", AMP_SCRIPT)])
    assert as_written.notes == () and as_written.peak_bytes == emulated.peak_bytes
    turned_off = cuda_amp.replace('torch.autocast("cuda")', 'torch.autocast("cuda", enabled=False)')
    full = registered(["python", script(workdir, "off.py", turned_off)])
    assert full.notes == () and full.breakdown.activations != emulated.breakdown.activations


@pytest.mark.parametrize("method", ["faketensor", "horus", "gpumemnet"])
def test_a_baseline_says_it_leaves_the_mixed_precision_out(workdir: Path, method: str) -> None:
    """The baselines run the model anew, without the script's autocast: their estimate is that of the job
    in float32, and the note says so rather than that the mixed precision was followed."""
    as_written = 'torch.autocast("cpu", dtype=torch.bfloat16)'
    for device, used in (("cuda", "CUDA autocast"), ("cpu", "CPU autocast")):
        mixed = AMP_SCRIPT.replace(as_written, f'torch.autocast("{device}")')
        off = AMP_SCRIPT.replace(as_written, f'torch.autocast("{device}", enabled=False)')
        in_mixed = registered(["python", script(workdir, f"amp_{device}.py", mixed)], method)
        in_float32 = registered(["python", script(workdir, f"amp_{device}_off.py", off)], method)
        assert in_mixed.peak_bytes == in_float32.peak_bytes and in_float32.notes == ()
        left_out = f"{method} counts activations in float32: it leaves out the job's mixed precision ({used}), "
        assert in_mixed.notes == (left_out + "which xmem follows",)


# Writes the dtypes autocast gives a matrix product, a softmax, a layer norm and a sum, as `torch.autocast`
# is spelled in scripts: for the device they run on, or for CUDA.
AUTOCAST_DTYPES = """
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(64, 64).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(8, 64, device=device)
    with torch.autocast(device_type=DEVICE, dtype=torch.float16):
        h = model(x)
        seen = [h, torch.softmax(h, -1), torch.nn.functional.layer_norm(h, (64,)), h.sum(), h.sum(dtype=torch.float16)]
    open("dtypes", "w").write(" ".join(str(t.dtype) for t in seen))
    optimizer.zero_grad()
    seen[1].sum().backward()
    optimizer.step()
"""


@pytest.mark.parametrize("device", ["device", '"cuda"'])
def test_autocast_casts_on_the_cpu_as_cuda_autocast_does(workdir: Path, device: str) -> None:
    """CPU autocast alone would keep the softmax, the norm and the sum in float16; CUDA's computes them in
    float32 (unless the call names a dtype), and their outputs take twice the bytes."""
    estimate(["python", script(workdir, "dtypes.py", AUTOCAST_DTYPES.replace("DEVICE", device))])
    assert (workdir / "dtypes").read_text().split() == [
        "torch.float16", "torch.float32", "torch.float32", "torch.float32", "torch.float16"
    ]  # fmt: skip


def test_the_operators_cast_to_float32_are_all_those_cuda_autocast_is_tested_for() -> None:
    """PyTorch's own autocast tests list the operators CUDA autocast must run in float32; read from their
    source (importing it needs test-only packages), each must be in the capture's list."""
    import ast
    import importlib.util

    from carma.estimate.kernels import CUDA_FLOAT32_OPERATORS

    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    if spec is None or spec.origin is None:
        pytest.skip("this PyTorch ships no autocast test lists")
    tree = ast.parse(Path(spec.origin).read_text())
    (cuda_lists,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AutocastTestLists"]
    tested = {
        entry.elts[0].value
        for node in ast.walk(cuda_lists)
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in ("self.torch_fp32", "self.nn_fp32")
        for entry in node.value.elts
    }
    assert len(tested) > 40 and tested <= set(CUDA_FLOAT32_OPERATORS)


def test_a_compiled_model_is_captured_as_it_runs_eagerly(workdir: Path) -> None:
    """torch.compile on the CPU would build CPU kernels, not the GPU ones the job runs, and take minutes:
    the capture runs the model eagerly (the compiler's backend is never called) and estimates it as such."""
    compiled = script(workdir, "compiled.py", MLP_SCRIPT.replace("model = model.to(device)", COMPILE))
    eager, as_compiled = reference(workdir, MLP_SCRIPT, *MLP_ARGV), estimate(["python", compiled, *MLP_ARGV])
    assert as_compiled.peak_bytes == eager.peak_bytes
    assert not (workdir / "compiled").exists()
    assert eager.notes == ()
    (note,) = as_compiled.notes  # the estimate says the GPU run will differ
    assert "torch.compile was left eager" in note and "CUDA graphs" not in note


def test_compiling_with_cuda_graphs_is_noted_and_a_disabled_compile_is_not(workdir: Path) -> None:
    """CUDA graphs (mode="reduce-overhead", here through the decorator) keep their own memory pool on the
    GPU, which the eager capture cannot see: the note says so. `disable=True` compiles nothing."""
    loss = "torch.nn.functional.cross_entropy(model(x), y)"
    decorated = MLP_SCRIPT.replace(
        "for step in range(50):",
        f"@torch.compile(mode='reduce-overhead')\ndef loss_of(x, y):\n    return {loss}\nfor step in range(50):",
    ).replace(f"    {loss}.backward()", "    loss_of(x, y).backward()")
    argv = ["--log", "steps.log"]
    (note,) = estimate(["python", script(workdir, "graphs.py", decorated), *argv]).notes
    assert "torch.compile was left eager" in note and "CUDA graphs (reduce-overhead)" in note
    disabled = MLP_SCRIPT.replace("model = model.to(device)", "model = torch.compile(model.to(device), disable=True)")
    assert estimate(["python", script(workdir, "disabled.py", disabled), *argv]).notes == ()


def test_a_model_called_through_forward(workdir: Path) -> None:
    """`model.forward(x)` fires its children's hooks, not the model's: xMem, which reads the trace, gives the
    same peak; the baselines, which need the whole model, say why they cannot."""
    direct = script(workdir, "direct.py", MLP_SCRIPT.replace("model(x)", "model.forward(x)"))
    assert estimate(["python", direct, *MLP_ARGV]).peak_bytes == reference(workdir, MLP_SCRIPT, *MLP_ARGV).peak_bytes
    with pytest.raises(EstimateError, match=r"trains parameters outside the Linear .*model.forward\(x\)"):
        estimate_script(["python", direct, *MLP_ARGV], "horus", "a100-40gb")


def test_a_step_given_a_closure_is_estimated_as_the_plain_loop(workdir: Path) -> None:
    """`optimizer.step(closure)` (PyTorch Lightning, L-BFGS) runs zero_grad, forward and backward inside the
    step, where the model is first called: they are told from the update, and the estimate is the plain
    loop's."""
    loss = "torch.nn.functional.cross_entropy(model(x), y)"
    plain = f"    optimizer.zero_grad()\n    {loss}.backward()\n    optimizer.step()"
    assert plain in MLP_SCRIPT
    closure = (
        f"    def closure():\n        optimizer.zero_grad()\n        loss = {loss}\n"
        "        loss.backward()\n        return loss\n    optimizer.step(closure)"
    )
    closed = script(workdir, "closure.py", MLP_SCRIPT.replace(plain, closure))
    by_closure, by_loop = estimate(["python", closed, *MLP_ARGV]), reference(workdir, MLP_SCRIPT, *MLP_ARGV)
    assert by_closure.peak_bytes == by_loop.peak_bytes
    assert by_closure.breakdown.gradients == by_loop.breakdown.gradients
    assert by_closure.breakdown.optimizer_state == by_loop.breakdown.optimizer_state


# A small BERT fine-tuned by Hugging Face's Trainer (through Accelerate), and the same training as a plain loop.
TINY_BERT = """
import torch
from transformers import BertConfig, BertForSequenceClassification
config = BertConfig(vocab_size=4000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
model = BertForSequenceClassification(config)
"""
TRAINER_SCRIPT = (
    TINY_BERT
    + """
from transformers import Trainer, TrainingArguments
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return {"input_ids": torch.randint(0, 4000, (64,)), "labels": torch.tensor(i % 2)}
args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, optim="adamw_torch_fused", report_to=[],
                         save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Data()).train()
"""
)
LOOP_SCRIPT = (
    TINY_BERT
    + """
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
for _ in range(16):
    batch = {"input_ids": torch.randint(0, 4000, (16, 64)), "labels": torch.randint(0, 2, (16,))}
    model(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""
)


def test_a_hugging_face_trainer_script_is_estimated_as_its_plain_loop(workdir: Path) -> None:
    """Trainer steps an Accelerate wrapper around a fused AdamW, feeds batches through its own data
    loader and clips gradients: the capture finds the model, the batch and the optimizer all the same."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    trainer = reference(workdir, TRAINER_SCRIPT)
    loop = estimate(["python", script(workdir, "loop.py", LOOP_SCRIPT)])
    assert trainer.peak_bytes == loop.peak_bytes
    assert trainer.breakdown.parameters == loop.breakdown.parameters
    assert trainer.breakdown.optimizer_state == loop.breakdown.optimizer_state >= 2 * loop.breakdown.parameters


def test_a_trainer_in_mixed_precision_is_estimated_in_it(workdir: Path) -> None:
    """Without a GPU, `TrainingArguments(bf16=True)` refuses to start and Accelerate trains `fp16=True` in
    float32; the capture lets both run CPU autocast (cast as CUDA casts) and says so."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    full = reference(workdir, TRAINER_SCRIPT)
    for precision, library in (("bf16", "Hugging Face Trainer"), ("fp16", "Accelerate")):
        mixed = TRAINER_SCRIPT.replace("disable_tqdm=True)", f"disable_tqdm=True, {precision}=True)")
        estimated = registered(["python", script(workdir, f"{precision}.py", mixed)])
        emulated = f"{library}'s mixed precision, which it runs only on a GPU, ran as CPU autocast casting as CUDA"
        assert len(estimated.notes) == 1 and estimated.notes[0].startswith(emulated), precision
        assert estimated.breakdown.activations < full.breakdown.activations, precision


# MLP_SCRIPT without its fall-back: CUDA named throughout, and the weights loaded from a checkpoint that
# was saved on a GPU.
CUDA_SCRIPT = (
    MLP_SCRIPT.replace(
        'device = "cuda" if torch.cuda.is_available() else "cpu"', 'torch.cuda.set_device(0)\ndevice = "cuda"'
    )
    .replace("model = model.to(device)", 'model = model.cuda()\nmodel.load_state_dict(torch.load("gpu.pt"))')
    .replace("optimizer.step()", "optimizer.step()\n    torch.cuda.synchronize()")
)


def test_a_script_that_names_cuda_is_estimated_as_its_cpu_fallback(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`.cuda()`, `device="cuda"`, `torch.cuda.synchronize()` and a GPU checkpoint run on the CPU, where the
    falling-back script puts the same tensors: same estimate, and a note saying what was asked of CUDA."""
    from torch import serialization

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(512, 10)
    )
    with monkeypatch.context() as saving_on_a_gpu:
        saving_on_a_gpu.setattr(serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(model.state_dict(), workdir / "gpu.pt")
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(workdir / "gpu.pt")
    fallback = reference(workdir, MLP_SCRIPT, *MLP_ARGV)
    named = estimate(["python", script(workdir, "named.py", CUDA_SCRIPT), *MLP_ARGV])
    assert (named.peak_bytes, named.breakdown) == (fallback.peak_bytes, fallback.breakdown)
    asked = ["torch.cuda.set_device()", ".cuda()", 'device="cuda"', "torch.cuda.synchronize()"]
    assert named.notes == (cuda_on_cpu.NOTE.format(", ".join(asked)),) and fallback.notes == ()
    assert "step 1 on cuda" in (workdir / "steps.log").read_text()


# A dataset of 16 MiB loaded onto the GPU whole before training, its batches drawn at random (copies).
CUDA_DATA_SCRIPT = """
import torch
X = torch.randn(16384, 256, device=DEVICE)
Y = torch.randint(0, 10, (16384,), device=DEVICE)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(DEVICE)
optimizer = torch.optim.Adam(model.parameters())
for step in range(50):
    i = torch.randint(0, 16384, (64,), device=DEVICE)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(X[i]), Y[i]).backward()
    optimizer.step()
"""


def test_data_put_on_cuda_before_training_is_counted_by_xmem_and_named_by_the_baselines(workdir: Path) -> None:
    """Made before the profiler starts, the dataset was in no trace, and the estimate fell 16 MiB short of
    a GPU run that holds it throughout; on the CPU (where a falling-back script keeps it) nothing is added."""
    on_cuda = script(workdir, "on_cuda.py", CUDA_DATA_SCRIPT.replace("DEVICE", '"cuda"'))
    on_cpu = script(workdir, "on_cpu.py", CUDA_DATA_SCRIPT.replace("DEVICE", '"cpu"'))
    counted, without = registered(["python", on_cuda]), registered(["python", on_cpu])
    data = 16384 * 256 * 4 + 16384 * 8
    assert counted.breakdown.activations - without.breakdown.activations == data
    assert counted.notes[1:] == (
        "the 16.1 MiB the job put on CUDA before training and holds (its data, say) are counted as on the GPU for "
        "the whole run",
    )
    assert without.notes == ()
    baseline = registered(["python", on_cuda], "faketensor")
    assert baseline.notes[1:] == (
        "faketensor leaves out the 16.1 MiB the job put on CUDA before training and holds (its data, say), which "
        "xmem counts",
    )


# A GAN on CUDA whose noise, made at each iteration's top, is the generator's input.
GAN_NOISE_SCRIPT = """
import torch
G = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 256)).to(DEVICE)
D = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)).to(DEVICE)
g_opt, d_opt = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for step in range(50):
    z, real = torch.randn(4096, 256, device=DEVICE), torch.randn(4096, 256, device=DEVICE)
    d_loss = D(G(z).detach()).mean() - D(real).mean()
    d_opt.zero_grad(); d_loss.backward(); d_opt.step()
    g_loss = -D(G(z)).mean()
    g_opt.zero_grad(); g_loss.backward(); g_opt.step()
"""


def test_a_generators_noise_made_before_the_first_model_call_is_not_taken_for_data_on_the_gpu(workdir: Path) -> None:
    """The capture's own record of the generator's first call kept the first iteration's noise alive: it was
    counted as data held for the whole run (4 MiB here), with the note saying so."""
    on_cuda = script(workdir, "gan_cuda.py", GAN_NOISE_SCRIPT.replace("DEVICE", '"cuda"'))
    on_cpu = script(workdir, "gan_cpu.py", GAN_NOISE_SCRIPT.replace("DEVICE", '"cpu"'))
    counted, without = registered(["python", on_cuda]), registered(["python", on_cpu])
    assert counted.breakdown == without.breakdown and counted.peak_bytes == without.peak_bytes
    assert not [note for note in counted.notes if "before training" in note]


MEMORY_LOGGING = {  # the script's edits, and the calls the note names
    "logging": (  # statistics read 0 without CUDA; their resets and the summary would fail
        [
            (
                "    optimizer.step()\n",
                "    optimizer.step()\n    print(torch.cuda.max_memory_allocated(), torch.cuda.memory_summary())\n"
                "    torch.cuda.reset_max_memory_allocated()\n    torch.cuda.reset_accumulated_memory_stats()\n",
            )
        ],
        ["memory_summary", "reset_max_memory_allocated", "reset_accumulated_memory_stats"],
    ),
    "debugging": (  # recording the history failed ("torch._C has no attribute ..."), the cap "not compiled"
        [
            (
                "optimizer = ",
                "torch.cuda.set_per_process_memory_fraction(0.9)\n"
                "torch.cuda.memory._record_memory_history(max_entries=100000)\noptimizer = ",
            ),
            (
                "    optimizer.step()\n",
                "    optimizer.step()\n    torch.cuda.memory._dump_snapshot('snapshot.pickle')\n"
                "    assert torch.cuda.memory._snapshot()['segments'] == torch.cuda.memory_snapshot() == []\n",
            ),
        ],
        [
            "set_per_process_memory_fraction",
            "memory._record_memory_history",
            "memory._dump_snapshot",
            "memory._snapshot",
            "memory_snapshot",
        ],
    ),
}


@pytest.mark.parametrize("use", MEMORY_LOGGING)
def test_a_script_logging_or_debugging_its_cuda_memory_is_estimated_as_its_cpu_fallback(
    workdir: Path, use: str
) -> None:
    """The calls have nothing to act on without CUDA: they do nothing, read 0 or hold no segments, and the
    note names them."""
    edits, asked = MEMORY_LOGGING[use]
    fallback = reference(workdir, MLP_SCRIPT, *MLP_ARGV)
    edited = MLP_SCRIPT
    for old, new in edits:
        edited = edited.replace(old, new)
    logged = estimate(["python", script(workdir, f"{use}_memory.py", edited), *MLP_ARGV])  # not logging.py: stdlib's
    assert (logged.peak_bytes, logged.breakdown) == (fallback.peak_bytes, fallback.breakdown)
    assert logged.notes == (cuda_on_cpu.NOTE.format(", ".join(f"torch.cuda.{call}()" for call in asked)),)


@pytest.mark.parametrize(
    ("stop", "failure"),
    [
        (
            "assert torch.cuda.is_available()",
            "the script crashed after 0 optimizer steps: AssertionError at needs_gpu.py:2",
        ),
        (
            "if not torch.cuda.is_available():\n    sys.exit('this script needs a GPU')",
            "the script exited after 0 optimizer steps: this script needs a GPU",
        ),
        (
            "if not torch.cuda.is_available():\n    print('no GPU found')\n    sys.exit(1)",
            "the script exited with status 1 after 0 optimizer steps: no GPU found",  # printed: it was left out
        ),
    ],
)
def test_a_script_that_stops_without_cuda_is_told_why(workdir: Path, stop: str, failure: str) -> None:
    """None of these failures names CUDA, so the hint to fall back to the CPU was left out: the user saw
    a bare AssertionError, or an exit status and nothing else."""
    needs_gpu = script(workdir, "needs_gpu.py", f"import sys, torch\n{stop}\n")
    with pytest.raises(EstimateError) as failed:
        estimate(["python", needs_gpu])
    assert str(failed.value) == f"{failure} ({cuda_on_cpu.HIDDEN})"


@pytest.mark.parametrize(
    ("stop", "failure"),
    [
        (
            "p = argparse.ArgumentParser()\np.add_argument('--data', required=True)\np.parse_args()",
            "the script exited with status 2 after 0 optimizer steps: falls_back.py: error: the following arguments "
            "are required: --data",
        ),
        (
            "open('missing.csv')",
            "the script crashed after 0 optimizer steps: FileNotFoundError: [Errno 2] No such file or directory: "
            "'missing.csv' at falls_back.py:3",
        ),
        (
            "sys.exit('data/train.csv not found: run prepare.py first')",
            "the script exited after 0 optimizer steps: data/train.csv not found: run prepare.py first",
        ),
    ],
)
def test_a_script_that_falls_back_and_stops_for_another_reason_gets_no_hint_to_fall_back(
    workdir: Path, stop: str, failure: str
) -> None:
    """It had asked torch.cuda.is_available(), and was told to do what it already did."""
    text = f'import argparse, sys, torch\ndevice = "cuda" if torch.cuda.is_available() else "cpu"\n{stop}\n'
    with pytest.raises(EstimateError) as failed:
        estimate(["python", script(workdir, "falls_back.py", text)])
    assert str(failed.value) == failure


def test_a_failing_cuda_call_comes_with_the_hint_to_fall_back(workdir: Path) -> None:
    named = MLP_SCRIPT.replace("optimizer = ", "print(torch.cuda.get_device_name(0))\noptimizer = ")
    with pytest.raises(EstimateError, match=r"not compiled with CUDA.*let the job fall back to the CPU"):
        estimate(["python", script(workdir, "named.py", named), "--log", "steps.log"])


# MLP_SCRIPT's batches copied on a side stream, as a data prefetcher does, and each step timed by CUDA events.
PREFETCH_SCRIPT = MLP_SCRIPT.replace(
    """    x = torch.randn(args.batch_size, 256, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
""",
    """    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    side = torch.cuda.Stream()
    with torch.cuda.device(0), torch.cuda.stream(side):
        x = torch.randn(args.batch_size, 256).cuda(non_blocking=True)
        y = torch.randint(0, 10, (args.batch_size,)).cuda(non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    x.record_stream(torch.cuda.current_stream())
""",
).replace(
    "optimizer.step()",
    "optimizer.step()\n    end.record()\n    end.synchronize()\n    assert start.elapsed_time(end) > 0",
)


def test_a_script_with_cuda_streams_and_events_is_estimated_as_its_cpu_fallback(workdir: Path) -> None:
    """A prefetcher's side stream and CUDA-event timing run as the CPU's one stream: the same tensors, so
    the same estimate as the falling-back script, and the note names them."""
    fallback = reference(workdir, MLP_SCRIPT, *MLP_ARGV)
    streamed = estimate(["python", script(workdir, "streamed.py", PREFETCH_SCRIPT), *MLP_ARGV])
    assert (streamed.peak_bytes, streamed.breakdown) == (fallback.peak_bytes, fallback.breakdown)
    asked = ["torch.cuda.Event()", "torch.cuda.Stream()", "torch.cuda.device()", "torch.cuda.stream()", ".cuda()",
             "torch.cuda.current_stream()", ".record_stream()"]  # fmt: skip
    assert streamed.notes == (cuda_on_cpu.NOTE.format(", ".join(asked)),)


def test_a_job_function_that_names_cuda_is_captured_on_the_cpu(workdir: Path) -> None:
    capture = capture_job("jobs:on_cuda")
    assert capture.notes == (cuda_on_cpu.NOTE.format(".cuda()"),)
    on_cpu = estimate_xmem(capture_job("jobs:mlp"), 300 * MIB, "test-gpu")
    assert estimate_xmem(capture, 300 * MIB, "test-gpu").peak_bytes == on_cpu.peak_bytes


def test_cuda_is_kept_on_the_cpu_only_while_capturing(tmp_path: Path) -> None:
    from torch.overrides import _get_current_function_mode_stack

    load, synchronize, stream, generator = torch.load, torch.cuda.synchronize, torch.cuda.Stream, torch.Generator
    torch.save(torch.ones(2), tmp_path / "t.pt")
    with cuda_on_cpu.cuda_on_cpu() as requests:
        x = torch.zeros(2, device="cuda:0")
        assert x.to(0, torch.float16).device.type == "cpu" and x.cuda(non_blocking=True) is x
        assert torch.load(tmp_path / "t.pt", "cuda").device.type == "cpu"
        with torch.device("cuda"):
            assert torch.randn(2).device.type == "cpu"
        torch.set_default_device("cuda")
        try:
            assert torch.randn(2).device.type == "cpu"
        finally:
            torch.set_default_device(None)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        x.record_stream(side)
        with pytest.raises(RuntimeError, match="both events recorded"):
            torch.cuda.Event().elapsed_time(side.record_event())
        noise = torch.Generator(device="cuda").manual_seed(0)
        assert isinstance(noise, generator) and torch.randn(2, generator=noise, device="cuda").device.type == "cpu"
        assert torch.Generator().device.type == "cpu"
    requests.hold()
    assert [t is x for t in requests.held.values()] == [True]  # the one placed tensor still alive, for the estimate
    assert requests.asked == ['device="cuda"', '.to("cuda")', ".cuda()", 'torch.load(map_location="cuda")',
                     'torch.set_default_device("cuda")', "torch.cuda.synchronize()", "torch.cuda.Stream()",
                     ".record_stream()", "torch.cuda.Event()", 'torch.Generator(device="cuda")']  # fmt: skip
    assert (torch.load, torch.cuda.synchronize, torch.cuda.Stream, torch.Generator) == (
        load,
        synchronize,
        stream,
        generator,
    )
    assert "record_stream" not in vars(torch.Tensor) and not _get_current_function_mode_stack()


def test_the_library_checks_are_patched_only_while_capturing() -> None:
    training_args = pytest.importorskip("transformers.training_args")
    original = training_args.is_torch_bf16_gpu_available
    with libraries.mixed_precision_without_gpu() as used:
        assert training_args.is_torch_bf16_gpu_available() and used == ["Hugging Face Trainer"]
    assert training_args.is_torch_bf16_gpu_available is original


LOADER_SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(2048, 512), torch.randint(0, 10, (2048,)))
loader = DataLoader(data, batch_size=128, shuffle=True, LOADER)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.AdamW(model.parameters())
for epoch in range(3):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
"""


def test_batches_from_data_loader_workers_are_estimated_as_from_the_loop_itself(workdir: Path) -> None:
    """Worker processes (forked from the capture child, with its hooks) and pinned memory (off without
    CUDA) change nothing."""
    workers = LOADER_SCRIPT.replace("LOADER", "num_workers=2, pin_memory=True, persistent_workers=True")
    alone = LOADER_SCRIPT.replace("LOADER", "num_workers=0")
    by_workers = estimate(["python", script(workdir, "workers.py", workers)])
    assert by_workers.peak_bytes == estimate(["python", script(workdir, "alone.py", alone)]).peak_bytes
    assert by_workers.breakdown.optimizer_state >= 2 * by_workers.breakdown.parameters > 0


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "sizes", "moved"),
    [
        (11, 3, False, [3, 2, 3, 3], [(2, 3, True)]),  # the short batch second
        (10, 3, True, [3, 3, 3], []),  # no short batch
        (9, 3, False, [3, 3, 3], []),  # none either
        (2, 3, False, [2], []),  # no full one either
        (5, 3, False, [3, 2], [(2, 3, False)]),  # already second
        (7, 3, False, [3, 3, 1], [(1, 3, False)]),  # one sample: batch norm fails on it, as the GPU run would
    ],
)
def test_an_epochs_short_last_batch_is_sampled_second_while_capturing(
    samples: int, batch: int, drop_last: bool, sizes: list[int], moved: list[tuple[int, int, bool]]
) -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    from carma.estimate.epochs import captured_epochs

    sampler = BatchSampler(SequentialSampler(range(samples)), batch, drop_last)
    calls: list[tuple[int, int, bool]] = []
    seen = lambda short, full, moved: calls.append((short, full, moved))  # noqa: E731
    with captured_epochs(seen, ending=lambda: False, opened=lambda change: None, reorder=True):
        batches = list(sampler)
    assert [len(b) for b in batches] == sizes and calls == moved
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(flat)))  # each sample once
    assert [len(b) for b in sampler] == sorted(sizes, reverse=True)  # the script's own order again


def test_once_the_capture_has_its_steps_every_epoch_ends_after_two_batches() -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    from carma.estimate.epochs import captured_epochs

    ending, open_epochs = [False], [0]

    def opened(change: int) -> None:
        open_epochs[0] += change

    train, val = (BatchSampler(SequentialSampler(range(n)), 4, False) for n in (40, 30))
    with captured_epochs(lambda *_: None, lambda: ending[0], opened, reorder=True):
        epoch = iter(train)
        first = [next(epoch) for _ in range(3)]
        assert open_epochs == [1]
        ending[0] = True  # the capture has its steps
        assert list(epoch) == [] and open_epochs == [0]  # the epoch under way ends
        assert [len(b) for b in val] == [4, 2] and [len(b) for b in train] == [4, 4]  # the later ones after two
    assert [len(b) for b in first] == [4, 4, 4] and len(list(train)) == 10  # outside the capture: whole epochs


VALIDATED_SCRIPT = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
train = DataLoader(TensorDataset(torch.randn(1024, 512), torch.randint(0, 10, (1024,))), batch_size=64)
val = DataLoader(TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,))), batch_size=1024)
model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
optimizer = torch.optim.AdamW(model.parameters())
for epoch in range(int(sys.argv[1])):
    model.train()
    for x, y in train:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    for x, y in val:  # no torch.no_grad(): each batch's graph lives until the next batch's loss replaces it
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.item()
"""


def test_a_validation_pass_at_an_epochs_end_is_in_the_estimate(workdir: Path) -> None:
    """Once it had its steps, the capture stopped inside the first epoch: a validation pass that holds a batch's
    graph while computing the next (CARMA's UNet task: 9.9 GiB against 6 GiB in training) was never seen."""
    validated = script(workdir, "validated.py", VALIDATED_SCRIPT)
    unvalidated = script(workdir, "unvalidated.py", VALIDATED_SCRIPT.replace("for x, y in val:", "for x, y in []:"))
    with_pass, without = (estimate(["python", path, "2"]) for path in (validated, unvalidated))
    hidden = 1024 * 4096 * 4  # one validation batch's hidden activations, kept by its graph
    assert with_pass.peak_bytes >= without.peak_bytes + 2 * hidden
    assert with_pass.notes == without.notes == ()
    one_epoch = estimate(["python", validated, "1"])  # ends after that epoch: the pass ran, but after the last step
    assert one_epoch.peak_bytes == without.peak_bytes
    assert one_epoch.notes == (
        "the script ended after the epoch the capture ended (after 2 batches or more): what it does at an epoch's "
        "end (a validation pass, say) is not in the estimate (a script that trains two epochs or more has it "
        "captured)",
    )


def test_a_short_last_batch_is_trained_second_and_one_more_step_captured(workdir: Path) -> None:
    """The GPU run meets the epoch's short batch at every epoch's end; the capture trains it second and
    runs one step more, so it holds a full batch after a full one and one after the short one."""
    ragged = LOADER_SCRIPT.replace("LOADER", "num_workers=0").replace("torch.randn(2048", "torch.randn(2000")
    ragged = ragged.replace("(2048,)", "(2000,)").replace(
        "optimizer.step()", 'optimizer.step()\n        open("sizes.log", "a").write(f"{len(x)}\\n")'
    )
    result = estimate(["python", script(workdir, "ragged.py", ragged)])
    # stopped in the fifth step: the fourth, the last asked for, ended the epoch, and the next epoch's first ran
    assert (workdir / "sizes.log").read_text().split() == ["128", "80", "128", "128"]
    assert result.notes == (
        "each epoch's short last batch (80 samples, not 128) was trained second, so that the step after it, "
        "which the GPU run takes at every epoch's end, is captured (one step more)",
    )


@pytest.mark.parametrize("samples", [200, 129])
def test_an_epoch_of_one_full_batch_and_a_short_one_is_no_difference_in_inputs(workdir: Path, samples: int) -> None:
    """Its short batch is second already (or, of one sample, last): the inputs' note called it a padded
    batch, and told the user to train the largest batch first, which the capture had."""
    small = LOADER_SCRIPT.replace("LOADER", "num_workers=0").replace("2048", str(samples))
    result = estimate(["python", script(workdir, "small.py", small)])
    assert result.notes == ()


# Token sequences padded to the longest of each batch of four; LONG: the indices of the 512-token ones.
PADDED_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader
docs = [torch.randint(0, 1000, (512 if i in LONG else 32,)) for i in range(64)]
def pad(items):
    out = torch.zeros(len(items), max(len(x) for x in items), dtype=torch.long)
    for i, x in enumerate(items):
        out[i, : len(x)] = x
    return out
model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))
optimizer = torch.optim.AdamW(model.parameters())
for x in DataLoader(docs, batch_size=4, collate_fn=pad):
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize(("longs", "differ"), [(set(), ""), ({1}, "4×32, 4×512"), ({9}, "4×32, 4×512"), ({13}, "")])
def test_batches_of_different_shapes_among_those_captured_are_noted(
    workdir: Path, longs: set[int], differ: str
) -> None:
    """Batches padded to their longest item differ in length: the estimate holds for those captured (the
    first three), and when they already differ a note says a later, longer one needs more. A long batch
    after them (the fourth, {13}) goes unseen: the documented limit."""
    padded = script(workdir, "padded.py", PADDED_SCRIPT.replace("LONG", repr(longs)))
    result = estimate(["python", padded])
    if differ:
        assert result.notes == (
            f"the model's inputs differed between the 3 captured iterations ({differ}): batches padded to their "
            "longest item, or images of varying sizes, differ later too, and a larger batch than those captured "
            "needs more memory than this estimate (capture more with --steps, or train the largest batch first)",
        )
        assert (
            result.peak_bytes
            > estimate(["python", script(workdir, "short.py", PADDED_SCRIPT.replace("LONG", "{}"))]).peak_bytes
        )
    else:
        assert result.notes == ()


def test_a_loop_that_ends_its_epoch_at_a_short_batch_is_captured_in_order(workdir: Path) -> None:
    """Trained second, the short batch would end the script's only epoch after one step: the capture is made
    again in order, and is that of the same loop over full batches only."""
    one_epoch = LOADER_SCRIPT.replace("LOADER", "num_workers=0").replace("range(3)", "range(1)")
    breaks = one_epoch.replace("torch.randn(2048", "torch.randn(2000").replace("(2048,)", "(2000,)")
    breaks = breaks.replace(
        "    for x, y in loader:\n", "    for x, y in loader:\n        if len(x) < 128:\n            break\n"
    )
    in_order = estimate(["python", script(workdir, "breaks.py", breaks)])
    dropped = estimate(
        ["python", script(workdir, "dropped.py", breaks.replace("shuffle=True,", "shuffle=True, drop_last=True,"))]
    )
    assert in_order.notes == () and in_order.breakdown == dropped.breakdown


def test_a_loop_that_crashes_on_the_short_batch_it_never_meets_is_captured_in_order(workdir: Path) -> None:
    """A loop leaving each epoch early with tensors sized for the full batch never meets the short batch; the
    capture trains it second and crashed, blaming the script ("the script crashed after 1 optimizer step")."""
    sized = LOADER_SCRIPT.replace("LOADER", "num_workers=0").replace("torch.randn(2048", "torch.randn(2000")
    sized = sized.replace("(2048,)", "(2000,)").replace("for x, y in loader:", "for i, (x, y) in enumerate(loader):")
    sized = sized.replace(
        "        torch.nn.functional.cross_entropy(model(x), y).backward()\n",
        "        if i == 10:\n            break\n        (model(x) * torch.ones(128, 10)).sum().backward()\n",
    )
    in_order = estimate(["python", script(workdir, "sized.py", sized)])
    dropped = estimate(
        ["python", script(workdir, "dropped.py", sized.replace("shuffle=True,", "shuffle=True, drop_last=True,"))]
    )
    assert in_order.notes == () and in_order.breakdown == dropped.breakdown


# Six blocks of 2048 x 512 float32 activations (4 MiB each), with and without activation checkpointing.
CHECKPOINT_SCRIPT = """
import sys, torch
from torch import nn
from torch.utils.checkpoint import checkpoint
recompute = sys.argv[1] == "recompute"
device = "cuda" if torch.cuda.is_available() else "cpu"
blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU()) for _ in range(6))
head = nn.Linear(512, 10)
blocks, head = blocks.to(device), head.to(device)
optimizer = torch.optim.Adam([*blocks.parameters(), *head.parameters()])
for step in range(20):
    h, y = torch.randn(2048, 512, device=device), torch.randint(0, 10, (2048,), device=device)
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
    optimizer.zero_grad()
    nn.functional.cross_entropy(head(h), y).backward()
    optimizer.step()
"""


def test_activation_checkpointing_lowers_the_estimate_by_the_activations_it_recomputes(workdir: Path) -> None:
    """Without checkpointing, each block keeps four 4 MiB tensors for its backward pass (its input and
    those of GELU, the second Linear and the second GELU): 96 MiB for the six. With it, each keeps only its
    input (24 MiB) and the backward pass runs one block again at a time, so the peak holds the saved
    tensors of one block instead of six."""
    train = script(workdir, "blocks.py", CHECKPOINT_SCRIPT)
    plain = estimate(["python", train, "plain"])
    recomputed = estimate(["python", train, "recompute"])
    assert plain.breakdown.activations >= 6 * 4 * 4 * MIB
    assert 6 * 4 * MIB <= recomputed.breakdown.activations <= plain.breakdown.activations - 2 * 4 * 4 * MIB
    assert recomputed.breakdown.parameters == plain.breakdown.parameters
    assert recomputed.breakdown.optimizer_state == plain.breakdown.optimizer_state >= 2 * plain.breakdown.parameters
    assert recomputed.peak_bytes < plain.peak_bytes


def nbytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


RESUMED_SCRIPT = """
import os, sys, torch
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
kind = torch.optim.Adagrad if sys.argv[1] == "adagrad" else torch.optim.Adam
optimizer = kind(model.parameters())
if sys.argv[1] == "resume":  # the optimizer's state is loaded before training, not made in its first step
    optimizer.load_state_dict(torch.load("checkpoint.pt"))
for step in range(10):
    optimizer.zero_grad()
    model(torch.randn(8, 256)).sum().backward()
    optimizer.step()
    if sys.argv[1] == "save" and step == 1:
        torch.save(optimizer.state_dict(), "checkpoint.pt")
        break
"""


def test_optimizer_state_made_before_training_counts_as_resident(workdir: Path) -> None:
    """Resuming from a checkpoint loads Adam's moments before the first step; Adagrad makes its state in its
    constructor. Neither is in the trace, both are on the GPU for the whole job."""
    train = script(workdir, "train.py", RESUMED_SCRIPT)
    subprocess.run([sys.executable, train, "save"], check=True, cwd=workdir)
    parameters = nbytes(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)))
    fresh, resumed = estimate(["python", train, "fresh"]), estimate(["python", train, "resume"])
    assert (
        resumed.breakdown.optimizer_state == fresh.breakdown.optimizer_state == pytest.approx(2 * parameters, rel=0.01)
    )
    assert resumed.peak_bytes == fresh.peak_bytes
    assert estimate(["python", train, "adagrad"]).breakdown.optimizer_state == pytest.approx(parameters, rel=0.01)


def test_a_gan_is_captured_over_whole_iterations_of_both_models(workdir: Path) -> None:
    """Two models, two optimizers stepping in turn: an iteration is the discriminator's step and the
    generator's, the capture stops after three of them, and both models' weights and Adam moments count.
    The baselines, which model one network and one optimizer, say so."""
    from torch import nn

    gan = script(workdir, "gan.py", GAN_SCRIPT)
    estimate_ = estimate(["python", gan])
    assert (workdir / "iterations.log").read_text().splitlines() == ["iteration 0", "iteration 1"]
    g = nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 784))
    d = nn.Sequential(nn.Linear(784, 1024), nn.Linear(1024, 1))
    both = nbytes(g, d)
    assert estimate_.breakdown.parameters == pytest.approx(both, rel=0.01)
    assert estimate_.breakdown.optimizer_state == pytest.approx(2 * both, rel=0.01)
    assert estimate_.notes == ()
    with pytest.raises(EstimateError, match=r"faketensor estimates one model .* steps 2 optimizers \(Adam, Adam\)"):
        estimate_script(["python", gan], "faketensor", "a100-40gb")


def test_a_generator_stepping_every_fifth_iteration_is_waited_for(workdir: Path) -> None:
    """A WGAN's critic steps five times per generator step: three iterations of the critic would leave the
    generator's gradients and Adam moments out, so the capture goes on until every optimizer the script
    holds has stepped, and then one iteration more."""
    every_fifth = "    if iteration % 5 != 4:\n        continue\n    opt_g.zero_grad()\n"
    wgan = script(workdir, "wgan.py", GAN_SCRIPT.replace("    opt_g.zero_grad()\n", every_fifth))
    estimate_ = estimate(["python", wgan])
    assert (workdir / "iterations.log").read_text().splitlines() == ["iteration 4"]
    g = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 784))
    d = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.Linear(1024, 1))
    assert estimate_.breakdown.parameters == pytest.approx(nbytes(g, d), rel=0.01)
    assert estimate_.breakdown.optimizer_state == pytest.approx(2 * nbytes(g, d), rel=0.01)
    assert estimate_.notes == ()  # the critic is called once more in the generator's iteration: no other shape


def test_an_optimizer_that_never_steps_is_waited_for_a_while_only(workdir: Path) -> None:
    """An optimizer of other parameters that the script holds but never steps (left from another phase)
    delays the stop by at most ten times the iterations asked for, and its state is not counted."""
    idle = MLP_SCRIPT.replace(
        "optimizer = torch.optim.Adam(model.parameters())",
        "optimizer = torch.optim.Adam(model.parameters())\n"
        "head = torch.nn.Linear(512, 10)\n"
        "finetune = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)",
    )
    train = script(workdir, "idle.py", idle)
    result = estimate(["python", train, "--log", "steps.log"])
    assert len((workdir / "steps.log").read_text().splitlines()) == 29
    assert result.notes == (
        "the script holds an optimizer (SGD) that never stepped in 30 iterations: its gradients and state are "
        "left out (a larger --steps waits longer)",
    )
    b = result.breakdown
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 10))
    assert b.optimizer_state == pytest.approx(2 * nbytes(model), rel=0.01)


def test_an_optimizer_wrapping_the_one_that_steps_is_not_waited_for(workdir: Path) -> None:
    """Accelerate's `AcceleratedOptimizer` is an Optimizer that steps the one it wraps: the wrapped one's
    steps are the training steps, and the capture stops after three as without the wrapper."""
    adam = "optimizer = torch.optim.Adam(model.parameters())"
    wrapper = (
        adam
        + """
class Wrapper(torch.optim.Optimizer):  # does not call Optimizer.__init__, as AcceleratedOptimizer
    def __init__(self, optimizer):
        self.optimizer = optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups
    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)
    def step(self, closure=None):
        return self.optimizer.step(closure)
optimizer = Wrapper(optimizer)"""
    )
    train = script(workdir, "wrapped.py", MLP_SCRIPT.replace(adam, wrapper))
    estimate(["python", train, "--log", "steps.log"])
    assert len((workdir / "steps.log").read_text().splitlines()) == 2


def test_one_model_trained_by_two_optimizers(workdir: Path) -> None:
    """An optimizer for the embedding and another for the rest, both stepping after one backward pass: an
    iteration holds a step of each (each step on its own used to be taken for an iteration without a
    forward pass, and refused), and the state of both counts."""
    from torch import nn

    two = script(
        workdir,
        "two_optimizers.py",
        """
        import torch
        from torch import nn
        model = nn.Sequential(
            nn.Embedding(1000, 256), nn.Flatten(), nn.Linear(8 * 256, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        embedding = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
        rest = torch.optim.Adam([p for layer in list(model)[1:] for p in layer.parameters()])
        for step in range(50):
            x, y = torch.randint(0, 1000, (32, 8)), torch.randint(0, 10, (32,))
            embedding.zero_grad()
            rest.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            embedding.step()
            rest.step()
        """,
    )
    b = estimate(["python", two]).breakdown
    embedding, layers = nn.Embedding(1000, 256), (nn.Linear(8 * 256, 512), nn.Linear(512, 10))
    assert b.parameters == pytest.approx(nbytes(embedding, *layers), rel=0.01)
    assert b.optimizer_state == pytest.approx(nbytes(embedding) + 2 * nbytes(*layers), rel=0.01)


def test_a_frozen_teacher_sits_on_the_gpu_too(workdir: Path) -> None:
    """Distillation: the teacher is not trained, but its weights are on the GPU all along."""
    from torch import nn

    distil = script(
        workdir,
        "distil.py",
        """
        import torch
        from torch import nn
        class Teacher(nn.Sequential):
            pass
        teacher = Teacher(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 10)).requires_grad_(False).eval()
        student = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
        for step in range(50):
            x = torch.randn(32, 256)
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(student(x), target).backward()
            optimizer.step()
        """,
    )
    teacher = nn.Sequential(nn.Linear(256, 4096), nn.Linear(4096, 10))
    student = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 10))
    assert estimate(["python", distil]).breakdown.parameters == pytest.approx(nbytes(teacher, student), rel=0.01)
    with pytest.raises(EstimateError, match=r"modules with weights of their own besides the Sequential .*\(Teacher\)"):
        estimate_script(["python", distil], "horus", "a100-40gb")


@pytest.mark.parametrize(
    ("kept", "used"),
    [
        ("self.ema = ema", "self.ema"),  # an attribute of an object in a function's frame
        ("self.averages = {'ema': ema}", "self.averages['ema']"),  # in a dict there
        ("self.state = types.SimpleNamespace(ema=ema)", "self.state.ema"),  # two attributes away
    ],
)
def test_an_average_of_the_model_that_is_never_called_sits_on_the_gpu_too(workdir: Path, kept: str, used: str) -> None:
    """An exponential moving average of the model, kept by a trainer object in a function's frame and
    updated by arithmetic, never called: its weights are found where the script holds them."""
    ema = script(
        workdir,
        "ema.py",
        """
        import copy, torch, types
        from torch import nn

        class Trainer:
            def __init__(self, model):
                self.model = model
                ema = copy.deepcopy(model).requires_grad_(False)
                KEPT
                self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

            def fit(self):
                for step in range(50):
                    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
                    self.optimizer.zero_grad()
                    nn.functional.cross_entropy(self.model(x), y).backward()
                    self.optimizer.step()
                    with torch.no_grad():
                        torch._foreach_lerp_(list(USED.parameters()), list(self.model.parameters()), 0.001)

        def main():
            Trainer(nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10))).fit()

        main()
        """.replace("KEPT", kept).replace("USED", used),
    )
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 10))
    assert estimate(["python", ema]).breakdown.parameters == pytest.approx(2 * nbytes(model), rel=0.01)


def test_the_layer_a_transformer_encoder_copies_is_not_counted_on_the_gpu(workdir: Path) -> None:
    """The idiom PyTorch's documentation teaches: the template the script holds stays on the CPU, never
    called. It was counted as weights on the GPU, and the baselines refused the job as one of two models."""
    encoder = script(
        workdir,
        "encoder.py",
        """
        import torch
        from torch import nn

        layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
        model = nn.Sequential(nn.Embedding(100, 64), nn.TransformerEncoder(layer, 3), nn.Linear(64, 100))
        optimizer = torch.optim.AdamW(model.parameters())
        for step in range(10):
            tokens = torch.randint(0, 100, (8, 16))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()
        """,
    )
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(100, 64), torch.nn.TransformerEncoder(layer, 3), torch.nn.Linear(64, 100)
    )
    assert estimate(["python", encoder]).breakdown.parameters == pytest.approx(nbytes(model), rel=0.01)
    assert registered(["python", encoder], "faketensor").peak_bytes > 0


def test_crashing_script_reports_its_last_error_line(workdir: Path) -> None:
    train = tiny_script(workdir, "crash.py", 5, 'if step == 1: raise ValueError("boom in the training loop")')
    with pytest.raises(
        EstimateError, match=r"crashed after 2 optimizer steps: ValueError: boom in the training loop at crash\.py:\d+$"
    ):  # the job's own line: the innermost of its files (not PyTorch's or carma's)
        estimate(["python", train])
    on_gpu = script(workdir, "on_gpu.py", "import torch\ntorch.cuda.get_device_properties(0)\n")
    with pytest.raises(
        EstimateError, match=r"crashed after 0 optimizer steps: .*CUDA.* let the job fall back to the CPU"
    ):
        estimate(["python", on_gpu])


def test_an_error_in_a_dataloader_worker_is_reported_as_the_worker_raised_it(workdir: Path) -> None:
    """It was PyTorch's re-raise: "Caught KeyError in DataLoader worker process 0. Original Traceback ..." cut at
    500 characters, never reaching 'label', and located at the loop, not at the line that raised it."""
    train = script(
        workdir,
        "workers.py",
        textwrap.dedent(
            """\
            import torch
            class Records(torch.utils.data.Dataset):
                def __len__(self): return 8
                def __getitem__(self, i):
                    return {"x": torch.randn(4)}["label"]
            model = torch.nn.Linear(4, 2)
            for batch in torch.utils.data.DataLoader(Records(), batch_size=4, num_workers=1):
                model(batch).sum().backward()
            """
        ),
    )
    with pytest.raises(
        EstimateError,
        match=r"after 0 optimizer steps: KeyError: 'label' \(in DataLoader worker process 0\) at workers\.py:5$",
    ):
        estimate(["python", train])


@pytest.mark.parametrize(
    ("signal_name", "message"),
    [
        ("SIGKILL", r"killed \(SIGKILL\), most likely for lack of host memory"),  # as the kernel's OOM killer does
        ("SIGTERM", "killed by SIGTERM"),
    ],
)
def test_a_capture_killed_by_a_signal_says_which_and_why_it_may_have_been(
    workdir: Path, signal_name: str, message: str
) -> None:
    train = tiny_script(workdir, "killed.py", 5, f"import os, signal; os.kill(os.getpid(), signal.{signal_name})")
    with pytest.raises(EstimateError, match=message):
        estimate(["python", train])


@pytest.mark.skipif(not Path("/proc/self/oom_score_adj").exists(), reason="Linux's OOM killer settings")
def test_the_capture_is_what_the_kernel_kills_first_when_host_memory_runs_out(workdir: Path) -> None:
    """Not a training job running beside it, nor the daemon that started it."""
    train = tiny_script(workdir, "score.py", 5, 'open("score", "w").write(open("/proc/self/oom_score_adj").read())')
    own = Path("/proc/self/oom_score_adj").read_text()
    estimate(["python", train])
    assert (workdir / "score").read_text().strip() == "1000"
    assert Path("/proc/self/oom_score_adj").read_text() == own  # the process asking is left as it was


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's parent-death signal")
def test_the_capture_ends_with_the_process_that_waits_for_it(workdir: Path) -> None:
    """A daemon killed with -9 (or a killed `carma estimate`) leaves no capture behind holding host memory."""
    script(workdir, "slow.py", "import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(3600)\n")
    code = "from carma.estimate.runner import estimate_script as e; e(['python', 'slow.py'], 'horus', 'a100-40gb')"
    # its temporary folder stays, as a killed process leaves it: in the test's folder, not in /tmp at every run
    waiting = subprocess.Popen([sys.executable, "-c", code], cwd=workdir, env={**os.environ, "TMPDIR": str(workdir)})
    capture = int(wait_until(lambda: (workdir / "pid").exists() and (workdir / "pid").read_text()))
    started = proctree.start_ticks(capture)
    waiting.kill()
    waiting.wait()
    wait_until(lambda: not proctree.alive(capture, started))  # gone, or a zombie nobody reaped (in a container)


def test_script_that_stops_early_or_is_missing(workdir: Path) -> None:
    train = tiny_script(workdir, "short.py", 2)
    with pytest.raises(
        EstimateError,
        match=r"ended after 2 optimizer steps; the capture needs 3 \(let it train longer, or .* --steps 2\)",
    ):
        estimate(["python", train])
    with pytest.raises(EstimateError, match=r"^the script ended after 1 optimizer step; the capture needs 3 \("):
        estimate(["python", tiny_script(workdir, "one.py", 1)])
    with pytest.raises(EstimateError, match="does not exist"):
        estimate(["python", "missing.py"])
    (workdir / "app").mkdir()  # `python app` is no missing script
    with pytest.raises(EstimateError, match=r"^app is a folder, and has no __main__\.py for Python to run$"):
        estimate(["python", "app"])
    (workdir / "app" / "__main__.py").write_text(MLP_SCRIPT)
    with pytest.raises(EstimateError, match=r"^app is a folder: give the script Python runs in it, `python app/"):
        estimate(["python", "app"])
    with pytest.raises(EstimateError, match="sh is a program, not a Python script"):
        estimate(["sh", "-c", "torchrun train.py"])  # a launcher, as torchrun or accelerate would be
    for launcher in ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch"):
        with pytest.raises(EstimateError, match=rf"^python -m {launcher} is a launcher: give `python script\.py"):
            estimate(["python", "-m", launcher, "--nproc_per_node", "2", train])  # its workers train elsewhere
    script(workdir, "run.sh", "#!/usr/bin/env -S bash -e\npython train.py --epochs 3\n")
    with pytest.raises(EstimateError, match=r"run\.sh is a bash script, not a Python one"):
        estimate(["./run.sh"])  # a wrapper: the Python script it starts is what can be captured


def test_script_timeout(workdir: Path) -> None:
    train = script(workdir, "slow.py", "import time\ntime.sleep(120)\n")
    with pytest.raises(EstimateError, match="within 5 s"):
        estimate(["python", train], timeout_s=5)


def test_job_function_gives_a_capture(workdir: Path) -> None:
    capture = capture_job("jobs:mlp")
    assert isinstance(capture, Capture)
    assert capture.steps == 3 and capture.job.loss is not None
    names = {e["name"] for e in capture.trace if e["cat"] == "user_annotation"}
    assert {"ProfilerStep#0", "ProfilerStep#2", "Optimizer.step#Adam.step"} <= names
    assert any(e["name"] == "[memory]" for e in capture.trace)
    assert module_window(capture.job.model) in names  # the model's calls, each in a window of its own
    assert capture_job(f"{workdir / 'jobs.py'}:as_tuple").job.optimizer is not None


def test_job_function_errors(workdir: Path) -> None:
    with pytest.raises(EstimateError, match="returned int; expected a TrainingJob"):
        capture_job("jobs:not_a_job")
    with pytest.raises(EstimateError, match="cannot import no_such_module"):
        capture_job("no_such_module:make")
    with pytest.raises(EstimateError, match="has no function missing"):
        capture_job("jobs:missing")
    (workdir / "settings.py").write_text("BATCH = 32\n")
    with pytest.raises(EstimateError, match=r"^settings:BATCH is not a function \(type int\)$"):
        capture_job("settings:BATCH")
    (workdir / "typo.py").write_text("import torch\n\ndef job(:\n    pass\n")  # where, which the line leaves out
    with pytest.raises(EstimateError, match=r"^cannot import typo: SyntaxError: invalid syntax at typo\.py:3$"):
        capture_job("typo:job")
    with pytest.raises(EstimateError, match="is not 'module:function'"):
        capture_job("jobs")
    with pytest.raises(EstimateError, match=r"never calls the model \(a ModuleDict\): .* must call the model itself"):
        estimate_xmem(capture_job("jobs:parts_only"), 300 * MIB, "test-gpu")


def test_a_job_function_is_estimated_in_a_child_process_as_in_this_one(workdir: Path) -> None:
    """`carma estimate --job` captures in a child (CUDA hidden, the capture's heap settings), like a script."""
    import os

    child = estimate_job("jobs:records_its_process", "xmem", "test-gpu", estimator="xmem_only:estimate")
    assert int((workdir / "job.pid").read_text()) != os.getpid()
    here = estimate_xmem(capture_job("jobs:mlp"), 300 * MIB, "test-gpu")
    assert (child.peak_bytes, child.breakdown) == (here.peak_bytes, here.breakdown)
    with pytest.raises(EstimateError, match="returned int; expected a TrainingJob"):
        estimate_job("jobs:not_a_job", "xmem", "test-gpu", estimator="xmem_only:estimate")
    with pytest.raises(EstimateError, match="is not 'module:function'"):
        estimate_job("jobs", "xmem", "test-gpu")


EXITING_JOBS = """
import sys
import torch
from carma.estimate.base import TrainingJob

def returns_nothing():
    sys.exit(0)

def says_why():
    sys.exit("no dataset given")

def exits_in_its_step():
    model = torch.nn.Linear(4, 2)
    return TrainingJob(model, torch.randn(3, 4), lambda m, b: sys.exit(3), torch.optim.SGD(model.parameters()))
"""

ARGPARSE_JOB = """
import argparse
import torch
from carma.estimate.base import TrainingJob

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
{required}
args = parser.parse_args()

def job():
    model = torch.nn.Linear(4, 2)
    return TrainingJob(model, torch.randn(3, 4), lambda m, b: m(b).sum(), torch.optim.SGD(model.parameters(), args.lr))
"""


def test_a_job_that_exits_says_so_rather_than_that_the_capture_died(workdir: Path) -> None:
    """`sys.exit` in a job function, its training step or its module's argparse, each as the job's own
    reason (it was "the estimating process died (exit status 0): no error output")."""
    (workdir / "exiting.py").write_text(EXITING_JOBS)
    (workdir / "needs_args.py").write_text(ARGPARSE_JOB.format(required='parser.add_argument("--data", required=True)'))

    def error(target: str) -> str:
        with pytest.raises(EstimateError) as caught:
            estimate_job(target, "xmem", "test-gpu", estimator="xmem_only:estimate")
        return str(caught.value)

    assert error("exiting:returns_nothing") == "the job function exiting:returns_nothing exited with status 0"
    assert error("exiting:says_why") == "the job function exiting:says_why exited: no dataset given"
    assert error("exiting:exits_in_its_step") == "the training step of exiting:exits_in_its_step exited with status 3"
    assert error("needs_args.py:job") == (
        "importing needs_args.py exited with status 2: needs_args.py: error: the following arguments are required: "
        "--data"
    )


def test_a_job_module_parsing_its_arguments_at_import_sees_none(workdir: Path) -> None:
    """As `python train.py` with no arguments: it saw the capture's own (its JSON spec) and refused them."""
    (workdir / "train.py").write_text(ARGPARSE_JOB.format(required=""))
    as_file = estimate_job("train.py:job", "xmem", "test-gpu", estimator="xmem_only:estimate")
    as_module = estimate_job("train:job", "xmem", "test-gpu", estimator="xmem_only:estimate")
    assert as_file.peak_bytes == as_module.peak_bytes > 0


@pytest.mark.parametrize("job", ["jobs:mlp", "jobs:layers"])
def test_skipping_arithmetic_leaves_the_estimate_unchanged(workdir: Path, job: str) -> None:
    fast = run_xmem(capture_job(job))
    exact = run_xmem(capture_job(job, exact=True))
    assert fast.simulation.peak_reserved == exact.simulation.peak_reserved
    assert fast.simulation.at_peak == exact.simulation.at_peak


def test_xmem_estimate_of_an_mlp_is_close_to_a_hand_computation(workdir: Path) -> None:
    """Adam on a 1024-2048-10 MLP, batch 128, float32. By hand: the first layer's weight is 8 MiB, so
    parameters P = 8.09 MiB, gradients P, Adam's two moments 2P, and the foreach step a P-sized list of
    temporaries: five 8 MiB tensors at the step. Each is under 10 MiB, so it comes from a 20 MiB segment
    that holds two of them: three segments, 60 MiB. Activations and the batch (about 9 MiB, rounded
    to 512 B) fit in the segments' rest or add at most one more 20 MiB segment. On top, the fragmentation
    allowance: one more segment in each pool, 2 MiB, and 20 MiB for the largest block at the peak (8 MiB)."""
    parameters = (1024 * 2048 + 2048 + 2048 * 10 + 10) * 4
    estimate = estimate_xmem(capture_job("jobs:mlp"), 0, "test-gpu")
    b = estimate.breakdown
    assert b.parameters == pytest.approx(parameters, rel=0.01)
    assert b.optimizer_state == pytest.approx(2 * parameters, rel=0.01)
    tensors = b.parameters + b.gradients + b.optimizer_state + b.activations
    assert 5 * parameters <= tensors <= 5 * parameters + 12 * MIB
    allowance = 2 * MIB + 20 * MIB
    assert 3 * 20 * MIB + allowance <= estimate.peak_bytes <= 4 * 20 * MIB + allowance
    assert b.allocator == estimate.peak_bytes - tensors


def test_a_download_the_capture_cannot_make_is_named_in_one_line(workdir: Path) -> None:
    """torchvision's weights, a dataset's mirror: the script's crash said `URLError: <urlopen error [Errno -2]
    Name or service not known>`, which names nothing it wanted."""
    url = "http://weights.invalid/resnet50-0676ba61.pth"  # .invalid never resolves
    train = tiny_script(workdir, "pretrained.py", 5)
    (workdir / train).write_text(
        f"import urllib.request\nurllib.request.urlopen({url!r})\n" + (workdir / train).read_text()
    )
    with pytest.raises(EstimateError) as failed:
        estimate(["python", train])
    message = str(failed.value)
    assert (
        message.startswith("the script crashed after 0 optimizer steps: urllib.error.URLError: ")
        and "\n" not in message
    )
    assert f"(it could not download {url}: a capture loads the job's data and weights from this machine" in message


def test_a_model_too_large_for_the_hosts_memory_is_refused_before_the_capture(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-2 XL's capture was killed by the kernel's OOM killer after 84 s (taking other work's memory first)."""
    from carma.estimate import session

    monkeypatch.setattr(session, "host_memory", lambda field: 20 * MIB)
    weights = (1024 * 2048 + 2048 + 2048 * 10 + 10) * 4  # jobs:mlp's, 8.1 MiB
    with pytest.raises(EstimateError, match=r"^the model's 8.1 MiB of weights need about 32.3 MiB of host memory"):
        capture_job("jobs:mlp", steps=2)
    assert 3 * weights > 20 * MIB  # what is refused: more than the host has beside the weights
    monkeypatch.setattr(session, "host_memory", lambda field: 3 * weights)
    assert capture_job("jobs:mlp", steps=2).steps == 2


def test_a_capture_the_host_cannot_hold_is_stopped_with_a_line_not_left_to_the_oom_killer(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activations are not known before the capture: the host's available memory is watched while it runs.
    Here any host is short (the floor is all of its memory) and any capture its main consumer: the capture is
    stopped at once and says why."""
    from carma.estimate import runner

    monkeypatch.setattr(runner, "host_memory_floor", lambda total: total)
    monkeypatch.setattr(runner, "MAIN_CONSUMER", 0.0)
    with pytest.raises(EstimateError) as stopped:
        estimate(["python", tiny_script(workdir, "train.py", 5)])
    message = str(stopped.value)
    assert re.fullmatch(
        r"the capture was stopped with [\d.]+ [GM]iB of host memory left, holding [\d.]+ [GMK]iB: it runs the "
        r"training steps on the CPU, so the host needs about the memory the job needs on the GPU; estimate on a "
        r"host with more memory",
        message,
    ), message


def test_a_capture_that_writes_too_much_output_is_stopped_with_a_line(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture's output goes to files of the user running the estimate (root, in the server), not the job's:
    a job that printed 250 MB held them, out of its user's quota, for as long as the capture ran."""
    from carma.estimate import runner

    monkeypatch.setattr(runner, "OUTPUT_BYTES", 1 << 20)
    each_step = "print('x' * (1 << 20), flush=True); import time; time.sleep(5)"
    with pytest.raises(EstimateError) as stopped:
        estimate(["python", tiny_script(workdir, "train.py", 5, each_step=each_step)])
    assert re.fullmatch(
        r"the capture was stopped after its output reached [\d.]+ MiB \(at most 1\.0 MiB\): estimate a job that "
        r"prints less while it trains",
        str(stopped.value),
    ), stopped.value


def test_the_host_memory_floor_is_a_fiftieth_of_the_host_from_256_mib_to_1_gib() -> None:
    from carma.estimate.runner import host_memory_floor

    assert [host_memory_floor(g << 30) >> 20 for g in (4, 24, 128)] == [256, 491, 1024]
