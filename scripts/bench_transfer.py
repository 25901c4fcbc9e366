#!/usr/bin/env python
"""What a worker's transfers cost: `apiary.transfer` (httpx, one pooled client) against the standard library's
`urllib.request` (what workers used before issue 14), for the round benchmark's 400 kB weights.

Two servers, each in the same run:
- moto's S3 server (`tests/fixtures/s3server.py`, plain HTTP) with presigned URLs, as in `bench_round.py`: it
  closes the connection after every response, so neither client reuses one;
- a local HTTPS server that keeps connections open (HTTP/1.1, a self-signed certificate made for the run), as a
  real S3 endpoint does: urllib opens a connection and does a TLS handshake per request, httpx's pool reuses one.

For each: client CPU (this process's user + system time; for HTTPS the server's threads live in this process
too, so its figure is client and server together) and wall time per request, medians of --repeat runs of
--n requests each, the two clients alternating.

Usage: python scripts/bench_transfer.py [--n 200] [--repeat 3] [--size 400000]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import socketserver
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apiary import transfer  # noqa: E402
from tests.fixtures import s3server  # noqa: E402


async def measure(call: Callable[[], Awaitable[None]], n: int) -> tuple[float, float]:
    """CPU and wall seconds per call, over n calls after a few to warm up."""
    for _ in range(5):
        await call()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        await call()
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


def urllib_get(url: str, target: Path, context: ssl.SSLContext | None = None) -> None:
    """A GET to a file as workers did before (in a thread, as they did): urllib, a new connection each time."""
    with urllib.request.urlopen(url, timeout=60, context=context) as response, open(target, "wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)


def urllib_put(url: str, source: Path) -> None:
    with open(source, "rb") as f:
        request = urllib.request.Request(url, data=f, method="PUT", headers={
            "Content-Length": str(source.stat().st_size), "Content-Type": transfer.OCTET_STREAM})
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()


def s3_urls(endpoint: str, body: bytes) -> tuple[str, str]:
    """A presigned GET of a stored object and a presigned PUT, on moto."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="bench-transfer")
    s3.put_object(Bucket="bench-transfer", Key="global", Body=body)
    return (s3.generate_presigned_url("get_object", Params={"Bucket": "bench-transfer", "Key": "global"}),
            s3.generate_presigned_url("put_object", Params={"Bucket": "bench-transfer", "Key": "result"}))


def https_server(body: bytes, folder: Path) -> tuple[str, ssl.SSLContext]:
    """A keep-alive HTTPS server of `body` in this process; its URL and a client context that trusts it."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # Trusted as a deployment trusts its S3 endpoint's CA: apiary.transfer's client (made at its first request,
    # after this) reads the system's trust store, which SSL_CERT_FILE names.
    os.environ["SSL_CERT_FILE"] = str(cert)
    return f"https://127.0.0.1:{server.server_address[1]}/global", ssl.create_default_context(cafile=str(cert))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="requests per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="measurements of each client, alternating")
    parser.add_argument("--size", type=int, default=400_000, help="bytes of the object (the benchmark's weights)")
    args = parser.parse_args()
    moto, endpoint = s3server.launch()
    try:
        with tempfile.TemporaryDirectory(prefix="apiary-transfer-") as tmp:
            asyncio.run(compare(args, endpoint, Path(tmp)))
    finally:
        moto.terminate()


async def compare(args: argparse.Namespace, endpoint: str, folder: Path) -> None:
    """Each case's two clients, alternating, printed with their ratio."""
    body = os.urandom(args.size)
    source, target = folder / "source", folder / "target"
    source.write_bytes(body)
    get, put = s3_urls(endpoint, body)
    https, trust = https_server(body, folder)  # before the first transfer: its client trusts the certificate
    cases: dict[str, dict[str, Callable[[], Awaitable[None]]]] = {
        "moto S3, GET (a new connection each)": {
            "apiary.transfer": lambda: transfer.download(get, target),
            "urllib": lambda: asyncio.to_thread(urllib_get, get, target)},
        "moto S3, PUT (a new connection each)": {
            "apiary.transfer": lambda: transfer.upload(put, source),
            "urllib": lambda: asyncio.to_thread(urllib_put, put, source)},
        "HTTPS keep-alive, GET (client and server CPU)": {
            "apiary.transfer": lambda: transfer.download(https, target),
            "urllib": lambda: asyncio.to_thread(urllib_get, https, target, trust)},
    }
    for case, clients in cases.items():
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
        for _ in range(args.repeat):
            for name, call in clients.items():
                runs[name].append(await measure(call, args.n))
        (new_cpu, new_wall), (old_cpu, old_wall) = (
            (statistics.median(c for c, _ in runs[name]), statistics.median(w for _, w in runs[name]))
            for name in ("apiary.transfer", "urllib"))
        print(f"{case}, {args.size} bytes: apiary.transfer CPU {new_cpu * 1e3:.2f} ms, wall {new_wall * 1e3:.2f} ms;"
              f" urllib CPU {old_cpu * 1e3:.2f} ms, wall {old_wall * 1e3:.2f} ms; ratio CPU {new_cpu / old_cpu:.2f},"
              f" wall {new_wall / old_wall:.2f}", flush=True)


if __name__ == "__main__":
    main()
