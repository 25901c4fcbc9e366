"""Where a job's dataset is, decided from its reference alone: a local path or a key in this storage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from apiary.dataset import DatasetError


@dataclass(frozen=True)
class DatasetLocation:
    """A dataset in this deployment's storage (`key`) or on this machine (`path`); a plain path, unlike a
    file:// URI, is checked for existence before it is read."""

    path: Path | None = None
    key: str | None = None
    plain: bool = False


def locate(ref: str, storage_prefix: str) -> DatasetLocation:
    """Where `ref` (a path, a file:// URI or a storage URI) points; `storage_prefix` is this storage's URI
    for the empty key. A storage URI outside it is refused."""
    if ref.startswith("file:"):
        return DatasetLocation(path=Path(unquote(urlparse(ref).path)))
    if ref.startswith("s3://"):
        if not ref.startswith(storage_prefix):
            raise DatasetError(f"dataset {ref} is outside this deployment's storage ({storage_prefix})")
        return DatasetLocation(key=ref.removeprefix(storage_prefix))
    return DatasetLocation(path=Path(ref), plain=True)
