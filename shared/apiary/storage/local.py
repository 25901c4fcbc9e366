"""The embedded storage: a local folder; writes land whole or not at all.

Each object written through the store has its sha256 recorded beside it (`.<name>.sha256`) with the identity of the
file written (inode, size, mtime, ctime): a reader that finds the file still that one trusts the digest instead of
hashing the bytes again, as an S3 reader trusts the ETag of an object the store verified; a file replaced or
written to since has another identity and is hashed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from apiary.contracts import ObjectRef
from apiary.storage.base import ObjectNotFound, Storage, check_key, sha256_file


def _sidecar(path: Path) -> Path:
    """Where the sha256 recorded for the file at `path` is kept (a dot-file: not an object, never listed)."""
    return path.with_name(f".{path.name}.sha256")


def file_identity(st: os.stat_result) -> str:
    """What changes when a file is replaced (its inode) or written to (its size, mtime, ctime)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _record(target: Path, fd: int, sha256: str | None) -> None:
    """Record the sha256 of the file just renamed to `target` (open as `fd`, so a later replacement of `target`
    does not inherit it); without one, drop any recorded for what was there before."""
    sidecar = _sidecar(target)
    if sha256 is None:
        sidecar.unlink(missing_ok=True)
        return
    fd_tmp, tmp = tempfile.mkstemp(dir=target.parent, prefix=f"{sidecar.name}.")
    try:
        with os.fdopen(fd_tmp, "w") as f:
            f.write(f"{sha256} {file_identity(os.fstat(fd))}\n")
        os.replace(tmp, sidecar)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def recorded_sha256(path: Path) -> tuple[str, str] | None:
    """The sha256 recorded when the file at `path` was written through the store, and the file's identity, if the
    file there now is still the one written then (not replaced, not written to since); else None."""
    try:
        sha256, identity = _sidecar(path).read_text().split()
        now = file_identity(os.stat(path))
    except (OSError, ValueError):
        return None
    return (sha256, identity) if now == identity else None


def atomic_write(target: Path, data: bytes, sha256: str | None = None) -> None:
    """Write a file through a temporary sibling and a rename, so readers never see half of it; record `sha256` (the
    data's, computed by the caller) beside it, so readers of the store need not hash it again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.replace(tmp, target)
            _record(target, f.fileno(), sha256)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(source: Path, target: Path, sha256: str | None = None) -> None:
    """Copy a file through a temporary sibling and a rename; record `sha256` (the source's, known to the caller
    from when it wrote it) beside the copy, as `atomic_write` does."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.replace(tmp, target)
            _record(target, fd, sha256)
        finally:
            os.close(fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LocalStorage(Storage):
    """Objects as files under a root folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def put_bytes(self, key: str, data: bytes) -> ObjectRef:
        path = self._path(key)
        sha256 = hashlib.sha256(data).hexdigest()
        await asyncio.to_thread(atomic_write, path, data, sha256)
        return ObjectRef(key=key, size=len(data), sha256=sha256)

    async def put_file(self, key: str, path: Path) -> ObjectRef:
        target = self._path(key)

        def copy() -> ObjectRef:
            sha256 = sha256_file(Path(path))
            atomic_copy(Path(path), target, sha256)
            return ObjectRef(key=key, size=target.stat().st_size, sha256=sha256)

        return await asyncio.to_thread(copy)

    async def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    async def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        if not source.is_file():
            raise ObjectNotFound(key)
        await asyncio.to_thread(atomic_copy, source, Path(path))

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    async def list(self, prefix: str) -> list[str]:
        def walk() -> list[str]:
            # Walked from the deepest folder the prefix names, not from the root (every job's objects).
            folder = self.root.joinpath(*prefix.split("/")[:-1]) if "/" in prefix else self.root
            if ".." in prefix.split("/") or not folder.is_dir():
                return []
            keys = (
                p.relative_to(self.root).as_posix()
                for p in folder.rglob("*")
                if p.is_file() and not p.name.startswith(".")
            )
            return sorted(k for k in keys if k.startswith(prefix))

        return await asyncio.to_thread(walk)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        _sidecar(path).unlink(missing_ok=True)

    def presign_get(self, key: str, expires: int) -> str:
        return self._path(key).as_uri()

    def presign_put(self, key: str, expires: int) -> str:
        return self._path(key).as_uri()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()
