"""What every storage adapter provides."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from apiary.contracts import MultipartUpload, ObjectRef
from apiary.errors import DependencyUnavailable

CHUNK = 8 * 1024 * 1024


class ObjectNotFound(KeyError):
    """No object is stored under the key."""


class StorageUnavailable(DependencyUnavailable):
    """Storage cannot be reached now (unreachable, timing out, failing or throttling); the caller may retry later."""


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_key(key: str) -> str:
    """Refuse keys that could escape the store's root."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid storage key {key!r}: expected a relative path like 'jobs/<id>/model'")
    return key


class Storage(ABC):
    """A bucket (or folder) of immutable-by-convention objects addressed by key."""

    @abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> ObjectRef:
        """Store bytes under a key, atomically; return its size and sha256."""

    @abstractmethod
    async def put_file(self, key: str, path: Path) -> ObjectRef:
        """Store a file under a key without reading it into memory."""

    @abstractmethod
    async def get_bytes(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound if absent."""

    @abstractmethod
    async def get_file(self, key: str, path: Path) -> None:
        """Write the object to a file, streaming; ObjectNotFound if absent."""

    @abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether an object is stored under the key."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys that start with the prefix, sorted."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove an object; no error if absent."""

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Remove these objects (as few requests as the store allows); no error for one absent."""
        for key in keys:
            await self.delete(key)

    @abstractmethod
    def presign_get(self, key: str, expires: int) -> str:
        """A URL anyone holding it can GET the object from, for `expires` seconds."""

    @abstractmethod
    def presign_put(self, key: str, expires: int) -> str:
        """A URL anyone holding it can PUT the object to, for `expires` seconds."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """The object's address for people: `file:///...` or `s3://bucket/...`."""

    async def start_multipart(self, key: str, parts: int, part_size: int, expires: int) -> MultipartUpload | None:
        """Open a multipart upload to `key` of at most `parts` parts of `part_size` bytes, presigned for `expires`
        seconds; None where the store takes whole objects only (a local folder: a copy)."""
        return None

    async def abort_multipart(self, prefix: str) -> int:
        """Abort the incomplete multipart uploads to keys under `prefix`; how many there were."""
        return 0

    async def verified_bytes(self, ref: ObjectRef) -> bytes:
        """The object's bytes, checked against the claim's size and sha256 (ValueError if not)."""
        data = await self.get_bytes(ref.key)
        if len(data) != ref.size:
            raise ValueError(f"{ref.key}: size {len(data)} does not match the announced {ref.size}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != ref.sha256:
            raise ValueError(f"{ref.key}: sha256 mismatch (announced {ref.sha256[:12]}…, got {digest[:12]}…)")
        return data
