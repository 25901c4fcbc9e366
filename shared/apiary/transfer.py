"""Moving bytes by URL, for processes that hold no storage credentials (workers).

One HTTP client for the process (the standard library's, through one opener: the system's trust
store, proxies from the environment) with a timeout (a server that stops answering fails the read in
`TIMEOUT` s). Transient failures (connection errors, timeouts, a body cut short, 5xx, 429) are
retried with capped exponential backoff, `RETRY.attempts` times or, given a `deadline`, until then; a
download that breaks off resumes where it stopped with a `Range` request, so a multi-GB checkpoint is
not fetched again from its first byte; uploads stream from the file. `file:` URLs (the embedded
storage) are copied.

Why not httpx here: every worker makes three requests a round (the job's end marker while it may
have ended unheard, the global weights, its result), and httpx spends 2-3x the standard library's
CPU on each (it validates the long presigned query character by character): measured, 2.5 ms
against 1.2 ms of CPU per worker and round on 400 kB weights, the round benchmark's main regression.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import logging
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import unquote, urlparse

from apiary.backoff import Backoff
from apiary.storage.base import sha256_file
from apiary.storage.local import atomic_copy

T = TypeVar("T")

log = logging.getLogger("apiary.transfer")

# Some S3 servers reject or stall on a PUT body labelled as a web form.
OCTET_STREAM = "application/octet-stream"
# Per connect and per read, not for the whole transfer: a frozen server is given up on (and retried)
# within half a minute, while a slow one that still sends something keeps going.
TIMEOUT = 30.0
READ_SIZE = 1024 * 1024  # bytes per read of a download (what a resume may have to fetch again)


class TransferError(Exception):
    """A download or upload by URL failed, or its bytes did not match their sha256."""


class _Transient(Exception):
    """A failure worth another attempt: the network, or a response that says "not now" (5xx, 429, a
    resume the server would not serve)."""


# A small cap: a transfer resumes within seconds of the server's return.
RETRY = Backoff(cap=4.0)

__all__ = ["OCTET_STREAM", "RETRY", "TIMEOUT", "Backoff", "TransferError", "download", "probe", "upload"]

# Built once: `urlopen` with a TLS context builds a new opener (a dozen handlers) for every request.
_opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ssl.create_default_context()))


def _where(url: str) -> str:
    """A URL without its query (presigned signatures are credentials)."""
    parts = urlparse(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _local(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def _open(request: urllib.request.Request, what: str) -> http.client.HTTPResponse:
    """The response to `request`: _Transient for a failure worth retrying (the network, 5xx, 429),
    TransferError for an answer that will not change (any other 4xx), HTTPError(416) as it is."""
    try:
        response: http.client.HTTPResponse = _opener.open(request, timeout=TIMEOUT)
        return response
    except urllib.error.HTTPError as e:
        e.close()  # its connection, with the error's body unread
        if e.code >= 500 or e.code == 429:
            raise _Transient(f"HTTP {e.code}") from e
        if e.code == 416:
            raise
        raise TransferError(f"{what} {_where(request.full_url)} failed: HTTP {e.code}") from e
    except urllib.error.URLError as e:
        if not isinstance(e.reason, OSError):
            raise TransferError(f"{what} {_where(request.full_url)} failed: {e.reason}") from e
        raise _Transient(str(e.reason)) from e
    except (OSError, http.client.HTTPException) as e:  # reset or timed out before the answer
        raise _Transient(str(e) or type(e).__name__) from e


def _read(response: http.client.HTTPResponse) -> bytes:
    """The next bytes of a body; _Transient if the connection breaks or ends before the body does."""
    try:
        chunk = response.read(READ_SIZE)
    except (OSError, http.client.HTTPException) as e:
        raise _Transient(str(e) or type(e).__name__) from e
    if not chunk and response.length:  # http.client ends a body cut short without a word
        raise _Transient(f"connection closed {response.length} bytes before the end of the body")
    return chunk


def _with_retries(what: str, url: str, attempt: Callable[[], T], deadline: float | None = None) -> T:
    """Run `attempt` until it succeeds, retrying transient failures with capped exponential backoff,
    `RETRY.attempts` times in all or, given a `deadline` (epoch seconds), for as long as a wait would
    end before it; any failure that is left becomes a TransferError."""
    failures = 0
    while True:
        try:
            return attempt()
        except _Transient as e:
            failures += 1
            wait = RETRY.delay(failures)
            if (failures >= RETRY.attempts) if deadline is None else (time.time() + wait >= deadline):
                raise TransferError(f"{what} {_where(url)} failed after {failures} attempts: {e}") from e
            log.warning("%s %s failed (%s); retrying in %g s", what, _where(url), e, wait)
            time.sleep(wait)
        except OSError as e:  # the local file
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
    try:
        with _open(urllib.request.Request(url, headers=headers), "download from") as response:
            if part.size and not (response.headers.get("Content-Range") or "").startswith(f"bytes {part.size}-"):
                part.restart()  # the server ignored the range and sends the whole object
            while chunk := _read(response):
                part.write(chunk)
    except urllib.error.HTTPError as e:  # 416: the object changed under the resume: start again
        part.restart()
        raise _Transient(f"HTTP {e.code} on resume") from e


def _download(url: str, target: Path, deadline: float | None) -> str:
    target.parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("file:"):
        source = _local(url)
        if not source.is_file():
            raise TransferError(f"{source} does not exist")
        atomic_copy(source, target)
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
    """One PUT of the file, streamed from disk."""
    with open(source, "rb") as f:
        headers = {"Content-Type": OCTET_STREAM, "Content-Length": str(source.stat().st_size)}
        with _open(urllib.request.Request(url, data=f, method="PUT", headers=headers), "upload to") as response:
            _read(response)


def _upload(url: str, source: Path, deadline: float | None) -> None:
    if url.startswith("file:"):
        atomic_copy(source, _local(url))
        return
    _with_retries("upload to", url, lambda: _put(url, source), deadline)


def _probe(url: str, limit: int) -> bytes | None:
    if url.startswith("file:"):
        try:
            with open(_local(url), "rb") as f:
                return f.read(limit)
        except OSError:
            return None
    try:
        with _opener.open(url, timeout=TIMEOUT) as response:
            return bytes(response.read(limit))
    except urllib.error.HTTPError as e:
        e.close()
        return None
    except (OSError, http.client.HTTPException):
        # Missing (404; 403 where the signer may not list the bucket), or unreachable.
        return None


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


async def upload(url: str, source: Path, *, deadline: float | None = None) -> None:
    """PUT a file to a URL, streamed from disk, retrying transient failures (until `deadline`, epoch
    seconds, if given)."""
    await asyncio.to_thread(_upload, url, source, deadline)
