"""The daemon's memory estimates: in the background, cached by job fingerprint, recovery only on failure."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from carma.config import EstimateConfig
from carma.core.types import NeedKind, Target, Task, TaskSpec
from carma.estimate.base import Breakdown, Estimate, EstimateError
from carma.server import jobfiles
from carma.server.estimates import Estimates, device_for, fingerprint
from carma.server.spec import JobSpec
from carma.server.store import Observation, Store
from support import NOBODY, nobody_can_run_carma, wait_until

MIB = 1 << 20


class Runner:
    """Stands in for estimate_script: records its calls, answers when released."""

    def __init__(self, peak_mib: int = 3000, error: str | None = None, notes: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple[list[str], str, dict]] = []
        self.release = threading.Event()
        self.peak_mib, self.error, self.notes = peak_mib, error, notes

    def __call__(self, argv, method, device, **options):  # type: ignore[no-untyped-def]
        self.calls.append((argv, method, options))
        options["on_start"](99999999)  # a process group that does not exist
        self.release.wait(10)
        if self.error:
            raise EstimateError(self.error)
        breakdown = Breakdown(activations=self.peak_mib * MIB)
        return Estimate(method, self.peak_mib * MIB, breakdown, device, 1.5, self.notes)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('training')\n")
    return tmp_path


def job(workdir: Path, estimator: str | None = "xmem", script: str = "train.py", **fields: object) -> JobSpec:
    """`python SCRIPT`, submitted from an environment whose PATH has this interpreter as `python`."""
    fields.setdefault("env", {"PATH": str(Path(sys.executable).parent)})
    return JobSpec(script, ("python", script), str(workdir), estimator=estimator, **fields)  # type: ignore[arg-type]


def queued(store: Store, *specs: JobSpec) -> dict[int, JobSpec]:
    """The jobs, submitted: {task id: job}."""
    return {store.add(spec, 0.0): spec for spec in specs}


def service(store: Store, jobs: dict, runner: Runner, **options: object) -> Estimates:
    return Estimates(store, jobs, "a100-40gb", run_as_owner=False, runner=runner, **options)  # type: ignore[arg-type]


def requested(estimates: Estimates, *tasks: tuple[int, JobSpec]) -> None:
    """Ask for the tasks' estimates, in order, as the daemon does at their submission, and go on as its next
    scheduling step does once their jobs' files are read (a capture started, or an estimate reused)."""
    for task_id, spec in tasks:
        estimates.request(task_id, spec)
    wait_until(lambda: all(future.done() for future in estimates._reading.values()))
    estimates.collect()


def key(spec: JobSpec, method: str, device: str) -> str:
    """The job's estimate cache key, its files read by this process."""
    return fingerprint(spec, method, device, jobfiles.read(spec))


def test_an_estimate_is_made_once_per_job_in_the_background_and_kept(tmp_path, workdir, caplog):
    store, runner = Store(tmp_path / "carma.db"), Runner(peak_mib=3000, notes=("CUDA autocast ran in float32",))
    bin_dir = str(Path(sys.executable).parent)
    spec = job(workdir, env={"PATH": bin_dir})
    jobs = queued(store, spec, spec)
    assert list(jobs) == [1, 2]
    estimates = service(store, jobs, runner)
    requested(estimates, (1, spec))
    requested(estimates, (2, spec))  # the same job: no second capture
    first = Task(1, TaskSpec("train"), 0.0)
    assert estimates.need(first) is None  # still computing: the task waits
    assert estimates.made(1) is None and estimates.settled(1) is None
    runner.release.set()
    need = wait_until(lambda: estimates.need(first))
    assert (need.kind, need.mib, need.source) == (NeedKind.KNOWN, 3000, "xmem")
    assert estimates.settled(1) == estimates.settled(2) == need  # what the task lists show
    made = estimates.made(1)  # what the task shows
    assert (made.peak_bytes, made.notes) == (3000 * MIB, ("CUDA autocast ran in float32",))
    assert estimates.made(2) == made
    assert estimates.need(Task(2, TaskSpec("train"), 0.0)) == need
    assert len(runner.calls) == 1
    argv, method, options = runner.calls[0]
    assert (argv, method, options["cwd"]) == (["python", "train.py"], "xmem", str(workdir))
    assert options["python"] == f"{bin_dir}/python" and options["env"] == {"PATH": bin_dir}  # the task's own
    estimates.close()

    again = service(store, queued(store, spec), Runner())  # a restarted daemon finds it in the store
    caplog.set_level(logging.INFO, "carma.estimate")
    requested(again, (3, spec))
    assert "task 3 (train.py) takes the xmem estimate made for the same job before: 3000 MiB" in caplog.text
    assert again.settled(3) == need  # known from the store before the scheduler asks
    assert again.need(Task(3, TaskSpec("train"), 0.0)).mib == 3000
    assert again._runner.calls == []
    assert again.made(3) == made  # with its breakdown and notes
    assert again.made(1) == made  # a task placed before the restart still shows what it was placed with
    again.close()


