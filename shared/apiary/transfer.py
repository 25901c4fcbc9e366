"""Moving bytes by URL, for processes that hold no storage credentials (workers).

One HTTP client (httpx) with timeouts (a server that stops answering fails the read in
`TIMEOUT.read` s). Transient failures (connection errors, timeouts, 5xx, 429) are retried with
capped exponential backoff and jitter (`apiary.backoff`), `RETRY.attempts` times or, given a `deadline`,
until then; a download that breaks off resumes where it stopped with a `Range` request, so a multi-GB
checkpoint is not fetched again from its first byte; uploads stream from the file. `file:` URLs (the
embedded storage) are copied, and a copy of a store file whose sha256 the store recorded is not hashed again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import unquote, urlparse

import httpx

from apiary import metrics
from apiary.backoff import Backoff, retry
from apiary.storage.base import sha256_file
from apiary.storage.local import atomic_copy, recorded_sha256

T = TypeVar("T")

log = logging.getLogger("apiary.transfer")

# Some S3 servers reject or stall on a PUT body labelled as a web form.
OCTET_STREAM = "application/octet-stream"
# Per connect / read / write, not for the whole transfer: a frozen server is given up on (and retried)
# within half a minute, while a slow one that still sends something keeps going.
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
# What another attempt may cure: the network, and a server that is failing or busy.
_TRANSIENT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class TransferError(Exception):
    """A download or upload by URL failed, or its bytes did not match their sha256."""


class _Transient(Exception):
    """A response worth another attempt (5xx, 429, or a resume the server would not serve)."""


# A small cap: a transfer resumes within seconds of the server's return.
RETRY = Backoff(cap=4.0)
_RETRYABLE = (_Transient, *_TRANSIENT_ERRORS)

__all__ = ["OCTET_STREAM", "RETRY", "TIMEOUT", "Backoff", "TransferError", "download", "probe", "upload"]

_client: httpx.Client | None = None
_client_lock = threading.Lock()


def _http() -> httpx.Client:
    """The process's one HTTP client (thread-safe, pooled), made on first use."""
    global _client
    with _client_lock:
        if _client is None:
            # The system's trust store, as urllib used before (httpx would default to certifi's).
            _client = httpx.Client(timeout=TIMEOUT, verify=ssl.create_default_context())
        return _client


