"""Memory estimates for the daemon's tasks: the core's Estimator port, answered in the background.

A task may ask for an estimator (`carma submit --estimate xmem`). A CPU method captures the task's own
script (its interpreter, directory, environment and user) in a child process, on worker threads (one
capture at a time unless `[estimate] captures` says more), never in the scheduling loop; until it is done
the task waits, and the tasks behind it are placed meanwhile (`carma.core.queue.first_waiting`). The result
is cached by the job's fingerprint (user, command, interpreter, directory, the script and the Python files
around it, method, device; its files read as its user, off the loop: `carma.server.jobfiles`) in the store, so the
same job is not estimated twice, across restarts too. `history` needs no capture: it is the largest peak
an earlier successful run of the same command was observed at. An estimator that fails (the script never
reaches an optimizer step, times out, is a shell line) leaves the task recovery only, and the reason is
logged and shown as the attempt's memory source. A failure is not kept: the same job submitted again is
estimated again, as its owner may have fixed the cause (installed a package, freed host memory). A
capture's estimate, with its breakdown and notes, is shown with the task (`carma show`), so its owner can
see what the placement was based on; cancelling the tasks waiting for a capture kills it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from carma.config import EstimateConfig
from carma.core.memory import RECOVERY_ONLY, estimated
from carma.core.types import MemoryNeed, NeedKind, Target, Task, TaskId
from carma.estimate.base import Estimate, EstimateError
from carma.estimate.runner import estimate_script, kill_group
from carma.estimate.script import is_python
from carma.server import jobfiles
from carma.server.executor import groups_of
from carma.server.history import CommandHistory
from carma.server.jobfiles import JobFiles
from carma.server.spec import JobSpec
from carma.server.store import Store
from carma.units import pluralize

MIB = 1 << 20
# The variables of a login session, a terminal or a batch job, which differ from shell to shell (some from
# command to command) and which no training job reads for its settings: left out of the fingerprint. Names
# are matched whole, or by prefixes that only these tools use (a job's own HISTORY_LEN or WINDOW counts).
SESSION_VARIABLES = {
    "PATH", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLORTERM", "DISPLAY", "WINDOWID", "XAUTHORITY", "LS_COLORS",
    "PS1", "PS2", "PROMPT_COMMAND", "MAIL", "STY", "DBUS_SESSION_BUS_ADDRESS", "GPG_AGENT_INFO", "INVOCATION_ID",
    "JOURNAL_STREAM", "MOTD_SHOWN", "LESSOPEN", "LESSCLOSE", "KRB5CCNAME", "SESSION_MANAGER", "WSL_INTEROP",
    "WSLENV", "WT_SESSION", "WT_PROFILE_ID", "SECURITYSESSIONID", "HISTFILE", "HISTSIZE", "HISTFILESIZE",
    "HISTCONTROL", "HISTIGNORE", "HISTTIMEFORMAT", "GNOME_TERMINAL_SCREEN", "GNOME_TERMINAL_SERVICE",
    "KONSOLE_DBUS_SESSION", "KONSOLE_DBUS_WINDOW", "SHELL_SESSION_ID", "TILIX_ID", "TERMINATOR_UUID",
    "ALACRITTY_WINDOW_ID", "JPY_PARENT_PID", "LS_JOBPID",
}  # fmt: skip
SESSION_PREFIXES = (
    "SSH_", "TERM_", "TMUX", "XDG_SESSION_", "XDG_SEAT", "XDG_VTNR", "VTE_", "VSCODE_", "ATUIN_", "STARSHIP_",
    "SLURM_", "PBS_", "LSB_", "SGE_", "OAR_", "KITTY_", "WEZTERM_", "ITERM_", "ZELLIJ",
)  # fmt: skip
log = logging.getLogger("carma.estimate")

Runner = Callable[..., Estimate]  # carma.estimate.runner.estimate_script's signature


def device_for(gpus: list[Target]) -> str:
    """The estimator's device for this server: its largest GPU's type. A type carma has no constants for
    (an L40S, say, until `carma estimate calibrate` has measured it) takes those of the known device
    nearest in memory, said once: without, every estimate would fail after its capture."""
    from carma.estimate.devices import BUILTIN, calibration_path, device_name_for, devices

    largest = max(gpus, key=lambda g: g.total_mib)
    total = largest.total_mib * MIB
    name = device_name_for(largest.name, total)
    try:
        known = devices()
    except EstimateError as e:  # each estimate says so too; the name must still be chosen
        log.error("%s: estimates fail until it is fixed", e)
        known = BUILTIN
    if name in known:
        return name
    nearest = min(known.values(), key=lambda d: abs(d.total_bytes - total)).name
    log.warning(
        "estimates for this server's %s use the constants of %s: `carma estimate calibrate --device %s` "
        "measures its own, for the server into %s", largest.name, nearest, name, calibration_path(),
    )  # fmt: skip
    return nearest


def fingerprint(job: JobSpec, method: str, device: str, files: JobFiles | None) -> str:
    """Same user, command, interpreter, directory, environment, GPU count, script, method and device: the same
    estimate (a model under DataParallel is estimated for its first GPU's share of the batch). The user is part
    of it: another user's capture runs their code, which could write the result (a peak set low, an MPS limit
    that crashes the job), and must never shape this user's job.

    `files` (`carma.server.jobfiles`, None where they could not be read) is the script and the size and time
    of each Python file around it: a model edited in `model.py` beside `train.py` is estimated again. So is a
    job whose environment (`HIDDEN=4096`), less a login session's variables, or a file its command names
    (`--config big.yaml`) changed: a stale estimate is an OOM crash, a needless one a capture."""
    read = (files.python, files.digest) if files is not None else None
    identity = [job.uid, list(job.argv), job.workdir, job.shell, method, device, _settings(job.env), job.gpus, read]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]


def _settings(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The environment a job could read its settings from: less the variables of a login session (each
    shell has its own) and PATH (the interpreter it resolves to counts instead)."""
    return sorted(
        (name, value)
        for name, value in env.items()
        if name not in SESSION_VARIABLES and not name.startswith(SESSION_PREFIXES)
    )


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
        self.history = CommandHistory(store)  # what `history` reads, and the daemon's expected durations
        self.device = device
        self._run_as_owner = run_as_owner
        self._runner = runner
        config = self.config = config or EstimateConfig()
        self._timeout_s = config.timeout_s
        self._pool = ThreadPoolExecutor(max_workers=config.captures, thread_name_prefix="carma-estimate")
        self._readers = jobfiles.Readers(groups_of if run_as_owner else None)
        self._reading: dict[TaskId, Future[JobFiles]] = {}
        self._unreadable: dict[TaskId, MemoryNeed] = {}  # tasks whose job's files could not be read
        self._fingerprints: dict[TaskId, str] = {}
        self._running: dict[str, _Capture] = {}
        # captures not started yet, per user; the user whose capture started longest ago goes next (`_served`),
        # so that one user's captures (up to 10 minutes each) never hold every other user's behind them
        self._turns: dict[int, deque[_Capture]] = {}
        self._served: dict[int, int] = {}  # uid: the number of the last capture started for it
        self._order: tuple[int, dict[int, int]] = (-1, {})  # (`_moves` then, the turns' order by id(capture))
        self._moves = 0  # changes to the turns: captures waiting, started or dropped
        self._taken: list[_Capture] = []  # the captures workers took: running, or finished since
        self._done: dict[str, MemoryNeed] = {}

    def request(self, task_id: TaskId, job: JobSpec) -> None:
        """Start estimating a newly queued task's job, unless it asked for none, is known, or is under way. A
        job whose last estimate failed is estimated again (tasks still queued with it wait for the new one)."""
        method = job.estimator
        if method == "history":  # read when the task is placed; said now when there is nothing to read yet
            need = self._history(job)
            if need.kind is NeedKind.UNKNOWN:
                why = need.source.removeprefix("history: ")
                log.info(
                    "task %d (%s) asks for history, which gives it no memory need yet (%s): unless a run of its "
                    "command ends before it is placed, it runs recovery only", task_id, job.name, why,
                )  # fmt: skip
            return
        if method is None:
            return
        self._fingerprints.pop(task_id, None)
        self._unreadable.pop(task_id, None)
        self._reading[task_id] = self._readers.ask(job)

    def _keyed(self, task_id: TaskId) -> bool:
        """Go on with a task whose job's files have been read (`request`): reuse the estimate made for the same
        job, join the capture under way for it, or start one; whether they have been read."""
        future = self._reading[task_id]
        if not future.done():
            return False
        del self._reading[task_id]
        job, method = self._jobs[task_id], str(self._jobs[task_id].estimator)
        try:
            files: JobFiles | None = future.result()
        except EstimateError as e:  # the estimate fails, and says why; a failure is not kept
            files, why = None, str(e)
        except Exception as e:
            log.error("reading the files of task %d crashed", task_id, exc_info=e)
            files, why = None, f"{type(e).__name__}: {e}"
        if files is None:  # kept with the task, not as the job's estimate: another read may succeed
            self._unreadable[task_id] = self._failed(f"task {task_id} ({job.name})", job, why)
            return True
        key = self._fingerprints[task_id] = fingerprint(job, method, self._device_identity(), files)
        self._store.link_estimate(task_id, key)
        if key in self._running:
            self._running[key].waiters.add(task_id)
            return True
        if key in self._done and self._done[key].kind is not NeedKind.UNKNOWN:
            self._reused(task_id, job, self._done[key])
            return True
        self._done.pop(key, None)
        cached = self._store.estimate(key)
        if cached is not None:
            self._done[key] = _need(cached, multi_gpu=job.gpus > 1)
            self._reused(task_id, job, self._done[key])
            return True
        capture = self._running[key] = _Capture(task_id, job, method, files.python)
        self._turns.setdefault(job.uid, deque()).append(capture)
        self._moves += 1
        self._start_captures()
        return True

    def _start_captures(self) -> None:
        """Start the captures waiting their turn while the workers are free, users in turn."""
        free = self.config.captures - self._busy()
        while free > 0 and (capture := _take_turn(self._turns, self._served)) is not None:
            self._moves += 1
            capture.future.set_running_or_notify_cancel()  # not cancelled: `_take_turn` passed those over
            self._taken.append(capture)
            self._pool.submit(self._capture, capture)
            free -= 1

    def _busy(self) -> int:
        """How many captures the workers have taken and not finished: counted among those taken, not among every
        capture waiting (once per task listed, 3,000 waiting captures made a listing 3.4 s of the event loop)."""
        self._taken = [capture for capture in self._taken if not capture.future.done()]
        return len(self._taken)

    def need(self, task: Task) -> MemoryNeed | None:
        job = self._jobs[task.id]
        if job.estimator is None:
            return RECOVERY_ONLY
        if job.estimator == "history":
            return self._history(job)
        if task.id in self._reading and not self._keyed(task.id):
            return None
        if task.id in self._unreadable:
            return self._unreadable[task.id]
        key = self._fingerprints.get(task.id)
        # Asked again when a placement dropped at a restart put the task back in the queue, or the estimate
        # it waited for was dropped with the cancelled tasks that asked for it first
        if key is None or (key not in self._done and key not in self._running):
            self.request(task.id, job)
            return None
        if key not in self._done and not self._collected(key):
            return None
        return self._done[key]

    def collect(self) -> None:
        """Settle every estimate that has ended, its tasks at the head of the queue or not (each scheduling
        step): logged, cached and shown at once, where a failure found behind a long queue said nothing, and
        a finished estimate read `pending`, until its task's turn (and a restart before then lost it)."""
        for task_id in [task_id for task_id, future in self._reading.items() if future.done()]:
            self._keyed(task_id)
        for key in [key for key, capture in self._running.items() if capture.future.done()]:
            self._collected(key)
        self._start_captures()

    def _collected(self, key: str) -> bool:
        """Settle the estimate `key` if its capture has ended; whether it has."""
        capture = self._running[key]
        if not capture.future.done():
            return False
        del self._running[key]
        self._done[key] = self._settle(key, self._jobs[min(capture.waiters)], capture.future, capture.waiters)
        return True

    def settled(self, task_id: TaskId) -> MemoryNeed | None:
        """The need a finished estimate gave the task's job, without asking for one (for the task lists:
        cheap, no store read); None while the estimate is under way or not yet taken up by the scheduler."""
        key = self._fingerprints.get(task_id)
        return self._unreadable.get(task_id) if key is None else self._done.get(key)

    def progress(self, task_id: TaskId) -> str | None:
        """Where the estimate a task waits for stands, for its waiting reason: how long its capture has run,
        or how many captures are ahead of it on the workers; None when none is under way for it."""
        if task_id in self._reading:
            return "reading its files"
        key = self._fingerprints.get(task_id)
        capture = self._running.get(key) if key is not None else None
        if capture is None or capture.future.done():
            return None
        if capture.started_s is not None:
            return f"capturing for {time.monotonic() - capture.started_s:.0f} s"
        ahead = self._busy() + self._turn_of(capture)
        return f"{pluralize(ahead, 'capture')} ahead of it" if ahead else "starting its capture"

    def _turn_of(self, capture: _Capture) -> int:
        """How many captures waiting their turn start before `capture`, as `_start_captures` will take them: the
        whole order is worked out once per change to the turns, not per task asked about (3,000 waiting tasks
        made one listing of them 10 s of the event loop)."""
        moves, order = self._order
        if moves != self._moves:
            turns, served, order = {uid: deque(line) for uid, line in self._turns.items()}, dict(self._served), {}
            while (next_one := _take_turn(turns, served)) is not None:
                order[id(next_one)] = len(order)
            self._order = (self._moves, order)
        return order.get(id(capture), 0)

    def made(self, task_id: TaskId) -> Estimate | None:
        """The estimate a capture made of the task's job, once there is one (never for `history`); the store
        keeps which one each task uses, so tasks from before a restart have theirs too."""
        return self._store.task_estimate(task_id)

    def drop(self, task_id: TaskId) -> None:
        """Forget a task that left the queue unplaced (cancelled): unless another queued task waits for the
        same job's estimate, it is not made, or its capture is killed, so the next estimate need not wait."""
        reading = self._reading.pop(task_id, None)
        if reading is not None:
            reading.cancel()  # or, when already under way, read for nothing
        self._unreadable.pop(task_id, None)
        key = self._fingerprints.pop(task_id, None)
        if key is None or (capture := self._running.get(key)) is None:
            return
        capture.waiters.discard(task_id)
        if capture.waiters:
            return
        del self._running[key]
        self._moves += 1
        if not capture.future.cancel():  # capturing already (or about to)
            capture.stop()

    def forget(self, fingerprints: list[str]) -> None:
        """Let go of estimates the store no longer keeps (no task left uses them): the next task of the same
        job is estimated again, as after a restart, rather than placed by an estimate it cannot show."""
        for key in fingerprints:
            self._done.pop(key, None)

    def close(self) -> None:
        """Stop estimating: queued estimates are dropped, captures under way are killed."""
        self._readers.close()
        for line in self._turns.values():
            for waiting in line:
                waiting.future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for capture in list(self._running.values()):
            capture.stop()

    # ----------------------------------------------------------------- in the worker threads

    def _capture(self, capture: _Capture) -> None:
        try:
            capture.future.set_result(self._estimate(capture, capture.job, capture.method, capture.python))
        except BaseException as e:  # settled on the scheduling loop (`_settle`), which logs a bug's traceback
            capture.future.set_exception(e)

    def _estimate(self, capture: _Capture, job: JobSpec, method: str, python: str | None) -> Estimate:
        if job.shell:
            raise EstimateError("a shell command line cannot be captured; submit `python script.py ...` instead")
        runner: Runner = self._runner or estimate_script
        if python is None and is_python(job.argv[0]):
            raise EstimateError(f"{job.argv[0]} is not on the task's PATH: the task could not start either")
        owner = {"user": job.uid, "group": job.gid, "extra_groups": groups_of(job)} if self._run_as_owner else {}
        try:
            return runner(
                list(job.argv), method, self.device, timeout_s=self._timeout_s, gpus=job.gpus, python=python,
                cwd=job.workdir, env=dict(job.env), on_start=capture.started, **owner,
            )  # fmt: skip
        finally:
            capture.group = None  # ended: its number may be another process's from now on

    # ----------------------------------------------------------------- back in the scheduling loop

    def _settle(self, key: str, job: JobSpec, future: Future[Estimate], tasks: set[TaskId]) -> MemoryNeed:
        """The need an ended estimate gives, logged with the tasks waiting for it (most are named "python")."""
        who = f"task {', '.join(map(str, sorted(tasks)))} ({job.name})"
        try:
            result = future.result()
            need = _need(result, multi_gpu=job.gpus > 1)
        except EstimateError as e:
            return self._failed(who, job, str(e))
        except Exception as e:  # an estimator's bug must not stop the daemon: the task runs recovery only
            log.exception("estimating %s crashed", who)
            return self._failed(who, job, f"{type(e).__name__}: {e}")
        self._store.add_estimate(key, result, time.time())
        log.info("estimated %s with %s in %.1f s: %d MiB", who, result.method, result.seconds, _mib(result))
        for note in result.notes:
            log.warning("estimate of %s: %s", who, note)
        return need

    def _device_identity(self) -> str:
        """The device with its constants, for the cache key: after `carma estimate calibrate` a job is
        estimated again with the measured context, not given one made with the built-in value."""
        from carma.estimate.devices import get_device

        try:
            known = get_device(self.device)
        except EstimateError:  # the estimate will fail, and say why; a failure is not cached
            return self.device
        return f"{known.name} {known.context_bytes} {known.total_bytes}"

    @staticmethod
    def _reused(task_id: TaskId, job: JobSpec, need: MemoryNeed) -> None:
        log.info(
            "task %d (%s) takes the %s estimate made for the same job before: %s MiB (`carma show` has it)",
            task_id, job.name, job.estimator, need.mib,
        )  # fmt: skip

    def _failed(self, who: str, job: JobSpec, reason: str) -> MemoryNeed:
        log.warning("could not estimate %s with %s (%s); it runs recovery only", who, job.estimator, reason)
        return MemoryNeed(NeedKind.UNKNOWN, source=f"{job.estimator} failed: {reason}")

    def _history(self, job: JobSpec) -> MemoryNeed:
        """The largest peak observed in an earlier successful run of the same command."""
        from carma.estimate.registry import history_estimate

        runs = self.history.runs(job)
        peaks, ran = runs.peaks, len(runs.times)
        if not peaks:
            if not ran:
                why = "no earlier successful run of this command"
            else:
                which = "the earlier successful run" if ran == 1 else f"any of the {ran} earlier successful runs"
                why = f"no peak was observed in {which} of this command"
            return MemoryNeed(NeedKind.UNKNOWN, source=f"history: {why}")
        try:
            return _need(history_estimate(max(peaks) * MIB, self.device))
        except EstimateError as e:  # the device's constants cannot be read (a devices.toml edited by hand)
            return MemoryNeed(NeedKind.UNKNOWN, source=f"history: {e}")