def test_a_capture_of_a_job_on_several_gpus_gives_a_partial_need(tmp_path, workdir):
    """It leaves out the GPUs' communication (NCCL's buffers, DataParallel's reduction): the task holds its
    margin with it, also when a restarted daemon takes the estimate from the store."""
    store, runner = Store(tmp_path / "carma.db"), Runner(peak_mib=17_000)
    runner.release.set()
    one, two = job(workdir), job(workdir, gpus=2)
    estimates = service(store, queued(store, one, two), runner)
    requested(estimates, (1, one))
    requested(estimates, (2, two))
    tasks = [Task(1, TaskSpec("train"), 0.0), Task(2, TaskSpec("train", 2), 0.0)]
    needs = [wait_until(lambda task=task: estimates.need(task)) for task in tasks]
    assert [(need.mib, need.partial) for need in needs] == [(17_000, False), (17_000, True)]
    estimates.close()
    again = service(store, queued(store, two), Runner())
    requested(again, (3, two))
    assert again.need(Task(3, TaskSpec("train", 2), 0.0)) == needs[1]
    again.close()


def test_a_failed_estimate_leaves_the_task_recovery_only_and_says_why(tmp_path, workdir, caplog):
    runner = Runner(error="the script never reached an optimizer step")
    runner.release.set()
    spec, store = job(workdir), Store(tmp_path / "carma.db")
    estimates = service(store, queued(store, spec), runner)
    requested(estimates, (1, spec))
    need = wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0)))
    assert need.kind is NeedKind.UNKNOWN
    assert need.source == "xmem failed: the script never reached an optimizer step"
    assert (
        "could not estimate task 1 (train.py) with xmem (the script never reached an optimizer step); it runs "
        "recovery only" in caplog.text
    )  # it named the job only, and most are called "python"
    assert estimates.made(1) is None  # no estimate to show: the need's source says why
    estimates.close()


def test_an_ended_estimate_is_settled_before_its_task_reaches_the_head_of_the_queue(tmp_path, workdir, caplog):
    """Only the head's need was asked: behind a long queue a failure said nothing, and a finished estimate
    read `xmem pending` and was not cached, until the task's turn."""
    (workdir / "other.py").write_text("print('other')\n")
    failing, fine = job(workdir), job(workdir, script="other.py")
    store = Store(tmp_path / "carma.db")
    jobs = queued(store, failing, fine)
    estimates = service(store, jobs, Runner(error="KeyError: 'label' at train.py:5"))
    requested(estimates, (1, failing))
    estimates._runner.release.set()  # type: ignore[union-attr]
    wait_until(lambda: estimates._running[estimates._fingerprints[1]].future.done())
    estimates.collect()  # each scheduling step; the task is not asked for its need
    assert "could not estimate task 1 (train.py) with xmem (KeyError: 'label' at train.py:5)" in caplog.text
    assert estimates.settled(1).source == "xmem failed: KeyError: 'label' at train.py:5"
    estimates._runner = runner = Runner(peak_mib=2000)
    runner.release.set()
    requested(estimates, (2, fine))
    wait_until(lambda: estimates._running[estimates._fingerprints[2]].future.done())
    estimates.collect()
    assert estimates.settled(2).mib == 2000 and estimates.made(2).peak_bytes == 2000 * MIB  # shown, and cached
    estimates.close()


