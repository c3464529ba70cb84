"""Running the daemon: the API on a unix socket (and optionally TCP) beside the scheduling loop.

Stopping the daemon (SIGTERM, Ctrl-C, or SIGHUP: the terminal of a `carma server &` closing, unless it was
started under `nohup`) stops scheduling and the API, not the tasks: they run in their own sessions, and the
next daemon re-adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import grp
import logging
import os
import resource
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import IO

import uvicorn

from carma.config import ServerConfig
from carma.server.api import create_app, too_large_as_json
from carma.server.auth import ConnectionLimits, PeerCredProtocol, Tokens
from carma.server.daemon import Daemon
from carma.server.paths import Paths

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last one a NUL
# asyncio accepts up to its `backlog` connections at each wake-up, each holding a descriptor until its cap
# refuses it (uvicorn's 2,048 took a limit of 256 at once): few at a time, while the kernel queues the
# rest (LISTEN_BACKLOG; asyncio's listen(backlog) left 16, and a burst of clients waited a second each)
ACCEPT_BURST = 16
LISTEN_BACKLOG = 1024


class AlreadyRunning(RuntimeError):
    pass


def refuse_if_running(path: Path) -> None:
    """Raise AlreadyRunning when a daemon answers on `path`; remove a stale socket of one that died. Called
    before a daemon touches its state directory too, so that a second `carma server` changes nothing."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # a stale socket of a daemon that died
        else:
            raise AlreadyRunning(f"a carma server is already running at {path}")
        finally:
            probe.close()


