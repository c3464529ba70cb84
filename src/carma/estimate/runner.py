"""Estimate a training job in a child process: its first iterations run on the CPU, with CUDA hidden,
under the PyTorch profiler, and the child sends the `Estimate` back.

Two ways in, each run in a child process with `CUDA_VISIBLE_DEVICES=""`, TorchDynamo off (a model passed
to `torch.compile` runs eagerly) and heap settings that suit the capture:
- a job function (`module:function` or `path/file.py:function` returning a `TrainingJob`), by
  `estimate_job` (`carma.estimate.job.capture_job` captures it in this process);
- the user's own training script (`python train.py ...`, `python -m pkg.train ...`, `python -c CODE`), by
  `estimate_script` (`carma.estimate.script.capture_script`), so a script that falls back to the CPU when
  CUDA is absent runs unchanged.
The captured model cannot cross the process boundary, so the child also runs the estimator and sends back
the `Estimate` as JSON (in a file, as the script owns stdout).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from carma.estimate import cuda_on_cpu, kernels
from carma.estimate.base import CAPTURE_TIMEOUT_S, Capture, Estimate, EstimateError, Exited
from carma.estimate.devices import Device, find_device
from carma.estimate.job import capture_job, job_parts
from carma.estimate.registry import check_steps
from carma.estimate.script import ScriptFailed, ShortBatchEnded, capture_script, parse_argv
from carma.estimate.session import DEFAULT_STEPS, REASON_CHARS, host_memory, last_line, proc_kib
from carma.units import cut, size_text
from carma.userfiles import open_for_reading, owners_of

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STDERR_TAIL_BYTES = 64 << 10  # how much of a capture's error output is read back for its last line
RESULT_BYTES = 16 << 20  # the most of a capture's JSON result read back (an estimate is a few hundred bytes)
REGISTRY = "carma.estimate.registry:estimate_captured"
WATCH_S = 0.1  # how often the host's available memory is read while a capture runs
OUTPUT_BYTES = 64 << 20  # of a capture's output and error output, together: the files are the estimating user's
# A capture is stopped on a short host only when it holds this share of the memory in use: the host's main
# consumer, not a small capture beside training jobs (or other captures) that take the host's memory.
MAIN_CONSUMER = 0.5
# The child may run under another interpreter (the task's own, with its packages): it loads this very carma
# package from its folder, without putting the folder's neighbours (another environment's packages) on its path.
_CHILD = """
import importlib.util, os, sys
init = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("carma", init, submodule_search_locations=[os.path.dirname(init)])
sys.modules["carma"] = carma = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carma)
from carma.estimate.runner import _child_main
_child_main()
"""
VALUES_NOTE = (
    "the job's shapes depend on values the capture leaves uncomputed ({}: a boolean mask, say): it was captured "
    "computing them, which takes longer"
)
COMPUTED_NOTE = (
    "the script failed with the arithmetic skipped, as it reads values the capture leaves uncomputed (a loss "
    "or gradient-norm check, say): it was captured computing them, which takes longer"
)
# Freed tensors stay in the child's heap for the next step instead of going back to the system and being
# faulted in again: this cuts a BERT-base capture by a fifth (the CPU run is most of an estimate's time).
# Tensors too large for the heap are mapped afresh each step; in transparent huge pages (where the kernel
# offers them on request) they fault in 2 MiB at a time, not 4 KiB: a ResNet-50 estimate took 13 to 16 s
# instead of 19 to 22 s, a BERT-base one 14 to 18 s instead of 16 to 18 s. Older glibc ignores the tunable.
MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
    "MALLOC_TOP_PAD_": str(1 << 30),
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


def capture_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a capture child: `env` (by default this process's) with CUDA hidden, TorchDynamo
    off, Weights & Biases off and the `MALLOC_ENV` heap settings unless `env` sets its own.

    With TorchDynamo off `torch.compile` leaves the model eager: compiling on the CPU would build CPU
    kernels, not the GPU ones the job will run, and can take minutes. The eager peak is the estimate; a
    compiled model's is usually lower (fused kernels save fewer activations). A capture is not a training
    run: with W&B disabled, `wandb.init` and `wandb.log` do nothing instead of recording a run of three
    steps (or waiting on the network)."""
    hidden = {"CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled"}
    return {**MALLOC_ENV, **(os.environ if env is None else env), **hidden}


