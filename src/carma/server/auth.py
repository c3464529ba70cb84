"""Who is calling: the unix socket's peer credentials, or a bearer token on the TCP listener.

On the unix socket the kernel tells the daemon the caller's uid (SO_PEERCRED), so nothing can be forged.
On TCP a request carries `Authorization: Bearer <token>`; the tokens file (mode 0600, one
`<token> <user> <uid> [admin]` per line) maps it to a user. Root and the daemon's own user are admins:
they may cancel and read the logs of every task; others only of their own.
"""

from __future__ import annotations

import os
import pwd
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from uvicorn.protocols.http.h11_impl import H11Protocol

from carma.textfiles import read_text

MIN_TOKEN_CHARS = 16  # the tokens carma makes have 43 (32 random bytes)
MAX_UID = 2**32 - 2  # uid_t is 32 bits, and (uid_t)-1 means "no change" to chown and setreuid


@dataclass(frozen=True)
class Caller:
    uid: int
    user: str
    admin: bool
    gid: int = -1  # -1: a token's uid with no account here


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def primary_gid(uid: int) -> int:
    """The group of the uid's account, which a root daemon runs its tasks with; -1 for a uid without one."""
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return -1


def caller_from_peer(uid: int, gid: int) -> Caller:
    return Caller(uid, user_name(uid), admin=uid in (0, os.geteuid()), gid=gid)


class PeerCredProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, adding the unix-socket peer's (pid, uid, gid) to each request scope."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        peer = None
        if sock is not None and sock.family == socket.AF_UNIX:
            size = struct.calcsize("3i")
            peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))
        app = self.app

        async def with_peer(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["carma.peer"] = peer  # None on TCP
            await app(scope, receive, send)

        self.app = with_peer


def _uncommented(fields: list[str]) -> list[str]:
    """A line's fields before a `#` comment: a whole line's, indented or not, or one after the fields."""
    return next((fields[:i] for i, field in enumerate(fields) if field.startswith("#")), fields)


class Tokens:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_token: dict[str, Caller] = {}
        if path.exists():
            if not path.is_file():  # else "other users may read it" of a directory's mode
                raise ValueError(f"{path}: not a file; the tokens file holds one <token> <user> <uid> [admin] per line")
            mode = path.stat().st_mode & 0o777
            if mode & 0o077:  # as ~/.pgpass: whoever reads it may act as each of its users, admins included
                raise ValueError(
                    f"{path}: other users may read or change it (mode {mode:04o}), and act as any user it names; "
                    f"chmod 600 {path}"
                )
            first_line: dict[str, int] = {}
            for lineno, line in enumerate(read_text(path).splitlines(), start=1):
                fields = _uncommented(line.split())
                if not fields:
                    continue
                if len(fields) < 3 or not fields[2].isdigit() or not set(fields[3:]) <= {"admin"}:
                    raise ValueError(f"{path}, line {lineno}: write <token> <user> <uid> [admin]")
                if not (fields[0].isascii() and fields[0].isprintable()):  # a client could not send it in a header
                    raise ValueError(f"{path}, line {lineno}: a token is printable ASCII")
                if len(fields[0]) < MIN_TOKEN_CHARS:  # a TCP client holding it runs commands as that uid
                    raise ValueError(
                        f"{path}, line {lineno}: a token of {len(fields[0])} characters is easy to guess; write one "
                        f"of at least {MIN_TOKEN_CHARS} (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                    )
                if fields[0] in first_line:  # one token for two users: which one a request is would be a guess
                    raise ValueError(f"{path}, line {lineno}: this token is already on line {first_line[fields[0]]}")
                first_line[fields[0]] = lineno
                uid = int(fields[2])
                if uid > MAX_UID:  # else taken, and refused only when its holder submitted
                    raise ValueError(f"{path}, line {lineno}: a uid is at most {MAX_UID}, not {uid}")
                self._by_token[fields[0]] = Caller(uid, fields[1], admin="admin" in fields[3:], gid=primary_gid(uid))

    def caller(self, token: str) -> Caller | None:
        given = token.encode("utf-8", "surrogateescape")  # compare_digest refuses non-ASCII str: any header byte
        for known, caller in self._by_token.items():
            if secrets.compare_digest(known.encode(), given):
                return caller
        return None

    def of_uid(self, uid: int) -> str | None:
        """A token of this uid (the first in the file), for handing a user their dashboard link."""
        return next((token for token, caller in self._by_token.items() if caller.uid == uid), None)

    def create(self, user: str, uid: int, admin: bool = False) -> str:
        """Add a token for `user` and return it (the file stays readable by the daemon's user only)."""
        token = secrets.token_urlsafe(32)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{token} {user} {uid}{' admin' if admin else ''}\n")
        os.chmod(self.path, 0o600)
        self._by_token[token] = Caller(uid, user, admin, gid=primary_gid(uid))
        return token

    def __bool__(self) -> bool:
        return bool(self._by_token)
