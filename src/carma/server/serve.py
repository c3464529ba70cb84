"""Running the daemon: the API on a unix socket (and optionally TCP) beside the scheduling loop.

Stopping the daemon (SIGTERM, Ctrl-C) stops scheduling and the API, not the tasks: they run in their
own sessions, and the next daemon re-adopts them.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
from pathlib import Path

import uvicorn

from carma.server.api import create_app
from carma.server.auth import PeerCredProtocol, Tokens
from carma.server.daemon import Daemon


class AlreadyRunning(RuntimeError):
    pass


def bind_unix(path: Path) -> socket.socket:
    """Bind the daemon's socket: 0600 for a user's daemon; for root's, group `carma` if it exists, else 0666
    (every request is then identified by its peer credentials)."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a stale socket of a daemon that died
        else:
            raise AlreadyRunning(f"a carma server is already running at {path}")
        finally:
            probe.close()
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
    sock.listen(128)
    return sock


def bind_tcp(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cannot read TCP address {address!r}; write HOST:PORT, e.g. 127.0.0.1:8765")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    sock.listen(128)
    return sock


async def serve(daemon: Daemon, sockets: list[socket.socket], tokens: Tokens) -> None:
    config = uvicorn.Config(
        create_app(daemon, tokens), http=PeerCredProtocol, lifespan="off", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    stop = asyncio.Event()
    scheduling = asyncio.create_task(daemon.run(stop))
    try:
        await server.serve(sockets=sockets)
    finally:
        stop.set()
        await scheduling
        daemon.close()
        logging.getLogger("carma").info("carma server stopped; running tasks continue and are re-adopted on restart")
