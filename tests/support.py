"""A hand-driven world for scheduler tests: set GPU loads, advance time, report first kernels and exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from carma.core import GpuSample, ProcessExit, Scheduler, SchedulerConfig, Target, TargetKind, TaskSpec
from carma.core.memory import Estimator
from carma.core.types import Launch, Task

TOTAL_MIB = 40960
CARMA = str(Path(sys.executable).parent / "carma")  # the installed console script, run as a user runs it
# Variables that would make rich's output depend on the terminal the tests run from.
_TERMINAL_VARIABLES = {"COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CLICOLOR_FORCE"}


T = TypeVar("T")


NOBODY = 65534  # the uid root-only tests run tasks, captures and reads as


def nobody_can_run_carma() -> bool:
    """Whether user nobody can run this interpreter with carma, as a root daemon's shim and readers do (its
    interpreter and sources must be readable by others: not so for a virtual environment under /root)."""
    probe = [sys.executable, "-I", "-c", "import carma.server.shim"]
    try:
        return subprocess.run(probe, user=NOBODY, group=NOBODY, cwd="/", capture_output=True).returncode == 0
    except OSError:
        return False


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """The predicate's first truthy value, polled for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def step_until(daemon: Any, predicate: Callable[[], object], timeout: float = 20.0) -> None:
    """Step an in-process daemon until `predicate` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon.step()
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def cli_env(**extra: str) -> dict[str, str]:
    """This environment as a user's shell with carma's environment activated: its `python` first on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in _TERMINAL_VARIABLES and k != "CARMA_URL"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    return {**env, **extra}


def run_carma(
    *args: object, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    assert Path(CARMA).exists(), f"the `carma` console script is not installed beside {sys.executable}"
    return subprocess.run(
        [CARMA, *map(str, args)],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        cwd=cwd,
        check=False,
        timeout=300,
    )


OOM_LOG = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


@dataclass
class Load:
    used_mib: int = 0
    smact: float | None = 0.0
    smocc: float | None = 0.0
    drama: float | None = 0.0


class Bench:
    def __init__(
        self,
        gpus: int = 3,
        total_mib: int = TOTAL_MIB,
        estimator: Estimator | None = None,
        totals: tuple[int, ...] = (),  # GPUs of different sizes (MiB), instead of `gpus` of `total_mib`
        mig: tuple[int, ...] = (),  # the indices that are MIG instances (exclusive targets)
        **config: object,
    ) -> None:
        self.totals = totals or (total_mib,) * gpus
        gpus = len(self.totals)
        # a target's id is its index written out: the tests name GPUs by either
        targets = [
            Target(str(i), f"GPU-{total // 1024}GB", total, TargetKind.MIG, shareable=False)
            if i in mig
            else Target(str(i), f"GPU-{total // 1024}GB", total)
            for i, total in enumerate(self.totals)
        ]
        self.sched = Scheduler(targets, SchedulerConfig(**config), estimator)
        self.t = 0.0
        self.loads = {str(i): Load() for i in range(gpus)}
        self.seen: dict[str, set[int]] = {str(i): set() for i in range(gpus)}
        self.sample()

    def set(self, gpu: int | str, **values: float) -> None:
        for key, value in values.items():
            setattr(self.loads[str(gpu)], key, value)

    def sample(self) -> None:
        for gpu, load in self.loads.items():
            self.sched.record_sample(
                GpuSample(gpu, self.t, load.used_mib, self.totals[int(gpu)], load.smact, load.smocc, load.drama)
            )

    def advance(self, seconds: int) -> None:
        """Let time pass with one sample per GPU per second."""
        for _ in range(seconds):
            self.t += 1
            self.sample()

    def submit(self, name: str = "task", gpus: int = 1, mem_mib: int | None = None) -> Task:
        return self.sched.submit(TaskSpec(name, gpus, mem_mib), self.t)

    def decide(self) -> list[Launch]:
        return self.sched.decide(self.t)

    def placed(self) -> dict[int, tuple[int, ...]]:
        """Decide now; map of task id to its GPUs' indices."""
        return {launch.task_id: tuple(map(int, launch.gpus)) for launch in self.decide()}

    def first_kernel(self, task_id: int) -> None:
        for gpu in self.sched.task(task_id).current.gpus:
            self.seen[gpu].add(task_id)
            self.sched.record_gpu_processes(gpu, self.seen[gpu], 0, self.t)

    def exit(self, task_id: int, code: int = 0, log: str = "") -> object:
        for seen in self.seen.values():
            seen.discard(task_id)
        return self.sched.record_exit(task_id, ProcessExit(code, log), self.t)

    def oom(self, task_id: int) -> object:
        return self.exit(task_id, 1, OOM_LOG)
