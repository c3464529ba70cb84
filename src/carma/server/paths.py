"""Where the daemon keeps its state: `$CARMA_HOME`, else /var/lib/carma for root and the XDG state dir
for a user. The client finds the daemon's socket the same way, and, for a user without a daemon of their own,
the system's (root's, the systemd service's) in /var/lib/carma."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

SYSTEM_HOME = Path("/var/lib/carma")


def server_socket() -> Path:
    """The socket a client talks to: its state dir's, else, without `$CARMA_HOME` and for a user who never ran
    a server (no state dir of their own), the system daemon's (users of a shared server need not set
    anything). A user's own server that stopped is not traded for the system's."""
    own = Paths(carma_home())
    system = Paths(SYSTEM_HOME).socket
    if os.environ.get("CARMA_HOME") or own.home.exists() or not system.exists():
        return own.socket
    return system


def carma_home() -> Path:
    if os.environ.get("CARMA_HOME"):
        return Path(os.environ["CARMA_HOME"]).expanduser()
    if os.geteuid() == 0:
        return SYSTEM_HOME
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
        """The state dir, readable by its owner only (task logs and tokens live below it), and the server's
        (`check_owner`)."""
        if self.home.exists() and not self.home.is_dir():  # else "File exists", of the state dir it is to be
            raise NotADirectoryError(f"{self.home}: not a directory, so it cannot be the state directory")
        self.home.mkdir(parents=True, exist_ok=True)
        self.check_owner()
        os.chmod(self.home, 0o711)  # others may reach the socket and their own task dirs, not list them

    def check_owner(self) -> None:
        """Refuse a state dir another user owns, or could replace (a folder above it that anyone may write,
        not sticky, or of another user): they could write its tokens and database, and have tasks run as any
        user, root included."""
        me = os.geteuid()
        owner = os.stat(self.home).st_uid
        if owner != me:
            raise PermissionError(
                f"{self.home} belongs to uid {owner}, not to the server's user (uid {me}): its owner could write "
                "its tokens and database and have tasks run as any user; give the server a state directory of "
                "its own user (CARMA_HOME)"
            )
        for folder in dict.fromkeys((self.home.absolute().parent, self.home.resolve().parent)):
            info = os.stat(folder)
            if info.st_uid not in (0, me) or (info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX):
                raise PermissionError(
                    f"{folder}, the folder of the state directory, may be changed by another user (who could put "
                    "a state directory of theirs in its place); choose one in a folder of the server's user or root"
                )
