"""What a captured script failed to download, so that its crash names it.

A capture runs where the estimate is asked (a laptop, the daemon's host), often without the network or
the dataset the job reads on its training machine. A script that downloads weights or data there crashed
with its library's last word, which may not say what it wanted (`URLError: <urlopen error [Errno -3]
Temporary failure in name resolution>`). The capture notes each URL `urllib` failed to open and each host
a connection failed to resolve or reach (Hugging Face's hub, torchvision's weights, a dataset's mirror),
and a crash whose exception comes from such a failure names the last one.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HINT = "a capture loads the job's data and weights from this machine: put them here, or in its library's cache"


@contextmanager
def watching_downloads() -> Iterator[list[str]]:
    """Yield the list of what failed to be fetched (URLs, else `host:port`), in order, while it runs."""
    failed: list[str] = []
    getaddrinfo, create_connection = socket.getaddrinfo, socket.create_connection
    open_url = urllib.request.OpenerDirector.open

    def resolving(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return getaddrinfo(host, port, *args, **kwargs)
        except OSError:
            failed.append(f"{host}:{port}" if port else str(host))
            raise

    def connecting(address: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return create_connection(address, *args, **kwargs)
        except OSError:
            failed.append(f"{address[0]}:{address[1]}")
            raise

    def opening(self: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return open_url(self, url, *args, **kwargs)
        except OSError:
            failed.append(url if isinstance(url, str) else url.full_url)
            raise

    socket.getaddrinfo, socket.create_connection = resolving, connecting
    urllib.request.OpenerDirector.open = opening  # type: ignore[method-assign]
    try:
        yield failed
    finally:
        socket.getaddrinfo, socket.create_connection = getaddrinfo, create_connection
        urllib.request.OpenerDirector.open = open_url  # type: ignore[method-assign]


def explained(crash: str, exc: BaseException, failed: list[str]) -> str:
    """`crash`, naming what the script failed to download when `exc` (or an exception it was raised from or
    while handling) is a failed connection's `OSError`; else `crash` as it is."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError) and failed:
            return f"{crash} (it could not download {failed[-1]}: {HINT})"
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return crash
