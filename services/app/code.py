"""A job file's `code:` folder (or .zip) shipped with the job: packed here into a deterministic bundle,
uploaded through the tracker's API (stored once by sha256), and referenced from the request by key and sha256."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from apiary import bundle
from services.tracker.client import TrackerClient, TrackerError

log = logging.getLogger("apiary.cli")


def local_code(request: dict[str, Any]) -> Path | None:
    """The local folder or zip a job file's `code` names (None: no code, or a stored bundle's reference)."""
    code = request.get("code")
    return Path(code) if isinstance(code, str) else None


def pack_problems(request: dict[str, Any], packed: bundle.Packed | None = None) -> list[str]:
    """What is wrong with a job file's `code` before anything starts: a folder that cannot be packed, or an
    entrypoint module that is not in it; one line each."""
    source = local_code(request)
    if source is None:
        return []
    try:
        packed = packed or bundle.pack(source)
    except (ValueError, OSError) as e:
        return [f"code: {str(e).removeprefix('code: ')}"]
    entrypoint = request.get("entrypoint")
    module = entrypoint.partition(":")[0] if isinstance(entrypoint, str) else ""
    inspected = bundle.Inspected(files=packed.files, unpacked_bytes=0)
    if module and not inspected.has_module(module):
        path = module.replace(".", "/")
        return [f"entrypoint: module {module!r} is not in the code folder {source}: no {path}.py or "
                f"{path}/__init__.py there (paths in the bundle are relative to that folder)"]
    return []


async def ship(api: TrackerClient, request: dict[str, Any]) -> dict[str, Any]:
    """The request with its local `code` packed, uploaded and replaced by the stored bundle's reference
    ({key, sha256, size}); unchanged without one. RuntimeError in one line if the folder cannot be packed, lacks
    the entrypoint's module, or is refused."""
    source = local_code(request)
    if source is None:
        return request
    try:
        packed = await asyncio.to_thread(bundle.pack, source)
    except (ValueError, OSError) as e:
        raise RuntimeError(f"code: {str(e).removeprefix('code: ')}") from None
    if problems := pack_problems(request, packed):
        raise RuntimeError("; ".join(problems))
    for path, why in packed.left_out:
        if why != "ignored":
            log.warning("code bundle: %s left out (%s)", path, why)
    try:
        stored = await api.upload_code(packed.data, packed.sha256)
    except TrackerError as e:
        raise RuntimeError(f"code: the tracker refused the bundle: {e}") from None
    log.info("code bundle %s: %d files, %d bytes", packed.sha256[:12], len(packed.files), packed.size)
    return {**request, "code": stored}


__all__ = ["local_code", "pack_problems", "ship"]
