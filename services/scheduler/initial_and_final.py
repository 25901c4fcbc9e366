"""The job's model at its two ends: round 0's weights (where no user code makes them), and the final report."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.jobspec import JobSpec
from apiary.registry import RegistryError, model_info
from apiary.safetensors_header import read_header
from apiary.storage import Storage
from apiary.trainers import TrainerError
from services.scheduler import builtin

log = logging.getLogger("apiary.scheduler")


async def initial_weights(storage: Storage, job_id: str, spec: JobSpec) -> ObjectRef | None:
    """Round 0's weights where no user code is needed: the built-in trainer's (from the registered model) or
    the job's checkpoint; None when the entrypoint module's fl_init_weights(env) must make them (an init
    task, on a worker)."""
    if spec.trainer is not None:
        return await builtin.initial_weights(storage, job_id, spec)
    source = spec.model or spec.model_id
    if isinstance(source, int):  # a registered checkpoint
        source = (await model_info(storage, source))["key"]
    if not source:
        return None
    data = await _read_model(storage, source)
    read_header(data)
    return await storage.put_bytes(keys.global_weights(job_id, 0), data)


def no_initial_weights(spec: JobSpec) -> str:
    """Why a job has no initial weights: its module defines no fl_init_weights and it names no model."""
    return (f"no initial weights: give the job a 'model' checkpoint or define fl_init_weights(env) in "
            f"{spec.module}")


async def checked_initial_weights(storage: Storage, job_id: str, weights: ObjectRef) -> ObjectRef:
    """The weights an init task reported, once verified: the object its upload URL wrote, of that size and
    sha256, a well-formed safetensors file. ValueError (or ObjectNotFound) naming what is wrong."""
    expected = keys.global_weights(job_id, 0)
    if weights.key != expected:
        raise ValueError(f"reported weights {weights.key!r} are not the init task's upload ({expected!r})")
    read_header(await storage.verified_bytes(weights))
    return weights


async def _read_model(storage: Storage, source: str) -> bytes:
    """A checkpoint's bytes from a file: URI, this deployment's storage (URI or key) or a local path."""
    if source.startswith("file:"):
        return await asyncio.to_thread(Path(unquote(urlparse(source).path)).read_bytes)
    own = storage.uri("x").removesuffix("x")
    if source.startswith(own):
        return await storage.get_bytes(source.removeprefix(own))
    if "://" in source:
        raise ValueError(f"model {source} is outside this deployment's storage ({own})")
    if Path(source).is_file():
        return await asyncio.to_thread(Path(source).read_bytes)
    return await storage.get_bytes(source)


async def finish_built_in(storage: Storage, job_id: str, spec: JobSpec, data: bytes) -> str | None:
    """A built-in job's final artifacts (the PEFT adapter folder, the merged model) stored under its prefix;
    why they could not be, if so (the job still completes with its final weights)."""
    if spec.trainer is None:
        return None
    try:
        stored = await builtin.final_artifacts(storage, job_id, spec, data)
    except (RegistryError, TrainerError, OSError, ValueError) as e:
        log.warning("job %s: final artifacts failed: %s", job_id, e)
        return f"final artifacts: {e}"
    log.info("job %s: final artifacts at %s", job_id, ", ".join(stored) or "(weights only)")
    return None


def final_report(job_id: str, name: str, metrics: dict[str, Any], history: list[dict[str, Any]],
                 evaluations: list[dict[str, Any]], kept: int, reason: str | None) -> bytes:
    """The job's metrics report: final metrics (of round `kept`), every round and every evaluation."""
    report = {"job_id": job_id, "name": name, "final": metrics, "final_round": kept, "rounds": history,
              "evaluations": [{"round": e["round"], "status": e["status"], "metrics": e["metrics"],
                               "error": e["error"]} for e in evaluations],
              "reason": reason}
    return json.dumps(report, indent=1).encode()