class SleepingRunner:
    """Stands in for estimate_script with a real child process that never reaches a step: the capture of a
    script that first loads a large dataset."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.options: list[dict] = []

    def __call__(self, argv, method, device, **options):  # type: ignore[no-untyped-def]
        self.options.append(options)
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.children.append(child)
        options["on_start"](child.pid)
        child.wait()
        raise EstimateError(f"killed by signal {-child.returncode}")


def slow_other_slow(tmp_path: Path, workdir: Path) -> tuple[Estimates, SleepingRunner]:
    """Tasks 1 and 3 ask for the same job's estimate, task 2 for another's, behind it on the one worker;
    no capture ever finishes."""
    (workdir / "other.py").write_text("print('other')\n")
    slow, other = job(workdir), job(workdir, script="other.py")
    store, runner = Store(tmp_path / "carma.db"), SleepingRunner()
    estimates = service(store, queued(store, slow, other, slow), runner)
    for task_id, spec in ((1, slow), (2, other), (3, slow)):
        requested(estimates, (task_id, spec))
    return estimates, runner


def test_a_cancelled_tasks_capture_is_killed_and_the_next_estimate_goes_on(tmp_path, workdir):
    estimates, runner = slow_other_slow(tmp_path, workdir)
    wait_until(lambda: runner.children)
    estimates.drop(1)
    assert runner.children[0].poll() is None  # task 3 waits for it
    estimates.drop(3)
    assert runner.children[0].wait(5) == -signal.SIGKILL  # not left to run until its timeout
    wait_until(lambda: estimates.collect() or len(runner.children) == 2)  # the next step starts the next one
    estimates.drop(2)  # killed too, whether its child had started or was about to
    assert runner.children[1].wait(5) == -signal.SIGKILL
    estimates.close()


def test_a_waiting_task_is_told_how_far_its_estimate_is(tmp_path, workdir):
    estimates, runner = slow_other_slow(tmp_path, workdir)
    capturing = re.compile(r"capturing for \d+ s")
    wait_until(lambda: capturing.fullmatch(estimates.progress(1) or ""))
    assert capturing.fullmatch(estimates.progress(3) or "")  # the same capture
    assert estimates.progress(2) == "1 capture ahead of it"
    estimates.drop(1)
    estimates.drop(3)
    wait_until(lambda: estimates.collect() or capturing.fullmatch(estimates.progress(2) or ""))  # the next step
    runner.children[1].kill()  # failed: no estimate under way any more
    wait_until(lambda: estimates.progress(2) is None)
    assert estimates.progress(4) is None  # a task that asked for none
    estimates.close()


def test_the_configuration_sets_how_many_captures_run_at_once_and_for_how_long(tmp_path, workdir):
    (workdir / "other.py").write_text("print('other')\n")
    spec, other = job(workdir), job(workdir, script="other.py")
    store, runner = Store(tmp_path / "carma.db"), SleepingRunner()
    estimates = service(store, queued(store, spec, other), runner, config=EstimateConfig(timeout_s=1800, captures=2))
    requested(estimates, (1, spec))
    requested(estimates, (2, other))
    wait_until(lambda: len(runner.children) == 2)  # both at once, not one behind the other
    assert [options["timeout_s"] for options in runner.options] == [1800, 1800]
    estimates.close()


def test_a_resubmitted_jobs_capture_is_killed_when_it_is_cancelled_too(tmp_path, workdir):
    runner = SleepingRunner()
    spec, store = job(workdir), Store(tmp_path / "carma.db")
    estimates = service(store, queued(store, spec, spec), runner)
    requested(estimates, (1, spec))
    wait_until(lambda: runner.children)
    runner.children[0].kill()  # the first capture fails: task 1 gets recovery only (and may have run since)
    assert wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0))).kind is NeedKind.UNKNOWN
    requested(estimates, (2, spec))  # submitted again: captured again
    wait_until(lambda: estimates.collect() or len(runner.children) == 2)
    estimates.drop(2)
    assert runner.children[1].wait(5) == -signal.SIGKILL  # task 1's earlier interest does not keep it running
    assert estimates.need(Task(1, TaskSpec("train"), 0.0)) is None  # had task 1 still waited, it gets a capture
    wait_until(lambda: estimates.collect() or len(runner.children) == 3)  # at the next scheduling steps
    estimates.close()
    assert runner.children[2].wait(5) == -signal.SIGKILL


def test_an_estimate_is_not_made_for_a_cancelled_task_unless_another_task_waits_for_it(tmp_path, workdir):
    (workdir / "other.py").write_text("print('other')\n")
    spec, other = job(workdir), job(workdir, script="other.py")
    store, runner = Store(tmp_path / "carma.db"), Runner()
    estimates = service(store, queued(store, spec, other, spec, spec), runner)
    for task_id, job_spec in ((1, spec), (2, other), (3, spec), (4, spec)):
        requested(estimates, (task_id, job_spec))
    wait_until(lambda: runner.calls)  # capturing train.py for tasks 1, 3 and 4
    estimates.drop(2)  # other.py's estimate, still to start, is not made
    estimates.drop(1)  # tasks 3 and 4 still wait for train.py's
    estimates.drop(3)  # task 4 still does
    runner.release.set()
    assert wait_until(lambda: estimates.need(Task(4, TaskSpec("train"), 0.0))).mib == 3000
    estimates.close()
    assert [argv for argv, _, _ in runner.calls] == [["python", "train.py"]]


def test_a_job_whose_estimate_failed_is_estimated_again_when_submitted_again(tmp_path, workdir):
    runner = Runner(error="ModuleNotFoundError: No module named 'torch'")
    runner.release.set()
    spec, store = job(workdir), Store(tmp_path / "carma.db")
    jobs = queued(store, spec)
    estimates = service(store, jobs, runner)
    requested(estimates, (1, spec))
    assert wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0))).kind is NeedKind.UNKNOWN
    runner.error = None  # its owner installed PyTorch, and submits it again
    jobs.update(queued(store, spec, spec))
    requested(estimates, (2, spec))
    need = wait_until(lambda: estimates.need(Task(2, TaskSpec("train"), 0.0)))
    assert (need.kind, need.mib, len(runner.calls)) == (NeedKind.KNOWN, 3000, 2)
    requested(estimates, (3, spec))  # a success is kept
    assert estimates.settled(3) == need and len(runner.calls) == 2
    estimates.close()


def test_a_python_missing_from_the_tasks_path_is_a_clear_failure_not_carmas_own(tmp_path, workdir):
    runner = Runner()
    spec, store = job(workdir, env={"PATH": str(tmp_path / "nothing-here")}), Store(tmp_path / "carma.db")
    estimates = service(store, queued(store, spec), runner)
    requested(estimates, (1, spec))
    need = wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0)))
    assert need.source == "xmem failed: python is not on the task's PATH: the task could not start either"
    assert runner.calls == []
    estimates.close()


def test_a_shell_line_cannot_be_captured(tmp_path, workdir):
    runner = Runner()
    spec = JobSpec("train", ("python train.py | tee log",), str(workdir), shell=True, estimator="horus")
    store = Store(tmp_path / "carma.db")
    estimates = service(store, queued(store, spec), runner)
    requested(estimates, (1, spec))
    need = wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0)))
    assert need.kind is NeedKind.UNKNOWN and "shell command line" in need.source and runner.calls == []
    estimates.close()


def test_history_is_the_largest_peak_of_earlier_successful_runs_of_the_command(tmp_path, workdir, caplog):
    caplog.set_level(logging.INFO, "carma.estimate")
    store = Store(tmp_path / "carma.db")
    spec = job(workdir, estimator="history")
    estimates = service(store, {}, Runner())
    assert estimates._history(spec).source == "history: no earlier successful run of this command"
    requested(estimates, (7, spec))
    assert "task 7 (train.py) asks for history, which gives it no memory need yet (no earlier successful" in caplog.text
    for peak, outcome in ((None, "success"), (5000, "success"), (7000, "success"), (9000, "oom")):
        task_id = store.add(spec, 0.0)
        (stored,) = [s for s in store.load() if s.task.id == task_id]
        _end(store, stored.task, outcome, Observation(peak, None, None, None))
        if peak is None:  # a run whose process memory the GPU did not report: there was one, without a peak
            assert estimates._history(spec).source == (
                "history: no peak was observed in the earlier successful run of this command"
            )
    other = JobSpec("train", ("python", "train.py", "--big"), str(workdir), estimator="history")
    assert estimates._history(other).kind is NeedKind.UNKNOWN  # another command
    need = estimates._history(spec)
    assert (need.kind, need.mib, need.source) == (NeedKind.KNOWN, 7000, "history")  # the OOM run does not count
    estimates.close()


def test_another_users_runs_of_the_same_command_never_give_a_history(tmp_path, workdir):
    """In a shared folder another user could otherwise set a job's peak low, and its MPS limit with it."""
    store = Store(tmp_path / "carma.db")
    alice, mallory = job(workdir, estimator="history", user="alice"), job(workdir, estimator="history", user="mallory")
    estimates = service(store, {}, Runner())
    for spec, peak in ((mallory, 100), (alice, 7000)):
        task_id = store.add(spec, 0.0)
        (stored,) = [s for s in store.load() if s.task.id == task_id]
        _end(store, stored.task, "success", Observation(peak, None, None, None))
    assert estimates._history(alice).mib == 7000 and estimates._history(mallory).mib == 100
    assert estimates._history(job(workdir, estimator="history", user="bob")).kind is NeedKind.UNKNOWN
    estimates.close()