def _where(url: str) -> str:
    """A URL without its query (presigned signatures are credentials)."""
    parts = urlparse(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _local(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def _check(response: httpx.Response, what: str, url: str) -> None:
    """Raise _Transient for a response worth retrying, TransferError for any other failure."""
    if response.status_code >= 500 or response.status_code == 429:
        raise _Transient(f"HTTP {response.status_code}")
    if response.is_error:
        raise TransferError(f"{what} {_where(url)} failed: HTTP {response.status_code}")


def _with_retries(what: str, url: str, attempt: Callable[[], T], deadline: float | None = None) -> T:
    """Run `attempt` until it succeeds, retrying transient failures (`apiary.backoff.retry` with `RETRY`),
    `RETRY.attempts` times in all or, given a `deadline` (epoch seconds), for as long as a wait would
    end before it; any failure that is left becomes a TransferError."""
    failures = 0

    def retrying(e: BaseException, failed: int, wait: float) -> None:
        nonlocal failures
        failures = failed
        log.warning("%s %s failed (%s); retrying in %.2g s", what, _where(url), e, wait)

    try:
        return retry(attempt, RETRY, lambda e: isinstance(e, _RETRYABLE), deadline=deadline, on_retry=retrying)
    except _RETRYABLE as e:
        raise TransferError(f"{what} {_where(url)} failed after {failures + 1} attempts: {e}") from e
    except (OSError, httpx.HTTPError) as e:
        raise TransferError(f"{what} {_where(url)} failed: {e}") from e


class _Partial:
    """A download in progress: the bytes written so far and their running sha256."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.size = 0
        self.digest = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        """Append bytes that arrived."""
        self.out.write(chunk)
        self.digest.update(chunk)
        self.size += len(chunk)

    def restart(self) -> None:
        """Forget what was written: the server sends the object from its first byte again."""
        self.out.seek(0)
        self.out.truncate()
        self.size = 0
        self.digest = hashlib.sha256()


def _fetch(url: str, part: _Partial) -> None:
    """One GET of what `part` still lacks: the rest of the object by `Range` when it holds some."""
    headers = {"Range": f"bytes={part.size}-"} if part.size else {}
    with _http().stream("GET", url, headers=headers) as response:
        if response.status_code == 416:  # the object changed under the resume: start again
            part.restart()
            raise _Transient("HTTP 416 on resume")
        _check(response, "download from", url)
        if part.size and not response.headers.get("content-range", "").startswith(f"bytes {part.size}-"):
            part.restart()  # the server ignored the range and sends the whole object
        for chunk in response.iter_bytes():
            part.write(chunk)


def _download(url: str, target: Path, deadline: float | None) -> str:
    target.parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("file:"):
        source = _local(url)
        if not source.is_file():
            raise TransferError(f"{source} does not exist")
        recorded = recorded_sha256(source)
        atomic_copy(source, target)
        if recorded is not None and recorded_sha256(source) == recorded:  # the same file before and after the copy
            return recorded[0]
        return sha256_file(target)
    tmp = target.with_name(f".{target.name}.part")
    try:
        with open(tmp, "wb") as out:
            part = _Partial(out)
            _with_retries("download from", url, lambda: _fetch(url, part), deadline)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)  # left only by a download that failed
    return part.digest.hexdigest()


def _put(url: str, source: Path) -> None:
    """One PUT of the file, streamed from disk (httpx sends its length from the file's size)."""
    with open(source, "rb") as f:
        response = _http().put(url, content=f, headers={"Content-Type": OCTET_STREAM})
    _check(response, "upload to", url)


def _upload(url: str, source: Path, sha256: str | None, deadline: float | None) -> None:
    if url.startswith("file:"):
        atomic_copy(source, _local(url), sha256)
        return
    _with_retries("upload to", url, lambda: _put(url, source), deadline)


def _probe(url: str, limit: int) -> bytes | None:
    if url.startswith("file:"):
        try:
            with open(_local(url), "rb") as f:
                return f.read(limit)
        except OSError:
            return None
    data = b""
    try:
        with _http().stream("GET", url, timeout=30.0) as response:
            if response.is_error:
                return None  # missing (404; 403 where the signer may not list the bucket)
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) >= limit:
                    break
    except httpx.TransportError:
        return None  # unreachable
    return data[:limit]


async def probe(url: str, limit: int = 64 * 1024) -> bytes | None:
    """A small object's bytes (at most `limit`) if it can be read now, else None: missing, refused
    or unreachable alike."""
    return await asyncio.to_thread(_probe, url, limit)


async def download(url: str, target: Path, sha256: str | None = None, *, deadline: float | None = None) -> None:
    """Fetch a URL to a file, resuming after transient failures (until `deadline`, epoch seconds, if
    given), and check its sha256."""
    digest = await asyncio.to_thread(_download, url, target, deadline)
    if sha256 is not None and digest != sha256:
        target.unlink(missing_ok=True)
        raise TransferError(f"sha256 mismatch for {target.name}: expected {sha256[:12]}…, got {digest[:12]}…")
    metrics.transferred("download", target.stat().st_size)


async def upload(url: str, source: Path, *, sha256: str | None = None, deadline: float | None = None) -> None:
    """PUT a file to a URL, streamed from disk, retrying transient failures (until `deadline`, epoch
    seconds, if given). To a `file:` URL (the embedded store) the file is copied, and `sha256`, where the caller
    computed it while writing the file, is recorded beside the copy for the store's readers."""
    await asyncio.to_thread(_upload, url, source, sha256, deadline)
    metrics.transferred("upload", source.stat().st_size)
