"""A tiny HTTP server in front of an object's URL (presigned S3, or file: for the local folder) that
fails on cue: a 503, a connection dropped halfway through a body, or a corrupted body."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse

_RANGE = re.compile(r"bytes=(\d+)-$")


def _read_file(url: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
    data = Path(unquote(urlparse(url).path)).read_bytes()
    match = _RANGE.match(range_header or "")
    if not match:
        return 200, {}, data
    start = int(match.group(1))
    return 206, {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}, data[start:]


def _get(url: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
    """The upstream's answer to a GET, with the client's Range passed on."""
    if url.startswith("file:"):
        return _read_file(url, range_header)
    request = urllib.request.Request(url, headers={"Range": range_header} if range_header else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            headers = {"Content-Range": response.headers["Content-Range"]} if response.status == 206 else {}
            return response.status, headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, {}, e.read()


def _put(url: str, body: bytes, content_type: str) -> int:
    """Pass a PUT on to the upstream; its status."""
    if url.startswith("file:"):
        target = Path(unquote(urlparse(url).path))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(body)
        return 200
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


class FlakyFront:
    """Fails the next requests as queued in `failures` ("503", "drop", "corrupt"), then passes them on."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.failures: list[str] = []
        self.requests: list[tuple[str, str | None]] = []  # (method, Range header)

    def url(self, upstream: str) -> str:
        """The address of `upstream` through this front."""
        return f"http://127.0.0.1:{self.port}/object?u={quote(upstream, safe='')}"

    def next_failure(self) -> str | None:
        """The failure to play for the request that just arrived, if any."""
        return self.failures.pop(0) if self.failures else None


def _handler(front: FlakyFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _upstream(self) -> str:
            return parse_qs(urlparse(self.path).query)["u"][0]

        def do_GET(self) -> None:
            front.requests.append(("GET", self.headers.get("Range")))
            failure = front.next_failure()
            if failure == "503":
                self._status_only(503)
                return
            status, headers, body = _get(self._upstream(), self.headers.get("Range"))
            if failure == "corrupt":
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if failure == "drop":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True  # the client sees the body end short of its length
                return
            self.wfile.write(body)

        def do_PUT(self) -> None:
            front.requests.append(("PUT", None))
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if front.next_failure() == "503":
                self._status_only(503)
                return
            self._status_only(_put(self._upstream(), body, self.headers.get("Content-Type", "")))

        def _status_only(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


@contextmanager
def flaky_front() -> Iterator[FlakyFront]:
    """A FlakyFront serving on a free local port for the block's duration."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    front = FlakyFront(server.server_address[1])
    server.RequestHandlerClass = _handler(front)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()
