"""Moving bytes by URL, for processes that hold no storage credentials (workers)."""

from __future__ import annotations

import asyncio
import hashlib
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

from apiary.storage.base import CHUNK, sha256_file
from apiary.storage.local import atomic_copy

# Without it urllib labels a PUT body as a web form (and some S3 servers reject or stall on that).
OCTET_STREAM = "application/octet-stream"


class TransferError(Exception):
    """A download or upload by URL failed, or its bytes did not match their sha256."""


def _where(url: str) -> str:
    """A URL without its query (presigned signatures are credentials)."""
    parts = urlparse(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _local(url: str) -> Path:
    return Path(unquote(urlparse(url).path))


def _download(url: str, target: Path) -> str:
    target.parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("file:"):
        source = _local(url)
        if not source.is_file():
            raise TransferError(f"{source} does not exist")
        atomic_copy(source, target)
        return sha256_file(target)
    tmp = target.with_name(f".{target.name}.part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
        tmp.replace(target)
    except (urllib.error.URLError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise TransferError(f"download from {_where(url)} failed: {e}") from e
    return digest.hexdigest()


def _upload(url: str, source: Path) -> None:
    if url.startswith("file:"):
        atomic_copy(source, _local(url))
        return
    size = source.stat().st_size
    with open(source, "rb") as f:
        request = urllib.request.Request(url, data=f, method="PUT", headers={
            "Content-Length": str(size), "Content-Type": OCTET_STREAM})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
        except (urllib.error.URLError, OSError) as e:
            raise TransferError(f"upload to {_where(url)} failed: {e}") from e


def _probe(url: str, limit: int) -> bytes | None:
    if url.startswith("file:"):
        path = _local(url)
        try:
            with open(path, "rb") as f:
                return f.read(limit)
        except OSError:
            return None
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return bytes(response.read(limit))
    except (urllib.error.URLError, OSError):
        # Missing (404; 403 where the signer may not list the bucket), or unreachable.
        return None


async def probe(url: str, limit: int = 64 * 1024) -> bytes | None:
    """A small object's bytes (at most `limit`) if it can be read now, else None: missing, refused
    or unreachable alike."""
    return await asyncio.to_thread(_probe, url, limit)


async def download(url: str, target: Path, sha256: str | None = None) -> None:
    """Fetch a URL to a file and check its sha256."""
    digest = await asyncio.to_thread(_download, url, target)
    if sha256 is not None and digest != sha256:
        target.unlink(missing_ok=True)
        raise TransferError(f"sha256 mismatch for {target.name}: expected {sha256[:12]}…, got {digest[:12]}…")


async def upload(url: str, source: Path) -> None:
    """PUT a file to a URL."""
    await asyncio.to_thread(_upload, url, source)
