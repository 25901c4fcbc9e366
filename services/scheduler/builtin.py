"""A built-in (causal-LM) job's two ends on the scheduler, which never loads the base model's weights: round 0's
adapter built from the model's config alone (with peft; without it, round 0 is the base's own weights, which an
init assignment makes on a worker), the final PEFT adapter folder written from the final adapter, and the
merged model (merge_adapter) that a merge assignment uploads as one zip, unpacked here into the job's prefix
file by file (bytes streamed through, never a model loaded)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.jobspec import JobSpec
from apiary.policy import Refused, check_zip
from apiary.registry import RegistryError, model_info
from apiary.storage import Storage
from apiary.storage.base import CHUNK, sha256_file
from apiary.trainers.causal_lm_config import CausalLMConfig

FINAL_ADAPTER = "adapter"  # under jobs/<id>/final/
FINAL_MERGED = "merged"
MERGED_CONFIG = "config.json"  # what makes the merged folder a Hugging Face model folder


def final_folder(job_id: str, name: str) -> str:
    """Where a final artifact folder's files go: `jobs/<id>/final/<name>/`."""
    return f"{keys.job_prefix(job_id)}final/{name}/"


def merged_upload(job_id: str) -> str:
    """Where a merge assignment uploads the merged model folder, zipped (removed once it is unpacked)."""
    return f"{keys.job_prefix(job_id)}final/{FINAL_MERGED}.zip"


def merge_due(spec: JobSpec) -> bool:
    """Whether the job ends with its adapter merged into the base model (built-in, use_peft, merge_adapter)."""
    cfg = spec.built_in
    return cfg is not None and cfg.use_peft and cfg.merge_adapter


async def registered_model(storage: Storage, spec: JobSpec) -> tuple[dict[str, Any], CausalLMConfig]:
    """The built-in job's registered model record and its trainer config; RegistryError if it has none."""
    cfg = spec.built_in
    if cfg is None or spec.model_id is None:
        raise RegistryError("a built-in job names its base model by model_id (register it: apiary model add PATH)")
    info = await model_info(storage, spec.model_id)
    if not info.get("hf_config"):
        raise RegistryError(f"model_id {spec.model_id} is a plain checkpoint, not a causal LM the built-in "
                            "trainer can fine-tune: register a Hugging Face model folder or a GGUF file")
    return info, cfg


async def initial_weights(storage: Storage, job_id: str, spec: JobSpec) -> ObjectRef | None:
    """Round 0 with peft: the LoRA adapter from the model's config; None without peft (the base model's own
    weights, which an init assignment reads on a worker)."""
    info, cfg = await registered_model(storage, spec)
    if not cfg.use_peft:
        return None
    from apiary.trainers.causal_lm_adapter import initial_adapter
    from apiary.weights import dumps

    tensors = await asyncio.to_thread(initial_adapter, info["hf_config"], cfg)
    return await storage.put_bytes(keys.global_weights(job_id, 0), await asyncio.to_thread(dumps, tensors))


async def final_artifacts(storage: Storage, job_id: str, spec: JobSpec, data: bytes) -> list[str]:
    """The final PEFT adapter folder stored under the job's prefix (the merged model, with merge_adapter, is a
    merge assignment's); returns its storage prefix. Nothing for a job without peft: its final model is the
    weights."""
    from apiary.trainers.causal_lm_adapter import write_adapter_folder
    from apiary.weights import loads

    info, cfg = await registered_model(storage, spec)
    if not cfg.use_peft:
        return []
    tensors = await asyncio.to_thread(loads, data)
    with tempfile.TemporaryDirectory(prefix="apiary-final-") as tmp:
        adapter = Path(tmp) / FINAL_ADAPTER
        await asyncio.to_thread(write_adapter_folder, tensors, info["hf_config"], cfg, adapter, info.get("name"))
        return [await _put_folder(storage, adapter, final_folder(job_id, FINAL_ADAPTER))]


async def store_merged(storage: Storage, job_id: str, merged: ObjectRef) -> str:
    """Unpack a merge assignment's upload (the merged model folder, zipped) into `final/merged/`, one file at a
    time through a temporary one, and drop the zip; returns the folder's prefix. ValueError (or ObjectNotFound)
    naming what is wrong; files already stored are removed then."""
    expected = merged_upload(job_id)
    if merged.key != expected:
        raise ValueError(f"reported model {merged.key!r} is not the merge assignment's upload ({expected!r})")
    prefix = final_folder(job_id, FINAL_MERGED)
    stored: list[str] = []
    with tempfile.TemporaryDirectory(prefix="apiary-merged-") as tmp:
        archive, member = Path(tmp) / "merged.zip", Path(tmp) / "member"
        await storage.get_file(expected, archive)
        try:
            with await asyncio.to_thread(_checked_zip, archive, merged) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        await asyncio.to_thread(_extract, zf, info, member)
                        stored.append(prefix + info.filename)
                        await storage.put_file(stored[-1], member)
        except BaseException:
            for key in stored:
                await storage.delete(key)
            raise
    await storage.delete(expected)
    return prefix


def _checked_zip(archive: Path, merged: ObjectRef) -> zipfile.ZipFile:
    """The uploaded zip, opened once its size and sha256 are the reported ones, its members safe and its
    folder a model's (a config.json at its top)."""
    size = archive.stat().st_size
    if size != merged.size:
        raise ValueError(f"the merged model's zip is {size} bytes, not the reported {merged.size}")
    if (digest := sha256_file(archive)) != merged.sha256:
        raise ValueError(f"the merged model's zip has sha256 {digest[:12]}…, not the reported {merged.sha256[:12]}…")
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"the merged model's upload is not a readable zip: {e}") from None
    try:
        check_zip(zf, "the merged model's zip", size)
        if MERGED_CONFIG not in zf.namelist():
            raise ValueError(f"the merged model's zip holds no {MERGED_CONFIG}: it is not a Hugging Face model folder")
    except (Refused, ValueError):
        zf.close()
        raise
    return zf


def _extract(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path) -> None:
    """One member's bytes into `target`, streamed (check_zip refused names that would leave the folder)."""
    try:
        with zf.open(info) as source, open(target, "wb") as out:
            shutil.copyfileobj(source, out, CHUNK)
    except zipfile.BadZipFile as e:
        raise ValueError(f"the merged model's zip cannot be read at {info.filename!r}: {e}") from None


async def _put_folder(storage: Storage, folder: Path, prefix: str) -> str:
    """Store every file of a folder under `prefix`; return the prefix."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            await storage.put_file(prefix + path.relative_to(folder).as_posix(), path)
    return prefix