def test_an_estimate_the_store_forgot_is_made_again_not_served_from_memory(tmp_path, workdir):
    """A task of the same job got the forgotten estimate from memory, and `carma show` could not show it."""
    store, spec, runner = Store(tmp_path / "carma.db"), job(workdir), Runner(peak_mib=5120)
    estimates = service(store, queued(store, spec, spec), runner)
    runner.release.set()
    requested(estimates, (1, spec))
    assert wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0))).mib == 5120
    estimates.forget(store.forget([1], {}))  # task 1 ended long ago: no task left uses the estimate
    runner.peak_mib = 3000
    need = wait_until(lambda: estimates.need(Task(2, TaskSpec("train"), 0.0)))
    assert (need.mib, len(runner.calls)) == (3000, 2) and estimates.made(2).peak_bytes == 3000 * MIB
    estimates.close()


def test_a_calibration_makes_the_jobs_estimated_before_it_estimated_again(tmp_path, workdir, monkeypatch):
    monkeypatch.setenv("CARMA_HOME", str(tmp_path))
    store, spec, runner = Store(tmp_path / "carma.db"), job(workdir), Runner()
    estimates = service(store, queued(store, spec, spec), runner)
    runner.release.set()
    requested(estimates, (1, spec))
    wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0)))
    (tmp_path / "devices.toml").write_text(
        '["a100-40gb"]\ncontext_bytes = 524288000\ntotal_bytes = 42949672960\nsource = "measured"\n'
    )
    requested(estimates, (2, spec))
    wait_until(lambda: estimates.need(Task(2, TaskSpec("train"), 0.0)))
    assert len(runner.calls) == 2  # not the estimate made with the built-in context
    estimates.close()


