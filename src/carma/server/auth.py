"""Who is calling: the unix socket's peer credentials, or a bearer token on the TCP listener.

On the unix socket the kernel tells the daemon the caller's uid (SO_PEERCRED), so nothing can be forged.
On TCP a request carries `Authorization: Bearer <token>`; the tokens file (mode 0600, one
`<token> <user> <uid> [admin]` per line) maps it to a user. Root and the daemon's own user are admins:
they may cancel and read the logs of every task; others only of their own.

Who is calling is settled from the request's head alone, before anything reads its body (`AuthFirst`), and
each listener takes a bounded number of connections, none of them idle for long (`PeerCredProtocol`): a
peer without a token, or a local user, cannot fill the daemon's memory or its descriptors.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import pwd
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from carma.textfiles import read_text

log = logging.getLogger("carma.auth")
MIN_TOKEN_CHARS = 16  # the tokens carma makes have 43 (32 random bytes)
MAX_UID = 2**32 - 2  # uid_t is 32 bits, and (uid_t)-1 means "no change" to chown and setreuid
UNAUTHORIZED = "missing or unknown bearer token"


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


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections a listener holds at once, and for how long one may wait for its next request:
    each holds a descriptor, and a daemon out of descriptors can open no file (1,500 idle connections
    stopped it under the usual limit of 1,024)."""

    per_listener: int = 256
    per_user: int = 32  # on the unix socket, per peer uid: one user cannot take all of it from the others
    per_address: int = 32  # on TCP, per client address: the same, for whoever reaches the port
    idle_s: float = 10.0  # to send a whole request head, from connecting or from the last answer

    @property
    def body_s(self) -> float:
        """How long a request's body (4 MiB at most) may keep coming: six times `idle_s`, a minute by default."""
        return 6 * self.idle_s


def _refusal(detail: str) -> bytes:
    """A whole HTTP answer, 503 with `{"detail": ...}`, written before the request is read (it need not be)."""
    body = json.dumps({"detail": detail}).encode()
    head = f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return f"{head}\r\nconnection: close\r\n\r\n".encode() + body


def client_address(host: str) -> str:
    """What a TCP client's connections are counted by: its IPv4 address (also when it comes IPv4-mapped), or
    its IPv6 address's /64, the least a site hands one machine (each of its addresses is the client's own)."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])  # less an IPv6 scope
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class PeerCredProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, adding the unix-socket peer's (pid, uid, gid) to each request scope,
    refusing a connection over its listener's cap (or its user's, on the unix socket: root and the daemon's
    user, who may need to get in during a flood, have none; or its address's, on TCP) and closing one that
    sends no whole request head within `idle_s` (uvicorn closes a keep-alive connection after a silence only,
    which a byte now and then defeats, and one that never sent a request never)."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.listener = ""
        self.peer_uid: int | None = None
        self.peer_address: str | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._body: tuple[object, float] | None = None  # the request whose body is awaited, and since when

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        peer = None
        self.listener = "tcp"
        if sock is not None and sock.family == socket.AF_UNIX:
            size = struct.calcsize("3i")
            peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))
            self.listener, self.peer_uid = "unix", peer[1]
        elif isinstance(address := transport.get_extra_info("peername"), tuple) and address:
            self.peer_address = client_address(str(address[0]))
        if over := self._over_cap():
            transport.write(_refusal(over))
            transport.close()  # after the answer is written; nothing more is read
            return
        self._arm_idle()
        app = self.app

        async def with_peer(scope, receive, send):  # type: ignore[no-untyped-def]
            scope["carma.peer"] = peer  # None on TCP
            await app(scope, receive, send)

        self.app = with_peer

    def _over_cap(self) -> str | None:
        """Why this new connection is refused, if it is (the count includes it)."""
        if self.peer_uid in (0, os.geteuid()):
            return None
        mine = [c for c in self.connections if getattr(c, "listener", None) == self.listener]
        if len(mine) > self.limits.per_listener:
            return f"the carma server has {self.limits.per_listener} connections open on this listener: retry later"
        if self.peer_uid is not None and sum(c.peer_uid == self.peer_uid for c in mine) > self.limits.per_user:
            return f"you have {self.limits.per_user} connections open to the carma server: close some, then retry"
        address = self.peer_address
        if address is not None and sum(c.peer_address == address for c in mine) > self.limits.per_address:
            return (
                f"your address ({address}) has {self.limits.per_address} connections open to the carma server: "
                "close some, then retry"
            )
        return None

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.limits.idle_s, self._idle_over)

    def _idle_over(self) -> None:
        """Close the connection unless a request is being answered (the timer restarts when it is), or unless
        a request's body is still coming within `body_s` of the first look (a byte now and then held the
        connection, and a body of up to 4 MiB, for ever)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.timeout_keep_alive_handler()
        elif cycle.more_body:
            now = self.loop.time()
            if self._body is None or self._body[0] is not cycle:
                self._body = (cycle, now)
            if now - self._body[1] >= self.limits.body_s:
                self.transport.close()  # the handler reading the body sees the client gone
            else:
                self._arm_idle()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_idle()  # before uvicorn starts a pipelined request: that one's answer re-arms it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
        super().connection_lost(exc)


class AuthFirst:
    """ASGI middleware: who is calling, settled from the request's head before anything reads its body (the
    body of a request without a token was read, and parsed, first: 20 such POSTs of 15 MiB took the daemon
    from 59 to 915 MiB). A request on the unix socket is its peer's; one on TCP needs a known bearer token,
    except for `public` paths, and is answered 401 without its body being read, and the connection closed.
    The caller goes into the scope as `carma.caller` (None on a public path without a token)."""

    def __init__(self, app: ASGIApp, tokens: Tokens, public: Callable[[str], bool]) -> None:
        self.app, self.tokens, self.public = app, tokens, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            caller = self.caller(scope)
            if caller is None and not self.public(scope["path"]):
                headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
                await JSONResponse({"detail": UNAUTHORIZED}, status_code=401, headers=headers)(scope, receive, send)
                return
            scope["carma.caller"] = caller
        await self.app(scope, receive, send)

    def caller(self, scope: Scope) -> Caller | None:
        peer = scope.get("carma.peer")
        if peer is not None:
            _, uid, gid = peer
            return caller_from_peer(uid, gid)
        header = dict(scope.get("headers", ())).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return self.tokens.caller(token.strip()) if scheme.lower() == "bearer" else None


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
            info = path.stat()
            if info.st_uid != os.geteuid():  # as sshd's StrictModes: its owner may make tokens for root
                raise ValueError(
                    f"{path}: it belongs to uid {info.st_uid}, not to the server's user (uid {os.geteuid()}), and "
                    f"whoever owns it may act as any user; chown {os.geteuid()} {path}"
                )
            mode = info.st_mode & 0o777
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
                if (account := user_name(uid)) not in (str(uid), fields[1]):  # the uid has an account, named else
                    log.warning(
                        "%s, line %d: uid %d is %s on this machine: tasks submitted with this token run as %s, "
                        "shown as %s", path, lineno, uid, account, account, fields[1],
                    )  # fmt: skip

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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a+b") as f:
            if f.seek(0, os.SEEK_END):  # a last line without its end (a comment) would take the token
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(f"{token} {user} {uid}{' admin' if admin else ''}\n".encode())
        os.chmod(self.path, 0o600)
        self._by_token[token] = Caller(uid, user, admin, gid=primary_gid(uid))
        return token

    def __bool__(self) -> bool:
        return bool(self._by_token)
