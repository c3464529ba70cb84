"""The client against web servers that are not the daemon: a reverse proxy's path prefix, other sites' errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from carma.server.client import Client, ClientError


class _Proxy(BaseHTTPRequestHandler):
    """Serves an empty task list under /carma only, as a proxy publishing the API on a sub-path would."""

    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.paths.append(self.path)
        if self.path.startswith("/carma/v1/"):
            self._send(200, "application/json", b"[]")
        elif self.path.startswith("/prefix/"):  # carma itself (FastAPI) asked a path no route takes
            self._send(404, "application/json", b'{"detail":"Not Found"}')
        elif self.path.startswith("/broken/"):
            self._send(502, "text/html", b"<html>\n<h1>502 Bad\nGateway</h1></html>")
        else:
            self._send(404, "text/html", b"<html>Not here</html>")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_path_in_carma_url_prefixes_every_request(site: str) -> None:
    _Proxy.paths.clear()
    assert Client(url=f"{site}/carma/").tasks() == []
    assert _Proxy.paths == ["/carma/v1/tasks?all=false"]  # the path was dropped: the proxy's root was asked


def test_a_url_that_is_not_a_carma_server_says_so_in_one_line(site: str) -> None:
    with pytest.raises(ClientError) as refused:
        Client(url=site).tasks()
    assert str(refused.value) == f"HTTP 404 from {site}: no carma API there (check CARMA_URL and its path)"
    with pytest.raises(ClientError) as refused:  # was "Not Found" alone
        Client(url=f"{site}/prefix").tasks()
    assert str(refused.value) == f"HTTP 404 from {site}/prefix: no carma API there (check CARMA_URL and its path)"
    with pytest.raises(ClientError) as refused:
        Client(url=f"{site}/broken").tasks()
    assert str(refused.value) == "HTTP 502: <html> <h1>502 Bad Gateway</h1></html>"


def test_https_is_spoken_to_an_https_url(site: str) -> None:
    """Refused before: a daemon behind a TLS proxy could not be reached by the CLI."""
    with pytest.raises(ClientError, match=r"^could not talk to the carma server at https://.*SSL"):
        Client(url=site.replace("http://", "https://")).tasks()  # the plain-HTTP site fails the TLS handshake