def test_history_with_device_constants_it_cannot_read_runs_recovery_only(tmp_path, workdir, monkeypatch):
    """It raised out of the submission (HTTP 500, the task stored but never queued) and out of the restart."""
    monkeypatch.setenv("CARMA_HOME", str(tmp_path))
    (tmp_path / "devices.toml").write_text('["a100-40gb"]\ncontext_bytes = -1\ntotal_bytes = 42949672960\n')
    store = Store(tmp_path / "carma.db")
    spec = job(workdir, estimator="history")
    task_id = store.add(spec, 0.0)
    _end(store, store.load()[0].task, "success")
    store.record_observation(task_id, 1, Observation(5000, None, None, None))
    estimates = service(store, {}, Runner())
    requested(estimates, (2, spec))
    need = estimates._history(spec)
    assert need.kind is NeedKind.UNKNOWN and need.source.startswith(f"history: cannot read {tmp_path}/devices.toml")
    estimates.close()


def test_a_gpu_type_without_constants_takes_those_of_the_nearest_known_device_and_says_so(caplog):
    """Every estimate on an L40S server ran its whole capture, then failed on the unknown device."""
    l40s = Target("GPU-1", "NVIDIA L40S", 46068)
    assert device_for([l40s]) == "a100-40gb"
    assert "use the constants of a100-40gb: `carma estimate calibrate --device nvidia-l40s-45gb`" in caplog.text
    assert device_for([Target("GPU-2", "NVIDIA H100 80GB HBM3", 81559)]) == "h100-80gb"


def _end(store: Store, task: Task, outcome: str, seen: Observation | None = None) -> None:
    """The task's attempt ends, with what telemetry saw of it (saved with the end, as the daemon's journal does)."""
    from carma.core.types import Attempt, ExitKind, TaskState

    task.attempts.append(Attempt(1, (0,), 1.0, exclusive=True, recovery=False, ended_s=2.0, outcome=ExitKind(outcome)))
    task.state, task.ended_s = TaskState.COMPLETED, 2.0
    store.save([task], {(task.id, 1): seen} if seen else None)


def test_the_fingerprint_follows_the_script_and_the_method(workdir):
    spec = job(workdir)
    before = key(spec, "xmem", "a100-40gb")
    assert before == key(spec, "xmem", "a100-40gb")
    assert before != key(spec, "horus", "a100-40gb") != key(spec, "xmem", "h100-80gb")
    (workdir / "train.py").write_text("print('training harder')\n")
    after = key(spec, "xmem", "a100-40gb")
    assert after != before
    other = dataclasses.replace(spec, uid=4242, user="bob")  # the same job, another user's
    assert key(other, "xmem", "a100-40gb") != after


def test_a_fifo_or_device_named_as_the_program_is_not_opened(tmp_path):
    """The fingerprint reads a program's `#!` line as root, on the server's event loop: a FIFO there blocked
    the whole server (at every start too, the task being kept), and a device would be opened."""
    os.mkfifo(tmp_path / "fifo")
    done = []
    for program in ("./fifo", "/dev/zero", "/proc/kmsg"):  # a regular file whose read waits for the kernel
        spec = JobSpec("j", (program, "train.py"), str(tmp_path))
        reader = threading.Thread(target=lambda spec=spec: done.append(key(spec, "xmem", "a100-40gb")), daemon=True)
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), f"the fingerprint of {program} blocked"
    assert len(done) == 3


