"""Where the daemon keeps its state: `$CARMA_HOME`, else /var/lib/carma for root and the XDG state dir
for a user. The client finds the daemon's socket the same way."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def carma_home() -> Path:
    if os.environ.get("CARMA_HOME"):
        return Path(os.environ["CARMA_HOME"]).expanduser()
    if os.geteuid() == 0:
        return Path("/var/lib/carma")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "carma"


@dataclass(frozen=True)
class Paths:
    home: Path

    @property
    def socket(self) -> Path:
        return self.home / "carma.sock"

    @property
    def lock(self) -> Path:
        return self.home / "carma.lock"

    @property
    def database(self) -> Path:
        return self.home / "carma.db"

    @property
    def ids(self) -> Path:
        """The next task id, kept beside the database: a database replaced never hands an id out again."""
        return self.home / "next-task-id"

    @property
    def tasks(self) -> Path:
        """The tasks' run dirs, `tasks/<id>/<attempt>/`."""
        return self.home / "tasks"

    @property
    def tokens(self) -> Path:
        return self.home / "tokens"

    @property
    def fake_gpus(self) -> Path:
        return self.home / "fake-gpus"

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def create(self) -> None:
        """The state dir, readable by its owner only (task logs and tokens live below it)."""
        if self.home.exists() and not self.home.is_dir():  # else "File exists", of the state dir it is to be
            raise NotADirectoryError(f"{self.home}: not a directory, so it cannot be the state directory")
        self.home.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o711)  # others may reach the socket and their own task dirs, not list them
