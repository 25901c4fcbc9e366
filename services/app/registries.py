"""`apiary model add` and `apiary dataset upload`: a model or dataset checked and packed here (a folder is
zipped), then registered through the tracker's API, which gives it its integer id."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from apiary.registry import RegistryError, Upload, dataset_upload, model_upload
from services.app.tracker_api import ApiSettings, tracker_api

# What `--json` prints of a registration, besides its id.
SHOWN = ("name", "uri", "sha256", "size")


async def register(settings: ApiSettings, kind: str, path: Path, name: str | None) -> dict[str, Any]:
    """Register a model (`kind` models) or dataset (datasets) at `path`; return the tracker's record of it."""
    with tempfile.TemporaryDirectory(prefix="apiary-upload-") as tmp:
        pack = model_upload if kind == "models" else dataset_upload
        try:
            upload: Upload = await asyncio.to_thread(pack, path, Path(tmp), name)
        except RegistryError as e:
            raise RuntimeError(str(e)) from None
        async with tracker_api(settings) as (api, _):
            return await api.register(kind, upload.file, upload.name)


def describe(info: dict[str, Any]) -> str:
    """What a registration holds, for people: its samples or its model format, and its size."""
    what = f"{info['num_samples']} samples" if "num_samples" in info else f"{info.get('format')} model"
    return f"{what}, {info['size']} bytes"


def summary(info: dict[str, Any], id_field: str) -> dict[str, Any]:
    """The one object `--json` prints: the new id, name, uri, sha256 and size."""
    return {id_field: info[id_field], **{key: info.get(key) for key in SHOWN}}


__all__ = ["describe", "register", "summary"]
