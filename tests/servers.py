"""A real `carma server` on fake GPUs for end-to-end tests, driven through the real CLI and client."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from carma.server.client import Client, ClientError
from support import CARMA, cli_env, run_carma, wait_until

FAKEJOB = [sys.executable, "-m", "carma.fakejob"]


class Server:
    """A carma daemon in its own short state dir (unix socket paths must stay short)."""

    def __init__(
        self, home: Path, *options: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()
    ) -> None:
        self.home = home
        self.options = options
        self.launcher = launcher  # a command that runs `carma server` (`nohup`)
        self.env = cli_env(**{"CARMA_HOME": str(home), **(env or {})})
        self.client = Client(home / "carma.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        log = open(self.home / "test-server.log", "ab")  # noqa: SIM115 (kept open for the daemon's lifetime)
        command = [*self.launcher, CARMA, "server", *self.options]
        self.proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=log)
        wait_until(self._answers, 20, "the server to answer")
        return self

    def _answers(self) -> bool:
        try:
            self.client.status()
            return True
        except ClientError:
            return False

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # a machine under load: leave no server behind either way
                self.proc.kill()
                self.proc.wait()

    def cli(self, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_carma(*args, env={**self.env, **(env or {})})

    def json(self, *args: object) -> object:
        result = self.cli(*args, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def task(self, task_id: int) -> dict:
        return self.client.task(task_id)

    def wait_state(self, task_id: int, *states: str, timeout: float = 60.0) -> dict:
        return wait_until(
            lambda: (t := self.task(task_id))["state"] in states and t, timeout, f"task {task_id} {states}"
        )

    def submit(self, *command: str, **options: object) -> int:
        flags = [x for k, v in options.items() for x in (f"--{k}", str(v))]
        result = self.cli("submit", "--json", *flags, "--", *command)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["id"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fakejob(seconds: float, mem: str = "2GiB", *extra: str) -> list[str]:
    return [*FAKEJOB, "--mem", mem, "--seconds", f"{seconds:g}", "--ttfk", "1", "--warmup", "1", *extra]


def server_starter() -> Iterator[Callable[..., Server]]:
    """Start servers in short state dirs (unix socket paths must stay short); afterwards stop them and
    kill every task process they left."""
    servers: list[Server] = []
    homes: list[Path] = []

    def start(
        *options: str, home: Path | None = None, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()
    ) -> Server:
        if home is None:
            home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
            homes.append(home)
        server = Server(home, *options, env=env, launcher=launcher).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    for home in homes:
        for pid_dir in (home / "tasks").glob("*/*"):
            with contextlib.suppress(OSError, ValueError, KeyError):  # leave no task process behind
                info = json.loads((pid_dir / "shim.json").read_text())
                os.killpg(info["pid"], signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)