def estimate_script(argv: list[str], method: str, device: str, steps: int = DEFAULT_STEPS, **options: Any) -> Estimate:
    """Capture the script in a child process (CUDA hidden) and estimate there; `options` as `_estimate_in_child`."""
    parse_argv(argv, options.get("cwd"))  # fail fast, before a process is started
    return _estimate_in_child({"argv": list(argv)}, method, device, steps, **options)


def estimate_job(target: str, method: str, device: str, steps: int = DEFAULT_STEPS, **options: Any) -> Estimate:
    """Capture the job function in a child process (CUDA hidden) and estimate there; `options` as
    `_estimate_in_child`. The child imports `target` from its working directory, as `capture_job` does."""
    job_parts(target)  # fail fast, before a process is started
    return _estimate_in_child({"job": target}, method, device, steps, **options)


def _estimate_in_child(
    source: dict[str, Any],
    method: str,
    device: str,
    steps: int,
    *,
    timeout_s: float = CAPTURE_TIMEOUT_S,
    exact: bool = False,
    gpus: int = 1,
    timeline: str | Path | None = None,
    estimator: str = REGISTRY,
    python: str | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    user: int | None = None,
    group: int | None = None,
    extra_groups: Sequence[int] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Estimate:
    """Capture `source` ({"argv": [...]} or {"job": "module:function"}) in a child and estimate there with
    `estimator`.

    `estimator` names a function `(method, capture, device, **options) -> Estimate`; `timeline` (a PNG
    path) is passed on as an option when given. `gpus`: the GPUs a script's job runs on (a model under
    DataParallel is captured as the first of them runs it, `carma.estimate.replicas`). The child runs as
    the job would: under `python` (by default this interpreter), in `cwd`, with `env` (by default this
    process's), as `user`/`group`/`extra_groups` when given (a root daemon estimating a user's task);
    `on_start` gets its process group.
    A script that ends or crashes before its steps once an epoch's short batch comes second, as a loop that
    ends its epoch at a short batch does (`if len(x) < batch_size: break`), is captured again with its
    batches in order: its GPU run never trains that batch. A script that still fails with the arithmetic
    skipped (`carma.estimate.kernels`) is captured once more computing every value, as it may read some;
    the estimate then says so. One that fails before its training begins skipped nothing and is not. Each
    capture has `timeout_s`.
    """
    check_steps(method, steps)
    if cwd is not None:  # the child starts in `/` and enters `cwd` itself: both as the job would find them
        cwd = os.path.abspath(cwd)
        if python and os.sep in python and not os.path.isabs(python):  # a PATH entry relative to the workdir
            python = os.path.join(cwd, python)
    what = "the script" if "argv" in source else "the job function"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="carma-estimate-") as tmp:
        # the child writes its result in `out`, its user's folder inside this process's own: the user may put
        # anything at the result's name, never swap the folder (a link to another, where root would read and
        # delete `estimate.json`)
        out = Path(tmp) / "out"
        out.mkdir()
        result = out / "estimate.json"
        spec = {
            **source,
            "steps": steps,
            "exact": exact,
            "gpus": gpus,
            "method": method,
            "device": device,
            # the constants as this process finds them: the child runs with the job's environment, as its
            # user, and would read that user's calibration (or none), not the one the estimate is asked under
            "constants": asdict(known) if (known := find_device(device)) else None,
            "estimator": estimator,
            "timeline": str(Path(timeline).resolve()) if timeline else None,
            "result": str(result),
            "parent": os.getpid(),
            "cwd": str(cwd) if cwd is not None else None,  # entered by the child, as `user`: see `_enter`
        }
        if user is not None:
            Path(tmp).chmod(0o711)
            os.chown(out, user, group if group is not None else -1)  # the child writes its result there
        package = str(Path(__file__).resolve().parent.parent / "__init__.py")

        def run(short_second: bool, exact: bool) -> tuple[dict[str, Any], str]:
            """The child's payload and the end of what it said (`_said`).

            Its output goes to files, not pipes: reading a pipe to its end waited for every process that
            inherited it (a helper the script started, in a session of its own too) past the timeout, and
            held all the script's error output in memory where only the last line is read. The file has no
            name (the folder is the job owner's: a name there could be swapped for a link to any file)."""
            result.unlink(missing_ok=True)
            with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
                try:
                    child = subprocess.Popen(
                        [
                            python or sys.executable,
                            "-c",
                            _CHILD,
                            package,
                            json.dumps({**spec, "short_second": short_second, "exact": exact}),
                        ],
                        stdin=subprocess.DEVNULL,  # a prompt, unseen with the output, would wait until the timeout
                        stdout=stdout,  # the script's own output: its reason, when it gives none on stderr
                        stderr=stderr,  # for the last error line when the child dies
                        cwd="/" if cwd is not None else None,
                        env=capture_environment(env),
                        user=user,
                        group=group,
                        extra_groups=extra_groups,
                        start_new_session=True,  # its own process group, so a timeout ends DataLoader workers too
                    )
                except OSError as e:
                    raise EstimateError(f"could not start {python or sys.executable} to capture {what}: {e}") from None
                if on_start is not None:
                    on_start(child.pid)
                try:
                    late = f"{what} did not reach {steps} optimizer steps within {timeout_s:g} s"
                    _watch(child, timeout_s, late, (stdout, stderr))
                finally:  # whatever the job left running, also when a signal stops this process
                    kill_group(child.pid)
                    child.wait()
                err = _said(stderr, stdout)
            payload = _read_result(result)
            if payload is None:
                raise EstimateError(_death(child.returncode, err))
            return _payload(payload), err

        short_second = True
        payload, err = run(short_second, exact)
        if payload.get("short_batch_ended"):  # its loop ends an epoch at a short batch: leave that last
            short_second = False
            payload, err = run(short_second, exact)
        values_read = payload.get("values_read", [])
        failed_skipping = payload.get("script_failed", False) and payload.get("arithmetic_skipped", True)
        computed = (failed_skipping or bool(values_read)) and not exact
        if computed:
            payload, err = run(short_second, exact=True)
    if "error" in payload:
        if not payload.get("stderr_says_why"):
            raise EstimateError(str(payload["error"]))
        why = _last_line(err)
        exited = str(payload["error"]) + (f": {why}" if why else "")
        raise EstimateError(cuda_on_cpu.explained(exited, why or "", bool(payload.get("asked_if_available"))))
    try:
        estimate = Estimate.checked(payload.get("estimate"), time.perf_counter() - started)
    except ValueError as e:
        raise EstimateError(f"the estimating process wrote a malformed estimate ({e})") from None
    computed_note = VALUES_NOTE.format(", ".join(dict.fromkeys(values_read))) if values_read else COMPUTED_NOTE
    return replace(estimate, notes=(*estimate.notes, *([computed_note] if computed else [])))


