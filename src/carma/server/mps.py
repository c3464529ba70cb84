"""NVIDIA MPS: an MPS control daemon of carma's own, and what its clients need in their environment.

The control daemon's pipe and log directories live under carma's state directory, so it does not
collide with a system-wide MPS. Single-user caveat: an MPS server serves one Linux user at a time; a
client of another user waits until the current user's server has exited. A root daemon running tasks as
several users therefore only collocates one user's tasks through MPS at a time (see docs/server.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """MPS cannot be used here or did not do what was asked; the message says why, in one line."""


@dataclass(frozen=True)
class MpsStatus:
    running: bool
    servers: tuple[int, ...]  # pids of the MPS servers (one per user with clients)


class MpsControl:
    def __init__(self, state_dir: Path, binary: str = CONTROL, timeout_s: float = 30.0) -> None:
        self.pipe_dir = state_dir / "mps" / "pipe"
        self.log_dir = state_dir / "mps" / "log"
        self._binary = binary
        self._timeout_s = timeout_s  # for an answer of the control tool, and for a start or a stop to show

    def client_env(self) -> dict[str, str]:
        """What every task must see to become a client of this control daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _control(self) -> str:
        path = shutil.which(self._binary)
        if path is None:
            raise MpsError(f"{self._binary} not found: MPS needs the NVIDIA driver's MPS binaries on the PATH")
        return path

    def _ask(self, line: str) -> subprocess.CompletedProcess[str]:
        """Send one command line to the control daemon (the tool exits non-zero if none runs)."""
        env = {**os.environ, **self.client_env()}
        try:
            return subprocess.run(
                [self._control()], input=line, capture_output=True, text=True, env=env, timeout=self._timeout_s
            )
        except subprocess.TimeoutExpired:
            raise MpsError(
                f"the MPS control daemon did not answer {line.strip()!r} within {self._timeout_s:g} s"
            ) from None

    def status(self) -> MpsStatus:
        """Running when the control daemon answers on carma's pipe directory (the control tool fails if not)."""
        answer = self._ask("get_server_list\n")
        if answer.returncode != 0:
            return MpsStatus(False, ())
        return MpsStatus(True, tuple(int(w) for w in answer.stdout.split() if w.isdigit()))

    def start(self) -> MpsStatus:
        if (status := self.status()).running:
            return status
        for directory in (self.pipe_dir, self.log_dir):
            directory.mkdir(parents=True, exist_ok=True)
        # stderr to a file, not a pipe: a daemonizing child that kept the pipe would block the read forever
        with tempfile.TemporaryFile("w+") as errors:
            try:
                code = subprocess.call(
                    [self._control(), "-d"],
                    env={**os.environ, **self.client_env()},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errors,
                    timeout=self._timeout_s,
                )
            except subprocess.TimeoutExpired:
                raise MpsError(f"{self._binary} -d did not return within {self._timeout_s:g} s") from None
            if code != 0:
                errors.seek(0)
                raise MpsError(f"could not start the MPS control daemon: {errors.read().strip()}")
        if (status := self._wait_until(True)) is None:
            raise MpsError(f"the MPS control daemon did not come up (see {self.log_dir / 'control.log'})")
        return status

    def stop(self) -> MpsStatus:
        if not self.status().running:
            return MpsStatus(False, ())
        self._ask("quit\n")
        if (status := self._wait_until(False)) is not None:
            return status
        servers = ", ".join(map(str, self.status().servers)) or "none listed"  # `quit` waits for the clients
        raise MpsError(
            f"the MPS control daemon takes no new clients and quits once its clients end (MPS servers: "
            f"{servers}); it was still running after {self._timeout_s:g} s"
        )

    def _wait_until(self, running: bool) -> MpsStatus | None:
        """The status once the control daemon runs (or not) as asked; None if it did not within the timeout."""
        deadline = time.monotonic() + self._timeout_s
        while (status := self.status()).running is not running:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        return status


def client_limits(need_mib: int | None, margin_mib: int, gpus: int, threads: int | None) -> dict[str, str]:
    """Per-task MPS limits: a task with a known need may pin only need + margin on each of its GPUs, so a
    mis-estimated task runs out of memory itself instead of crashing its neighbours; `threads` caps its
    share of the SMs. Device ordinals are the client's own (0..n-1 within CUDA_VISIBLE_DEVICES)."""
    env = {}
    if need_mib is not None:
        limit = need_mib + margin_mib
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={limit}M" for i in range(gpus))
    if threads is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(threads)
    return env
