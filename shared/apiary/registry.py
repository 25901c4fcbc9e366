"""The registries' storage layout: datasets under `datasets/<id>/` (dataset.json beside the data) and models
under `models/<id>/` (model.json beside the model file). Ids are allocated by the tracker; this module stores
and reads what an id names, so the scheduler and the sharder need nothing but storage."""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from apiary.contracts import ModelRef
from apiary.dataset import DatasetError, DatasetSource
from apiary.dataset_text import JSONL, count_records
from apiary.jobspec import FieldError, JobSpec
from apiary.storage import ObjectNotFound, Storage

INFO = "dataset.json"
MODEL_INFO = "model.json"
HF_CONFIG = "config.json"
ModelFormat = Literal["hf", "gguf", "safetensors"]
MODEL_SUFFIXES: dict[str, ModelFormat] = {".gguf": "gguf", ".safetensors": "safetensors", ".zip": "hf"}


class RegistryError(ValueError):
    """A model or dataset that cannot be registered, or an id that names none; the message says which."""


@dataclass(frozen=True)
class Upload:
    """One file to store for a registration: what it is and the name people know it by."""

    file: Path
    name: str
    format: ModelFormat | None = None  # models only


def zip_folder(folder: Path, target: Path) -> Path:
    """Zip a folder's files (sorted, stored uncompressed: models and datasets compress poorly)."""
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())
    return target


# ------------------------------------------------------------------ datasets


def dataset_upload(path: Path, tmp: Path, name: str | None = None) -> Upload:
    """The one file a dataset folder, zip or JSONL file is stored as (a folder is zipped into `tmp`)."""
    name = name or path.stem
    if path.is_dir():
        return Upload(zip_folder(path, tmp / f"{name}.zip"), name)
    if not path.is_file():
        raise RegistryError(f"dataset {path} does not exist")
    return Upload(path, name)


def count_samples(file: Path) -> int:
    """How many samples (or text records) a dataset file holds; DatasetError saying what is wrong."""
    records = count_records(file)
    if records is not None:
        return records
    source = DatasetSource(file)
    try:
        manifest = source.manifest()
        for sample in manifest.samples[:1]:
            source.read(sample["path"])
        return len(manifest.samples)
    finally:
        source.close()


async def store_dataset(storage: Storage, dataset_id: int | str, upload: Upload) -> dict[str, Any]:
    """Check a dataset file, store it under its id and record its dataset.json; return that record."""
    num_samples = count_samples(upload.file)
    suffix = JSONL if upload.file.suffix == JSONL else ".zip"
    ref = await storage.put_file(f"datasets/{dataset_id}/{upload.name}{suffix}", upload.file)
    info = {"dataset_id": dataset_id, "name": upload.name, "key": ref.key, "size": ref.size, "sha256": ref.sha256,
            "num_samples": num_samples, "uri": storage.uri(ref.key), "created_at": time.time()}
    await storage.put_bytes(f"datasets/{dataset_id}/{INFO}", json.dumps(info).encode())
    return info


async def dataset_info(storage: Storage, dataset_id: int | str) -> dict[str, Any]:
    """What `store_dataset` recorded for an id; DatasetError if there is no such dataset."""
    text = str(dataset_id)
    if not text.replace("-", "").replace("_", "").isalnum():
        raise DatasetError(f"dataset_id {text!r} is not a valid id")
    try:
        return dict(json.loads(await storage.get_bytes(f"datasets/{text}/{INFO}")))
    except ObjectNotFound:
        raise DatasetError(f"dataset_id {text!r} is unknown: upload it with `apiary dataset upload PATH`") from None


# ------------------------------------------------------------------ models


def model_upload(path: Path, tmp: Path, name: str | None = None) -> Upload:
    """The one file a model is stored as: a Hugging Face folder zipped into `tmp`, a .gguf or .safetensors file."""
    if path.is_dir():
        if not (path / HF_CONFIG).is_file():
            raise RegistryError(f"model folder {path} has no {HF_CONFIG}: give a Hugging Face model folder")
        name = name or path.name
        return Upload(zip_folder(path, tmp / "model.zip"), name, "hf")
    if not path.is_file():
        raise RegistryError(f"model {path} does not exist")
    fmt = MODEL_SUFFIXES.get(path.suffix.lower())
    if fmt is None or fmt == "hf":
        raise RegistryError(f"model {path}: give a Hugging Face model folder, a .gguf file or a .safetensors file")
    return Upload(path, name or path.stem, fmt)