def hold_state(paths: Paths) -> IO[str]:
    """Lock the state directory for this daemon's lifetime (the lock goes with the process, however it ends):
    a second daemon on it is refused even when the first one's socket is gone (a /tmp cleaner, a stray rm),
    where the socket's answer alone let both launch the same queued tasks."""
    lock = open(paths.lock, "a+")  # noqa: SIM115 (held open until the process ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        gone = "" if paths.socket.exists() else f", though its socket {paths.socket} is gone"
        raise AlreadyRunning(
            f"a carma server{f' (pid {holder})' if holder else ''} is already running on {paths.home}{gone}: "
            "stop it first"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def check_socket_path(path: Path) -> None:
    """Refuse, before anything is made, a state directory too deep for its socket: Linux takes at most
    107 bytes for a unix socket's path (the bind failed after the state and the MPS daemon were set up)."""
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise ValueError(
            f"the server's socket {path} would be {size} bytes long, and a unix socket's path takes at most "
            f"{UNIX_PATH_MAX}: choose a shorter CARMA_HOME (or --home)"
        )


def bind_unix(path: Path) -> socket.socket:
    """Bind the daemon's socket: 0600 for a user's daemon; for root's, group `carma` if it exists, else 0666
    (every request is then identified by its peer credentials)."""
    refuse_if_running(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if os.geteuid() != 0:
        os.chmod(path, 0o600)
    else:
        try:
            os.chown(path, 0, grp.getgrnam("carma").gr_gid)
            os.chmod(path, 0o660)
        except KeyError:
            os.chmod(path, 0o666)
    sock.listen(LISTEN_BACKLOG)
    return sock


def bind_tcp(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or "/" in host or not port.isdigit() or int(port) > 65535:  # "/": a URL given
        raise ValueError(f"cannot read TCP address {address!r}; write HOST:PORT, e.g. 127.0.0.1:8765")
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without
    # it every keep-alive response waits 40 ms on Nagle's algorithm and the client's delayed ACK
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), int(port)))
    except OSError as e:  # the port taken, or a host that is not this machine's: say which address
        sock.close()
        raise ValueError(f"cannot listen on {address}: {e.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, ending the daemon's live streams (dashboard viewers) when asked to exit, since it
    waits for open responses before it stops; SIGHUP asks it to exit too (it killed the daemon at once,
    with no observations saved); accepting few connections at a time."""

    def __init__(self, config: uvicorn.Config, daemon: Daemon) -> None:
        super().__init__(config)
        self._daemon = daemon
        self._loop = asyncio.get_running_loop()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():
            sock.listen(LISTEN_BACKLOG)  # after asyncio's listen(ACCEPT_BURST), which leaves its accept burst

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._loop.call_soon_threadsafe(self._daemon.end_streams)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        hangup = signal.getsignal(signal.SIGHUP)
        if hangup is not signal.SIG_IGN:  # nohup's: it is there so that the daemon outlives a logout
            signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, hangup)


def _stopped(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # a stop asked for, as after Ctrl-C (and what a service manager counts as clean)


def listen(path: Path, tcp: str | None) -> tuple[list[socket.socket], str | None]:
    """The daemon's listening sockets, its unix socket at `path` and a TCP one on `tcp` (HOST:PORT), with the
    TCP address as bound (port 0: the one the system chose). Nothing is left bound when one fails."""
    sockets = [bind_unix(path)]
    if not tcp:
        return sockets, None
    try:
        sockets.append(bind_tcp(tcp))
    except BaseException:
        close_listeners(sockets, path)
        raise
    return sockets, f"{tcp.rpartition(':')[0]}:{sockets[-1].getsockname()[1]}"


def close_listeners(sockets: list[socket.socket], path: Path) -> None:
    """Close the daemon's sockets and remove its unix socket's file: a stopped daemon left it behind, and a
    start that failed after binding left it beside a half-made state."""
    for sock in sockets:
        sock.close()
    if sockets:
        path.unlink(missing_ok=True)


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft limit on open descriptors to the hard one (systemd's default soft limit is 1,024, its
    hard one 524,288); the limit before and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with contextlib.suppress(ValueError, OSError):  # a hard limit of "unlimited", over the kernel's cap
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limits(settings: ServerConfig, listeners: int, descriptors: int) -> ConnectionLimits:
    """The [server] settings' caps, lowered so that connections take at most half the descriptors: the rest
    are the daemon's (its database, the tasks' logs and processes, /proc)."""
    per_listener = max(1, min(settings.max_connections, descriptors // 2 // listeners))
    return ConnectionLimits(
        per_listener, settings.max_user_connections, settings.max_address_connections, settings.idle_timeout_s
    )


async def serve(daemon: Daemon, sockets: list[socket.socket], tokens: Tokens, settings: ServerConfig) -> None:
    before, descriptors = raise_descriptor_limit()
    limits = connection_limits(settings, len(sockets), descriptors)
    lowered = limits.per_listener < settings.max_connections
    logging.getLogger("carma").info(
        "open descriptors: at most %d%s; connections: at most %d per listener%s, %d per user on the unix socket, "
        "%d per address on TCP, each closed after %gs without a request",
        descriptors,
        f" (raised from {before})" if descriptors > before else "",
        limits.per_listener,
        " (half the descriptors; [server] max_connections is more)" if lowered else "",
        limits.per_user,
        limits.per_address,
        limits.idle_s,
    )
    config = uvicorn.Config(
        too_large_as_json(create_app(daemon, tokens, settings)),
        http=functools.partial(PeerCredProtocol, limits=limits),
        backlog=ACCEPT_BURST,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = _Server(config, daemon)
    # uvicorn raises the SIGTERM it caught again once it has stopped; its default action would end the
    # process there, before the daemon closes (leaving its estimates' captures running)
    signal.signal(signal.SIGTERM, _stopped)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _stopped)
    stop = asyncio.Event()
    scheduling = asyncio.create_task(daemon.run(stop))
    scheduling.add_done_callback(lambda task: _scheduling_ended(task, server, daemon))
    try:
        await server.serve(sockets=sockets)
    finally:
        stop.set()
        with contextlib.suppress(Exception):  # a failure was logged when it happened
            await scheduling
        daemon.close()
        logging.getLogger("carma").info("carma server stopped; running tasks continue and are re-adopted on restart")
    if scheduling.exception() is not None:
        raise SystemExit(1)


def _scheduling_ended(task: asyncio.Task[None], server: uvicorn.Server, daemon: Daemon) -> None:
    """A scheduling loop that failed stops the server, saying why at once: a daemon that answers the API
    but never places a task again looks healthy while it is not, and a service manager restarts a stopped
    one (which re-adopts the running tasks)."""
    if task.cancelled() or task.exception() is None:
        return
    logging.getLogger("carma").critical("the scheduling loop failed; the server stops", exc_info=task.exception())
    daemon.end_streams()
    server.should_exit = True  # not handle_exit: uvicorn would raise its signal again, and exit 0
