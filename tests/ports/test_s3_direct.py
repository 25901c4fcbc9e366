"""S3's whole-object reads and writes by presigned URL (apiary.storage.s3_direct): they skip the client's
request pipeline, yet retry and fail as its calls do."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from apiary.storage import s3
from apiary.storage.base import StorageUnavailable
from apiary.storage.s3 import S3Storage
from tests.fixtures.s3front import Mode, S3Front


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct requests wait milliseconds between attempts, not botocore's seconds."""
    monkeypatch.setattr(s3, "DIRECT_RETRY", s3.Backoff(attempts=s3.ATTEMPTS, base=0.01))


async def test_small_objects_are_read_and_written_without_the_client_calls(s3_url: str, s3_server: str) -> None:
    # Prepare: count the client's GetObject and PutObject calls.
    storage = S3Storage(s3_url, endpoint_url=s3_server)
    calls: list[str] = []
    for operation in ("GetObject", "PutObject"):
        storage._client.meta.events.register(f"before-call.s3.{operation}", lambda **kw: calls.append("call"))
    data = os.urandom(300_000)

    # Execute
    ref = await storage.put_bytes("jobs/j1/round-1/global", data)
    read = await storage.get_bytes("jobs/j1/round-1/global")
    many = await asyncio.gather(*(storage.get_bytes("jobs/j1/round-1/global") for _ in range(8)))

    # Assert: the bytes and their sha256 stored, read back whole, and no client call made.
    assert read == data and all(m == data for m in many)
    assert ref.size == len(data) and await storage.verified_bytes(ref) == data
    assert calls == []


async def test_a_read_answered_503_once_is_retried(s3_url: str, s3_server: str) -> None:
    # Prepare
    with S3Front(s3_server) as front:
        storage = S3Storage(s3_url, endpoint_url=front.endpoint)
        await storage.put_bytes("a", b"weights")
        front.slow_down()

        # Execute: the read meets one 503, then S3 is back.
        read = asyncio.create_task(storage.get_bytes("a"))
        await _until(lambda: front.counts[Mode.SLOW_DOWN] >= 1, "the first attempt to be refused")
        front.resume()

        # Assert
        assert await read == b"weights"
        assert front.counts[Mode.SLOW_DOWN] == 1


async def test_a_body_cut_short_is_retried_then_storage_unavailable(short_body_server: _ShortBodies) -> None:
    # Prepare: a server that announces 10 bytes and sends 4.
    storage = S3Storage("s3://bucket/runs", endpoint_url=short_body_server.endpoint)

    # Execute
    with pytest.raises(StorageUnavailable) as raised:
        await storage.get_bytes("model")

    # Assert: the client's number of attempts, and an outage naming the bucket.
    assert short_body_server.gets == s3.ATTEMPTS
    assert "bucket 'bucket'" in str(raised.value)


async def test_an_outage_message_carries_no_url_signature() -> None:
    # Prepare: a port nothing listens on.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    storage = S3Storage("s3://nowhere/p", endpoint_url=f"http://127.0.0.1:{port}")

    # Execute
    with pytest.raises(StorageUnavailable) as raised:
        await storage.get_bytes("k")

    # Assert: where it failed, without the presigned query (a credential).
    message = f"{raised.value} {raised.value.reason}"
    assert f"127.0.0.1:{port}/nowhere/p/k" in message
    assert "X-Amz-" not in message


async def _until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class _ShortBodies(ThreadingHTTPServer):
    """Answers every GET with a body shorter than its Content-Length, then closes the connection."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ShortHandler)
        self.gets = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ShortHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ShortBodies

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.gets += 1
        self.send_response(200)
        self.send_header("Content-Length", "10")
        self.end_headers()
        self.wfile.write(b"half")
        self.close_connection = True


@pytest.fixture
def short_body_server() -> Iterator[_ShortBodies]:
    server = _ShortBodies()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