def model_key(model_id: int, upload: Upload) -> str:
    """Where a model's file lives: `models/<id>/model.zip` for a folder, else under its own name."""
    if upload.format == "hf":
        return f"models/{model_id}/model.zip"
    return f"models/{model_id}/{upload.name}{'.gguf' if upload.format == 'gguf' else '.safetensors'}"


def hf_config(upload: Upload) -> dict[str, Any] | None:
    """The model's transformers config as a dict (read from the folder's config.json, or from a GGUF file's
    metadata without its weights); None for a plain safetensors checkpoint."""
    if upload.format == "hf":
        try:
            with zipfile.ZipFile(upload.file) as zf:
                return dict(json.loads(zf.read(HF_CONFIG)))
        except (KeyError, ValueError, zipfile.BadZipFile) as e:
            raise RegistryError(f"model {upload.name}: {HF_CONFIG} cannot be read ({e})") from None
    if upload.format == "gguf":
        return _gguf_config(upload.file)
    return None


def _gguf_config(file: Path) -> dict[str, Any]:
    """A GGUF file's architecture as a transformers config dict (transformers reads the metadata only)."""
    # Registration never reaches a model hub: everything it reads is the file given.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise RegistryError("registering a GGUF model needs the llm extra: pip install 'apiary[llm]'") from None
    try:
        return dict(AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name).to_dict())
    except Exception as e:  # a truncated or foreign file: transformers raises many kinds
        raise RegistryError(f"model {file.name} is not a GGUF model transformers can read: {e}") from None


async def store_model(storage: Storage, model_id: int, upload: Upload) -> dict[str, Any]:
    """Store a model under its id with its model.json (its hf_config read first); return that record."""
    config = hf_config(upload)
    ref = await storage.put_file(model_key(model_id, upload), upload.file)
    filename = "model.zip" if upload.format == "hf" else Path(ref.key).name
    info = {"model_id": model_id, "name": upload.name, "format": upload.format, "key": ref.key,
            "sha256": ref.sha256, "size": ref.size, "filename": filename, "uri": storage.uri(ref.key),
            "hf_config": config, "created_at": time.time()}
    await storage.put_bytes(f"models/{model_id}/{MODEL_INFO}", json.dumps(info).encode())
    return info


async def model_info(storage: Storage, model_id: int | str) -> dict[str, Any]:
    """What `store_model` recorded for an id; RegistryError if there is no such model."""
    text = str(model_id)
    if not text.isdigit():
        raise RegistryError(f"model_id {text!r} is not a valid id")
    try:
        return dict(json.loads(await storage.get_bytes(f"models/{text}/{MODEL_INFO}")))
    except ObjectNotFound:
        raise RegistryError(f"model_id {text} is unknown: register it with `apiary model add PATH`") from None


def model_ref(storage: Storage, info: dict[str, Any], ttl: int) -> ModelRef:
    """A registered model as an assignment carries it: presigned for `ttl` seconds, with how to check it."""
    return ModelRef(model_id=int(info["model_id"]), url=storage.presign_get(info["key"], ttl), sha256=info["sha256"],
                    size=int(info["size"]), format=info["format"], filename=info["filename"])


async def registry_errors(storage: Storage, spec: JobSpec) -> list[FieldError]:
    """One error per integer model_id or dataset_id that names nothing registered, and for a built-in job's
    model that is no causal LM (a plain checkpoint); older hex dataset ids are the sharder's to check."""
    errors = []
    if spec.trainer is not None and not isinstance(spec.model_id, int):
        errors.append(FieldError(field="model_id", message="a built-in job fine-tunes a registered model: give its "
                                 "integer model_id (register one with `apiary model add PATH`)"))
    held_out = spec.built_in.eval_dataset_id if spec.built_in is not None else None
    for field, dataset_id in (("dataset_id", spec.dataset_id), ("config.eval_dataset_id", held_out)):
        if isinstance(dataset_id, int):
            try:
                await dataset_info(storage, dataset_id)
            except DatasetError as e:
                errors.append(FieldError(field=field, message=str(e).replace("dataset_id", field, 1)))
    if isinstance(spec.model_id, int):
        try:
            info = await model_info(storage, spec.model_id)
        except RegistryError as e:
            errors.append(FieldError(field="model_id", message=str(e)))
        else:
            if spec.trainer is not None and not info.get("hf_config"):
                errors.append(FieldError(field="model_id", message=f"model {spec.model_id} is a plain checkpoint: "
                                         "the built-in trainer fine-tunes a Hugging Face model folder or a GGUF file"))
    return errors
