"""A built-in (causal-LM) job's two ends on the scheduler: round 0's weights from the registered model (with
peft, its adapter built from the model's config alone: no base weights are loaded), and the final PEFT
adapter folder (plus, with merge_adapter, a merged model folder) under the job's prefix."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.dataset import extract_shard
from apiary.jobspec import JobSpec
from apiary.registry import RegistryError, model_info
from apiary.storage import Storage
from apiary.trainers.causal_lm_config import CausalLMConfig

FINAL_ADAPTER = "adapter"  # under jobs/<id>/final/
FINAL_MERGED = "merged"


def final_folder(job_id: str, name: str) -> str:
    """Where a final artifact folder's files go: `jobs/<id>/final/<name>/`."""
    return f"{keys.job_prefix(job_id)}final/{name}/"


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


async def initial_weights(storage: Storage, job_id: str, spec: JobSpec) -> ObjectRef:
    """Round 0: the LoRA adapter from the model's config (use_peft), else the base model's own weights."""
    from apiary.trainers.causal_lm_adapter import initial_adapter, initial_full_weights
    from apiary.weights import dumps

    info, cfg = await registered_model(storage, spec)
    if cfg.use_peft:
        tensors = await asyncio.to_thread(initial_adapter, info["hf_config"], cfg)
    else:
        with _model_here(storage, info) as fetch:
            tensors = await asyncio.to_thread(initial_full_weights, await fetch())
    return await storage.put_bytes(keys.global_weights(job_id, 0), await asyncio.to_thread(dumps, tensors))


async def final_artifacts(storage: Storage, job_id: str, spec: JobSpec, data: bytes) -> list[str]:
    """The final PEFT adapter folder (and the merged model, with merge_adapter) stored under the job's
    prefix; returns their storage prefixes. Nothing for a job without peft: its final model is the weights."""
    from apiary.trainers.causal_lm_adapter import merge_adapter_folder, write_adapter_folder
    from apiary.weights import loads

    info, cfg = await registered_model(storage, spec)
    if not cfg.use_peft:
        return []
    tensors = await asyncio.to_thread(loads, data)
    with tempfile.TemporaryDirectory(prefix="apiary-final-") as tmp:
        adapter = Path(tmp) / FINAL_ADAPTER
        await asyncio.to_thread(write_adapter_folder, tensors, info["hf_config"], cfg, adapter, info.get("name"))
        stored = [await _put_folder(storage, adapter, final_folder(job_id, FINAL_ADAPTER))]
        if cfg.merge_adapter:
            merged = Path(tmp) / FINAL_MERGED
            with _model_here(storage, info) as fetch:
                await asyncio.to_thread(merge_adapter_folder, await fetch(), adapter, merged)
            stored.append(await _put_folder(storage, merged, final_folder(job_id, FINAL_MERGED)))
    return stored


async def _put_folder(storage: Storage, folder: Path, prefix: str) -> str:
    """Store every file of a folder under `prefix`; return the prefix."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            await storage.put_file(prefix + path.relative_to(folder).as_posix(), path)
    return prefix


@contextlib.contextmanager
def _model_here(storage: Storage, info: dict[str, Any]) -> Iterator[Any]:
    """A temporary folder and an async function that fetches the registered model into it: its path (an
    unpacked model folder, or the single file). Only a job without peft, or a merge, needs the weights."""
    with tempfile.TemporaryDirectory(prefix="apiary-model-") as tmp:
        async def fetch() -> Path:
            target = Path(tmp) / info["filename"]
            await storage.get_file(info["key"], target)
            if info["format"] != "hf":
                return target
            folder = Path(tmp) / "model"
            await asyncio.to_thread(extract_shard, target, folder)
            return folder

        yield fetch
