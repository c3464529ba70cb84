"""Memory estimates for the daemon's tasks: the core's Estimator port, answered in the background.

A task may ask for an estimator (`carma submit --estimate xmem`). A CPU method captures the task's own
script (its interpreter, directory, environment and user) in a child process, on worker threads (one
capture at a time unless `[estimate] captures` says more), never in the scheduling loop; until it is done
the task waits at the head of the queue. The
result is cached by the job's fingerprint (command, interpreter, directory, script contents, method,
device) in the store, so the same job is not estimated twice, across restarts too. `history` needs no
capture: it is the largest peak an earlier successful run of the same command was observed at. An
estimator that fails (the script never reaches an optimizer step, times out, is a shell line) leaves the
task recovery only, and the reason is logged and shown as the attempt's memory source. A failure is not
kept: the same job submitted again is estimated again, as its owner may have fixed the cause (installed a
package, freed host memory). A capture's estimate, with its breakdown and notes, is shown with the task
(`carma show`), so its owner can see what the placement was based on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

from carma.config import EstimateConfig
from carma.core.memory import RECOVERY_ONLY, estimated
from carma.core.types import ExitKind, GpuInfo, MemoryNeed, NeedKind, Task, TaskId
from carma.estimate.base import Estimate, EstimateError
from carma.server.executor import groups_of
from carma.server.spec import JobSpec
from carma.server.store import Store

MIB = 1 << 20
SCRIPT_BYTES = 16 << 20  # how much of the script file goes into the fingerprint
log = logging.getLogger("carma.estimate")

Runner = Callable[..., Estimate]  # carma.estimate.runner.estimate_script's signature


def device_for(gpus: list[GpuInfo]) -> str:
    """The estimator's device name for this server: its largest GPU's type."""
    from carma.estimate.devices import device_name_for

    largest = max(gpus, key=lambda g: g.total_mib)
    return device_name_for(largest.name, largest.total_mib * MIB)


def fingerprint(job: JobSpec, method: str, device: str) -> str:
    """Same command, interpreter, directory, script contents, method and device: the same estimate."""
    identity = [list(job.argv), _interpreter(job), job.workdir, job.shell, method, device]
    digest = hashlib.sha256(json.dumps(identity).encode())
    for word in job.argv[1:2] if len(job.argv) > 1 else job.argv:  # `python train.py`: train.py
        path = Path(job.workdir, word)
        with suppress(OSError):
            if path.is_file():
                with path.open("rb") as f:
                    digest.update(f.read(SCRIPT_BYTES))
    return digest.hexdigest()[:32]


class Estimates:
    """The Estimator port over the daemon's jobs (`name` shows in waiting reasons and need sources)."""

    name = "estimate"

    def __init__(
        self,
        store: Store,
        jobs: Mapping[TaskId, JobSpec],
        device: str,
        run_as_owner: bool,
        runner: Runner | None = None,
        config: EstimateConfig | None = None,
    ) -> None:
        self._store = store
        self._jobs = jobs
        self.device = device
        self._run_as_owner = run_as_owner
        self._runner = runner
        config = config or EstimateConfig()
        self._timeout_s = config.timeout_s
        self._pool = ThreadPoolExecutor(max_workers=config.captures, thread_name_prefix="carma-estimate")
        self._fingerprints: dict[TaskId, str] = {}
        self._running: dict[str, Future[Estimate]] = {}
        self._done: dict[str, MemoryNeed] = {}
        self._waiters: dict[str, set[TaskId]] = {}  # the tasks that asked for each estimate under way
        self._children: dict[str, int] = {}  # the process group of each capture under way, by fingerprint
        self._abandoned: set[str] = set()  # captures whose tasks all left the queue: stopped as they start

    def request(self, task_id: TaskId, job: JobSpec) -> None:
        """Start estimating a newly queued task's job, unless it asked for none, is known, or is under way. A
        job whose last estimate failed is estimated again (tasks still queued with it wait for the new one)."""
        method = job.estimator
        if method is None or method == "history":
            return
        key = self._fingerprints[task_id] = fingerprint(job, method, self.device)
        self._store.link_estimate(task_id, key)
        if key in self._running:
            self._waiters[key].add(task_id)
            return
        if key in self._done and self._done[key].kind is not NeedKind.UNKNOWN:
            return
        self._done.pop(key, None)
        cached = self._store.estimate(key)
        if cached is not None:
            self._done[key] = _need(cached)
            return
        self._running[key] = self._pool.submit(self._estimate, key, job, method)
        self._waiters[key] = {task_id}

    def need(self, task: Task) -> MemoryNeed | None:
        job = self._jobs[task.id]
        if job.estimator is None:
            return RECOVERY_ONLY
        if job.estimator == "history":
            return self._history(job)
        key = self._fingerprints.get(task.id)
        # Asked again when a placement dropped at a restart put the task back in the queue, or the estimate
        # it waited for was dropped with the cancelled tasks that asked for it first
        if key is None or (key not in self._done and key not in self._running):
            self.request(task.id, job)
            key = self._fingerprints[task.id]
        if key not in self._done:
            future = self._running[key]
            if not future.done():
                return None
            self._done[key] = self._settle(key, job, future)
            del self._running[key], self._waiters[key]
        return self._done[key]

    def settled(self, task_id: TaskId) -> MemoryNeed | None:
        """The need a finished estimate gave the task's job, without asking for one (for the task lists:
        cheap, no store read); None while the estimate is under way or not yet taken up by the scheduler."""
        key = self._fingerprints.get(task_id)
        return None if key is None else self._done.get(key)

    def made(self, task_id: TaskId) -> Estimate | None:
        """The estimate a capture made of the task's job, once there is one (never for `history`); the store
        keeps which one each task uses, so tasks from before a restart have theirs too."""
        return self._store.task_estimate(task_id)

    def drop(self, task_id: TaskId) -> None:
        """Forget a task that left the queue unplaced (cancelled): unless another queued task waits for the
        same job's estimate, it is not made, or its capture is killed, so the next estimate need not wait."""
        key = self._fingerprints.pop(task_id, None)
        waiters = self._waiters.get(key) if key is not None else None
        if waiters is None:
            return
        waiters.discard(task_id)
        if waiters:
            return
        del self._waiters[key]
        if not self._running.pop(key).cancel():  # capturing already (or about to)
            self._abandoned.add(key)
            _kill(self._children.get(key))

    def close(self) -> None:
        """Stop estimating: queued estimates are dropped, captures under way are killed."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for group in list(self._children.values()):
            _kill(group)

    # ----------------------------------------------------------------- in the worker thread

    def _estimate(self, key: str, job: JobSpec, method: str) -> Estimate:
        if job.shell:
            raise EstimateError("a shell command line cannot be captured; submit `python script.py ...` instead")
        runner = self._runner
        if runner is None:
            from carma.estimate.runner import estimate_script as runner
        owner = {"user": job.uid, "group": job.gid, "extra_groups": groups_of(job)} if self._run_as_owner else {}

        def started(group: int) -> None:
            self._children[key] = group
            if key in self._abandoned:  # dropped between the worker taking it up and the child starting
                _kill(group)

        try:
            return runner(
                list(job.argv), method, self.device, timeout_s=self._timeout_s, python=_interpreter(job),
                cwd=job.workdir, env=dict(job.env), on_start=started, **owner,
            )  # fmt: skip
        finally:
            self._children.pop(key, None)
            self._abandoned.discard(key)

    # ----------------------------------------------------------------- back in the scheduling loop

    def _settle(self, key: str, job: JobSpec, future: Future[Estimate]) -> MemoryNeed:
        try:
            result = future.result()
        except EstimateError as e:
            return self._failed(job, str(e))
        except Exception as e:  # an estimator's bug must not stop the daemon: the task runs recovery only
            log.exception("estimating %s crashed", job.name)
            return self._failed(job, f"{type(e).__name__}: {e}")
        self._store.add_estimate(key, result, time.time())
        log.info("estimated %s with %s in %.1f s: %d MiB", job.name, result.method, result.seconds, _mib(result))
        for note in result.notes:
            log.warning("estimate of %s: %s", job.name, note)
        return _need(result)

    def _failed(self, job: JobSpec, reason: str) -> MemoryNeed:
        log.warning("could not estimate %s with %s (%s); it runs recovery only", job.name, job.estimator, reason)
        return MemoryNeed(NeedKind.UNKNOWN, source=f"{job.estimator} failed: {reason}")

    def _history(self, job: JobSpec) -> MemoryNeed:
        """The largest peak observed in an earlier successful run of the same command."""
        from carma.estimate.registry import history_estimate

        same = [list(job.argv), job.workdir, job.shell]
        peaks = [
            run["peak_mib"]
            for run in self._store.history()
            if run["outcome"] == ExitKind.SUCCESS.value and run["peak_mib"]
            and [run["command"], run["workdir"], run["shell"]] == same
        ]  # fmt: skip
        if not peaks:
            return MemoryNeed(NeedKind.UNKNOWN, source="history: no earlier successful run of this command")
        return _need(history_estimate(max(peaks) * MIB, self.device))


def _kill(group: int | None) -> None:
    if group is not None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def _need(estimate: Estimate) -> MemoryNeed:
    return estimated(estimate.method, _mib(estimate))


def _mib(estimate: Estimate) -> int:
    return math.ceil(estimate.peak_bytes / MIB)


def _interpreter(job: JobSpec) -> str | None:
    """The Python the task would run (`python` looked up on the task's PATH, or the one an executable
    script's `#!` line names), so that its packages are the ones captured; None (carma's own) when the
    command names no interpreter."""
    from carma.estimate.script import is_python, shebang_program

    first = job.argv[0]
    if not is_python(first):
        first = shebang_program(Path(job.workdir, first)) or ""
        if not is_python(first):
            return None
    if "/" in first:
        return str(Path(job.workdir, first))
    return shutil.which(first, path=job.env.get("PATH")) or None
