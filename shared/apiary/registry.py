"""Datasets kept in storage under `datasets/<id>/`, so jobs can name them by `dataset_id`."""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

from apiary.dataset import DatasetError, DatasetSource
from apiary.storage import ObjectNotFound, Storage

INFO = "dataset.json"


def _zip_folder(folder: Path, target: Path) -> None:
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())


async def upload_dataset(storage: Storage, path: Path, *, name: str | None = None) -> dict[str, Any]:
    """Check a dataset folder or zip, store it as one zip, and return its id, URI and size."""
    path = Path(path)
    source = DatasetSource(path)
    try:
        manifest = source.manifest()
        for sample in manifest.samples[:1]:
            source.read(sample["path"])
    finally:
        source.close()
    dataset_id = uuid.uuid4().hex[:12]
    name = name or path.stem
    with tempfile.TemporaryDirectory(prefix="apiary-upload-") as tmp:
        archive = path
        if path.is_dir():
            archive = Path(tmp) / f"{name}.zip"
            await asyncio.to_thread(_zip_folder, path, archive)
        ref = await storage.put_file(f"datasets/{dataset_id}/{name}.zip", archive)
    info = {"dataset_id": dataset_id, "name": name, "key": ref.key, "size": ref.size, "sha256": ref.sha256,
            "num_samples": len(manifest.samples), "uri": storage.uri(ref.key)}
    await storage.put_bytes(f"datasets/{dataset_id}/{INFO}", json.dumps(info).encode())
    return info


async def dataset_info(storage: Storage, dataset_id: str) -> dict[str, Any]:
    """What `upload_dataset` recorded for an id; DatasetError if there is no such dataset."""
    if not dataset_id.replace("-", "").replace("_", "").isalnum():
        raise DatasetError(f"dataset_id {dataset_id!r} is not a valid id")
    try:
        return dict(json.loads(await storage.get_bytes(f"datasets/{dataset_id}/{INFO}")))
    except ObjectNotFound:
        raise DatasetError(
            f"dataset_id {dataset_id!r} is unknown: upload it with `apiary dataset upload PATH`"
        ) from None
