"""The embedded storage: a local folder; writes land whole or not at all."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from apiary.contracts import ObjectRef
from apiary.storage.base import ObjectNotFound, Storage, check_key, sha256_file


def atomic_write(target: Path, data: bytes) -> None:
    """Write a file through a temporary sibling and a rename, so readers never see half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(source: Path, target: Path) -> None:
    """Copy a file through a temporary sibling and a rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
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
        await asyncio.to_thread(atomic_write, path, data)
        return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    async def put_file(self, key: str, path: Path) -> ObjectRef:
        target = self._path(key)

        def copy() -> ObjectRef:
            atomic_copy(Path(path), target)
            return ObjectRef(key=key, size=target.stat().st_size, sha256=sha256_file(target))

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
        self._path(key).unlink(missing_ok=True)

    def presign_get(self, key: str, expires: int) -> str:
        return self._path(key).as_uri()

    def presign_put(self, key: str, expires: int) -> str:
        return self._path(key).as_uri()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()