def _payload(text: str) -> dict[str, Any]:
    """The capture child's result. The child runs the job's code as its user, which may write the file itself:
    what the parent reads of it besides the estimate (`Estimate.checked`) is checked here."""
    payload: Any
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    read = payload.get("values_read", []) if isinstance(payload, dict) else None
    if not isinstance(read, list) or not all(isinstance(value, str) for value in read):
        raise EstimateError("the estimating process wrote a malformed result")
    return payload


def host_memory_floor(total: int) -> int:
    """The available host memory under which a capture is stopped: 2% of the host's, from 256 MiB to 1 GiB."""
    return min(1 << 30, max(256 << 20, total // 50))


def _watch(child: subprocess.Popen[bytes], timeout_s: float, late: str, outputs: Sequence[BinaryIO] = ()) -> None:
    """Wait for the capture child to end, `late` the error past `timeout_s`. It is stopped once it has written
    over `OUTPUT_BYTES` to `outputs`: files of the user running the estimate (root, in the server), in
    which the job's output would take the disk for as long as the capture runs. Its activations are not known
    before it runs and are real in host memory: it is stopped when the host's available memory falls under
    `host_memory_floor` while it holds `MAIN_CONSUMER` of the memory in use, with a line saying so, rather
    than left to the kernel's out-of-memory killer, which reclaims every process's memory first. Its own
    process only is counted (not DataLoader workers), and the host's memory as /proc/meminfo tells it (not a
    cgroup's limit)."""
    deadline = time.monotonic() + timeout_s
    total = host_memory("MemTotal")
    floor = host_memory_floor(total) if total else 0
    while True:
        try:
            child.wait(timeout=max(0.0, min(WATCH_S, deadline - time.monotonic())))
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise EstimateError(late) from None
        if (written := sum(os.fstat(f.fileno()).st_size for f in outputs)) > OUTPUT_BYTES:
            raise EstimateError(
                f"the capture was stopped after its output reached {size_text(written)} (at most "
                f"{size_text(OUTPUT_BYTES)}): estimate a job that prints less while it trains"
            )
        available = host_memory("MemAvailable") if floor else None
        if available is None or available >= floor:
            continue
        held = proc_kib(f"/proc/{child.pid}/status", "VmRSS")
        if held is not None and held >= MAIN_CONSUMER * (total - available) and child.poll() is None:
            raise EstimateError(
                f"the capture was stopped with {size_text(available)} of host memory left, holding "
                f"{size_text(held)}: it runs the training steps on the CPU, so the host needs about the memory the "
                "job needs on the GPU; estimate on a host with more memory"
            )


def _death(returncode: int, err: str) -> str:
    """Why the capture child ended without a result. A SIGKILL nobody sent is most often the kernel's
    out-of-memory killer: the capture holds the model, the batch and the activations in host memory."""
    if returncode == -signal.SIGKILL:
        return (
            "the estimating process was killed (SIGKILL), most likely for lack of host memory: the capture runs "
            "the training steps on the CPU, so the host needs about the memory the job needs on the GPU"
        )
    if returncode < 0:
        return f"the estimating process was killed by {signal.Signals(-returncode).name}"
    # 126 and 127: the interpreter did not run (a pyenv shim for a version not installed says so first, then
    # where the version is to be found); otherwise the last line is the latest word
    lines = _lines(err)
    why = (lines[0] if returncode in (126, 127) else lines[-1]) if lines else "no error output"
    return f"the estimating process died (exit status {returncode}): {why}"


def _read_result(path: Path) -> str | None:
    """The child's JSON result, if it wrote one. The folder is the job owner's (the child runs as them): a
    link or a FIFO put there in place of the file is no result, never followed or waited on."""
    try:
        with open_for_reading(path, owners_of(path.parent)) as f:
            return f.read(RESULT_BYTES).decode(errors="replace")
    except OSError:  # none, or not a plain file of the job owner's (see `carma.userfiles`)
        return None


def _tail(file: BinaryIO) -> str:
    """The end of a capture's stderr or stdout (its last lines are the reason it gives), as text whatever its bytes."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - STDERR_TAIL_BYTES))
    return file.read().decode(errors="replace")


def _said(stderr: BinaryIO, stdout: BinaryIO) -> str:
    """The end of a capture's error output, or of its output when it wrote no error: a script that prints
    its complaint (`print("no data in", path); sys.exit(1)`) gave no reason before."""
    err = _tail(stderr)
    return err if _lines(err) else _tail(stdout)


def _lines(err: str) -> list[str]:
    """A child's error output, each line cut to a length an error line can show; blank lines and progress
    bars (a line redrawn after carriage returns, as tqdm's) left out: a bar on stderr was given as the
    reason where the script had printed its complaint."""
    lines = (line.rstrip("\r") for line in err.split("\n"))
    return [cut(line.strip(), REASON_CHARS) for line in lines if line.strip() and "\r" not in line]


def _last_line(err: str) -> str | None:
    lines = _lines(err)
    return lines[-1] if lines else None


def kill_group(pid: int) -> None:
    """End a capture child and whatever it started (its process group), if it is still there."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _end_with(parent: int) -> None:
    """Have Linux kill this child when the thread that started it ends (a daemon killed with -9, a Ctrl-C'd
    `carma estimate`): an orphaned capture would hold its host memory, about the job's GPU peak, until
    the script's end, while a restarted daemon captures the same job again."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it had already ended
        os._exit(1)


def _child_main() -> None:
    """The child of `estimate_script`: capture, estimate, write the JSON, and exit at once (without
    waiting for threads the script may have left)."""
    spec = json.loads(sys.argv[1])
    _end_with(spec["parent"])
    with suppress(OSError):  # the first the kernel kills if host memory runs out, not a training job or the daemon
        Path("/proc/self/oom_score_adj").write_text("1000")
    _finish(spec, lambda: _capture(spec))


def _enter(cwd: str | None) -> None:
    """Enter the job's working directory as the job's user: `subprocess` changes directory before it drops
    root's rights, which would put a user's capture inside a folder below one closed to them."""
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError as e:
            raise EstimateError(f"cannot enter the working directory {cwd!r}: {e.strerror}") from None


def _capture(spec: dict[str, Any]) -> Capture:
    _enter(spec["cwd"])
    if importlib.util.find_spec("torch") is None:  # the command's own Python, another environment's
        raise EstimateError(
            f"{sys.executable}, the Python that runs the job, has no PyTorch: install it there, or name the "
            "Python that has it (activate its environment, or give its path: /path/to/python train.py)"
        )
    if "job" in spec:  # the module sees no arguments, as `python train.py` would (argparse at its import)
        sys.argv = [job_parts(spec["job"])[0]]
        return capture_job(spec["job"], spec["steps"], exact=spec["exact"])
    return capture_script(
        spec["argv"],
        spec["steps"],
        exact=spec["exact"],
        short_second=spec["short_second"],
        gpus=spec["gpus"],
        on_caught=lambda captured: _finish(spec, captured),  # from inside the script, which would not stop
    )


def _finish(spec: dict[str, Any], capture: Callable[[], Capture]) -> NoReturn:
    """Estimate from what `capture` returns, write the JSON result (or the error) and exit at once."""
    try:
        captured = capture()
        module, _, name = spec["estimator"].partition(":")
        estimate_captured = getattr(importlib.import_module(module), name)
        options = {"timeline": spec["timeline"]} if spec["timeline"] else {}
        device = Device(**spec["constants"]) if spec["constants"] else spec["device"]
        estimate = estimate_captured(spec["method"], captured, device, **options)
        payload: dict[str, Any] = {"estimate": replace(estimate, notes=(*captured.notes, *estimate.notes)).to_json()}
    except EstimateError as exc:
        payload = {
            "error": str(exc),
            "stderr_says_why": isinstance(exc, Exited),
            "asked_if_available": isinstance(exc, Exited) and exc.asked_if_available,
            "short_batch_ended": isinstance(exc, ShortBatchEnded),
            "script_failed": isinstance(exc, ScriptFailed),
        }
    except Exception as exc:
        traceback.print_exc()
        payload = {"error": f"estimating with {spec['method']} failed: {last_line(exc)}"}
    payload["values_read"] = kernels.values_read  # the capture is redone computing every value
    payload["arithmetic_skipped"] = kernels.skipping  # a failure before is not: it would recur as slowly
    Path(spec["result"]).write_text(json.dumps(payload))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