class _Capture:
    """One estimate under way: the tasks that asked for it and, once it has started, its child's process
    group and start time (its worker thread sets them, the scheduling loop may stop it: either may come
    first)."""

    def __init__(self, task_id: TaskId, job: JobSpec, method: str, python: str | None) -> None:
        self.waiters = {task_id}
        self.job, self.method, self.python = job, method, python
        self.future: Future[Estimate] = Future()  # running once a worker has it (`Estimates._start_captures`)
        self.group: int | None = None
        self.started_s: float | None = None  # monotonic
        self.stopped = False

    def started(self, group: int) -> None:
        self.group, self.started_s = group, time.monotonic()
        if self.stopped:  # stopped between the worker taking it up and the child starting
            kill_group(group)

    def stop(self) -> None:
        self.stopped = True
        if self.group is not None:
            kill_group(self.group)


def _take_turn(turns: dict[int, deque[_Capture]], served: dict[int, int]) -> _Capture | None:
    """Take the capture that starts next out of `turns`, and count its user `served`: of the users waiting,
    the one served longest ago (or never), the first to ask among equals; captures cancelled meanwhile are
    passed over. None when none waits."""
    while turns:
        uid = min(turns, key=lambda user: served.get(user, 0))
        capture = turns[uid].popleft()
        if not turns[uid]:
            del turns[uid]
        if not capture.future.cancelled():
            served[uid] = max(served.values(), default=0) + 1
            return capture
    return None


def _need(estimate: Estimate, multi_gpu: bool = False) -> MemoryNeed:
    """The need an estimate gives; a capture's of a job on several GPUs is partial (it leaves out their
    communication: NCCL's buffers, DataParallel's reduction), so the task holds its margin with it."""
    return estimated(estimate.method, _mib(estimate), partial=multi_gpu)


def _mib(estimate: Estimate) -> int:
    return math.ceil(estimate.peak_bytes / MIB)