def test_a_job_on_two_gpus_is_estimated_for_two(tmp_path, workdir):
    """Under DataParallel its first GPU takes half the batch: the capture is told the GPU count, and the
    same command on one GPU is another estimate."""
    one, two = job(workdir), job(workdir, gpus=2)
    assert key(one, "xmem", "a100-40gb") != key(two, "xmem", "a100-40gb")
    runner, store = Runner(), Store(tmp_path / "carma.db")
    estimates = service(store, queued(store, one, two), runner)
    requested(estimates, (1, one))
    requested(estimates, (2, two))
    runner.release.set()
    wait_until(lambda: estimates.collect() or len(runner.calls) == 2)
    assert sorted(options["gpus"] for _, _, options in runner.calls) == [1, 2]
    estimates.close()


def test_an_executable_script_is_captured_with_the_python_its_first_line_names(tmp_path, workdir):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").write_text("#!/bin/sh\n")
    (venv / "python3").chmod(0o755)
    runner, store = Runner(), Store(tmp_path / "carma.db")
    direct = JobSpec("train", ("./train.py",), str(workdir), estimator="xmem", env={"PATH": str(venv)})
    named = JobSpec("tool", ("./tool.py",), str(workdir), estimator="xmem")
    (workdir / "train.py").write_text("#!/usr/bin/env python3\nprint('training')\n")
    (workdir / "tool.py").write_text(f"#!{venv}/python3 -u\nprint('training')\n")
    estimates = service(store, queued(store, direct, named), runner)
    requested(estimates, (1, direct))
    requested(estimates, (2, named))
    runner.release.set()
    wait_until(lambda: estimates.collect() or len(runner.calls) == 2)  # at the daemon's next steps
    assert [options["python"] for _, _, options in runner.calls] == [f"{venv}/python3"] * 2
    estimates.close()


def test_the_fingerprint_follows_the_modules_beside_the_script_but_not_its_data(workdir):
    spec, module = job(workdir), JobSpec("train", ("python", "-m", "pkg.train"), str(workdir), estimator="xmem")
    (workdir / "pkg").mkdir()
    (workdir / "pkg" / "train.py").write_text("import models.mlp\n")
    (workdir / "models").mkdir()
    (workdir / "models" / "mlp.py").write_text("WIDTH = 256\n")
    before = [key(s, "xmem", "a100-40gb") for s in (spec, module)]
    for name in (".venv/lib/site.py", "data/points.csv", "checkpoints/__pycache__/mlp.py"):
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text("changed\n")
    images = workdir / "data" / "images"  # a folder this large holds data: not looked through
    images.mkdir()
    for i in range(1001):
        (images / f"{i}.py").touch()
    assert [key(s, "xmem", "a100-40gb") for s in (spec, module)] == before
    (workdir / "models" / "mlp.py").write_text("WIDTH = 4096\n")  # the model made wider
    after = [key(s, "xmem", "a100-40gb") for s in (spec, module)]
    assert after[0] != before[0] and after[1] != before[1]


def test_the_fingerprint_follows_the_environment_and_the_files_the_command_names(workdir):
    """`HIDDEN=256` and `HIDDEN=16384`, or a config file made larger, shared one estimate (an OOM waiting to
    happen); a login session's variables, which differ from shell to shell, do not count."""
    (workdir / "cfg.yaml").write_text("width: 256\n")
    base = {"PATH": "/usr/bin", "HIDDEN": "256"}
    specs = {
        "base": job(workdir, env=base),
        "session": job(
            workdir,
            env={
                **base,
                "SSH_TTY": "/dev/pts/3",
                "PWD": "/x",
                "TERM": "tmux",
                "SHLVL": "2",
                "ATUIN_HISTORY_ID": "0192",
                "KITTY_WINDOW_ID": "3",
                "SLURM_JOB_ID": "77",
            },
        ),
        "hidden": job(workdir, env={**base, "HIDDEN": "16384"}),
    }
    prints = {name: key(spec, "xmem", "a100-40gb") for name, spec in specs.items()}
    assert prints["base"] == prints["session"] != prints["hidden"]
    for own in ("HISTORY_LEN", "WINDOW", "LINES"):  # a job's settings that share a start or a name with a shell's
        assert key(job(workdir, env={**base, own: "64"}), "xmem", "a100-40gb") != prints["base"]
    for argv in (("python", "train.py", "cfg.yaml"), ("python", "train.py", f"--config={workdir}/cfg.yaml")):
        spec = JobSpec("train", argv, str(workdir), estimator="xmem", env=base)
        before = key(spec, "xmem", "a100-40gb")
        (workdir / "cfg.yaml").write_text((workdir / "cfg.yaml").read_text() + "depth: 8\n")
        assert key(spec, "xmem", "a100-40gb") != before
    logs = JobSpec("train", ("python", "train.py", "--log", "out.log"), str(workdir), estimator="xmem", env=base)
    (workdir / "out.log").write_text("step 1\n")
    before = key(logs, "xmem", "a100-40gb")
    (workdir / "out.log").write_text("step 1\nstep 2\n")  # the job's own output: not one of its settings
    assert key(logs, "xmem", "a100-40gb") == before


def test_the_fingerprint_follows_the_python_the_task_would_run(tmp_path, workdir):
    """Another environment's interpreter has other packages (another PyTorch): another estimate."""
    envs = []
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "python").write_text("#!/bin/sh\n")
        (tmp_path / name / "python").chmod(0o755)
        envs.append(job(workdir, env={"PATH": str(tmp_path / name)}))
    old, new = (key(spec, "xmem", "a100-40gb") for spec in envs)
    assert old != new
    assert old == key(job(workdir, env={"PATH": f"{tmp_path / 'old'}:{tmp_path / 'new'}"}), "xmem", "a100-40gb")


def test_a_task_waits_while_its_jobs_files_are_read_and_one_users_hung_read_holds_no_other(
    tmp_path, workdir, monkeypatch
):
    """The files are read off the scheduling loop, in a child (as the task's owner under a root daemon): the
    task says so while it waits; a user whose reads hang (a network home gone) holds up no other user's, and
    their estimates fail, saying why, when the daemon stops, which kills the child."""
    reads: list[list[int]] = []

    def read_in_child(jobs, groups, timeout_s=30.0, stopped=lambda: False):  # type: ignore[no-untyped-def]
        reads.append([spec.uid for spec in jobs])
        if jobs[0].uid == 4242:  # bob's home hangs
            while not stopped():
                time.sleep(0.01)
            raise EstimateError("the daemon stopped")
        if jobs[0].uid == 77:  # carol's folder holds a file the reader trips on
            return ["UnicodeEncodeError: 'utf-8' codec can't encode character"]
        return [jobfiles.JobFiles(sys.executable, f"digest of {spec.argv}") for spec in jobs]

    monkeypatch.setattr(jobfiles, "read_in_child", read_in_child)
    bob, alice, carol = (job(workdir, uid=uid) for uid in (4242, 1000, 77))
    store, runner = Store(tmp_path / "carma.db"), Runner()
    runner.release.set()
    estimates = service(store, queued(store, bob, bob, alice, carol), runner)
    for task_id, spec in ((1, bob), (2, bob), (3, alice), (4, carol)):
        estimates.request(task_id, spec)
    tasks = {task_id: Task(task_id, TaskSpec("train"), 0.0) for task_id in (1, 2, 3, 4)}
    assert wait_until(lambda: estimates.need(tasks[3])).mib == 3000  # alice's, past bob's hung read
    assert estimates.need(tasks[1]) is None and estimates.progress(1) == estimates.progress(2) == "reading its files"
    need = wait_until(lambda: estimates.need(tasks[4]))
    assert (
        need.source
        == "xmem failed: its files could not be read (UnicodeEncodeError: 'utf-8' codec can't encode character)"
    )
    assert estimates.settled(4) == need and len(runner.calls) == 1
    assert sorted(owner for owner, *_ in reads) == [77, 1000, 4242]  # one of bob's reads at a time
    estimates.close()  # bob's hung read is stopped
    assert wait_until(lambda: estimates.need(tasks[1])).source == "xmem failed: the daemon stopped"


def test_a_jobs_files_are_read_in_a_child_each_jobs_apart(tmp_path, workdir):
    """A file name that is not UTF-8 (Latin-1 bytes) failed the whole read; one job's failure is its own."""
    (workdir / os.fsdecode(b"caf\xe9.py")).write_text("print('named in Latin-1')\n")
    spec, no_command = job(workdir), JobSpec("empty", (), str(workdir))
    files, failed = jobfiles.read_in_child([spec, no_command])
    assert files == jobfiles.read(spec) and files.python == f"{Path(sys.executable).parent}/python"
    assert failed.startswith("IndexError: ")
    with pytest.raises(EstimateError, match=r"^reading the job's files took over 0.001 s$"):
        jobfiles.read_in_child([spec], timeout_s=0.001)  # less than Python takes to start


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root")
def test_a_root_daemon_reads_a_jobs_files_as_its_owner():
    """A closed script's `#!` line and contents, read by root, told its interpreter to any user and whether it
    changed; read as the owner they tell nothing, and the task could not run it either."""
    if not nobody_can_run_carma():
        pytest.skip(f"user nobody cannot run {sys.executable} with carma (not readable by others)")
    closed, shared = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())  # mode 0700, root's
    shared.chmod(0o755)
    try:
        (closed / "secret.py").write_text("#!/usr/bin/python3\nKEY = 1\n")
        (closed / "secret.py").chmod(0o755)
        spec = JobSpec("secret", ("./secret.py",), str(closed), uid=NOBODY, gid=NOBODY, user="nobody")
        (shared / "train.py").write_text("#!/usr/bin/python3\nprint('training')\n")
        (shared / "train.py").chmod(0o755)
        own = dataclasses.replace(spec, argv=("./train.py",), workdir=str(shared))
        as_root, (as_nobody, own_files) = jobfiles.read(spec), jobfiles.read_in_child([spec, own], [])  # one child
        assert as_root.python == "/usr/bin/python3" and as_nobody.python is None
        assert own_files == jobfiles.read(own)  # what nobody may read is read alike
        (closed / "secret.py").write_text("#!/usr/bin/python3\nKEY = 2\n")
        assert jobfiles.read(spec) != as_root and jobfiles.read_in_child([spec], []) == [as_nobody]
        with pytest.raises(ValueError):  # one child reads one user's jobs
            jobfiles.read_in_child([own, dataclasses.replace(own, uid=0, gid=0)], [])
    finally:
        shutil.rmtree(closed)
        shutil.rmtree(shared)


def test_a_read_whose_owners_groups_cannot_be_looked_up_fails_the_estimate(tmp_path, workdir, monkeypatch):
    """With sssd or LDAP down the groups lookup raised before the read, and the task waited for ever."""

    def no_directory(spec: JobSpec) -> list[int]:
        raise OSError("getgrouplist: the directory service does not answer")

    monkeypatch.setattr("carma.server.estimates.groups_of", no_directory)
    spec, store, runner = job(workdir), Store(tmp_path / "carma.db"), Runner()
    estimates = Estimates(store, queued(store, spec), "a100-40gb", run_as_owner=True, runner=runner)
    estimates.request(1, spec)
    need = wait_until(lambda: estimates.need(Task(1, TaskSpec("train"), 0.0)))
    assert need.source == "xmem failed: OSError: getgrouplist: the directory service does not answer"
    estimates.close()


def test_users_captures_are_taken_in_turn(tmp_path, workdir):
    """Captures were first come, first served: one user's, up to 10 minutes each, held every other user's
    estimates behind them. The user served longest ago goes next."""
    for name in ("a2.py", "a3.py"):
        (workdir / name).write_text(f"print('{name}')\n")
    alice = [job(workdir, script=script, uid=1000) for script in ("train.py", "a2.py", "a3.py")]
    bob = job(workdir, uid=2000)
    store, runner = Store(tmp_path / "carma.db"), Runner()
    estimates = service(store, queued(store, *alice, bob), runner)
    requested(estimates, (1, alice[0]), (2, alice[1]), (3, alice[2]), (4, bob))
    wait_until(lambda: runner.calls)  # alice's first
    assert [estimates.progress(task) for task in (2, 3, 4)] == [
        "2 captures ahead of it",
        "3 captures ahead of it",
        "1 capture ahead of it",  # bob's next, before alice's second
    ]
    runner.release.set()
    wait_until(lambda: estimates.collect() or len(runner.calls) == 4)
    assert [argv[1] for argv, _, _ in runner.calls] == ["train.py", "train.py", "a2.py", "a3.py"]
    assert [options["cwd"] for _, _, options in runner.calls] == [str(workdir)] * 4
    estimates.close()


def test_a_waiting_tasks_turn_follows_the_captures_dropped_and_added(tmp_path, workdir):
    """The turns' order is worked out once per change to them (once per task asked about, 3,000 waiting tasks
    made each listing 10 s of the event loop): a capture dropped or added moves the others' turns."""
    (workdir / "a2.py").write_text("print('a2')\n")
    alice = [job(workdir, script=script, uid=1000) for script in ("train.py", "a2.py")]
    bob, carol = job(workdir, uid=2000), job(workdir, uid=3000)
    store, runner = Store(tmp_path / "carma.db"), Runner()
    estimates = service(store, queued(store, *alice, bob, carol), runner)
    requested(estimates, (1, alice[0]), (2, alice[1]), (3, bob))
    wait_until(lambda: runner.calls)  # alice's first
    assert [estimates.progress(task) for task in (2, 3)] == ["2 captures ahead of it", "1 capture ahead of it"]
    estimates.drop(3)
    assert estimates.progress(2) == "1 capture ahead of it"
    requested(estimates, (4, carol))
    assert [estimates.progress(task) for task in (2, 4)] == ["2 captures ahead of it", "1 capture ahead of it"]
    runner.release.set()
    estimates.close()
