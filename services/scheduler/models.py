"""The job's model at its two ends: round 0's weights, and the final model's evaluation and report."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from apiary import keys
from apiary.contracts import ObjectRef, RoundAggregated
from apiary.jobspec import JobSpec
from apiary.registry import RegistryError, model_info
from apiary.storage import Storage
from apiary.trainers import TrainerError, UserCodeError, UserCodeRunner
from apiary.weights import read_header
from services.scheduler import builtin

log = logging.getLogger("apiary.scheduler")

INIT_TIMEOUT = 600.0


async def initial_weights(storage: Storage, runner: UserCodeRunner, job_id: str, spec: JobSpec) -> ObjectRef:
    """Round 0's weights: the built-in trainer's (from the registered model), the job's checkpoint, or the
    entrypoint module's fl_init_weights(env)."""
    if spec.trainer is not None:
        return await builtin.initial_weights(storage, job_id, spec)
    target = keys.global_weights(job_id, 0)
    source = spec.model or spec.model_id
    if isinstance(source, int):  # a registered checkpoint
        source = (await model_info(storage, source))["key"]
    if source:
        data = await _read_model(storage, source)
        read_header(data)
        return await storage.put_bytes(target, data)
    with tempfile.TemporaryDirectory(prefix="apiary-init-") as tmp:
        path = Path(tmp) / "init.safetensors"
        found = await runner.init_weights(spec.module, spec.env(0), path, timeout=INIT_TIMEOUT)
        if not found:
            raise ValueError(
                f"no initial weights: give the job a 'model' checkpoint or define "
                f"fl_init_weights(env) in {spec.module}"
            )
        read_header(await asyncio.to_thread(path.read_bytes))
        return await storage.put_file(target, path)


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


async def evaluate(runner: UserCodeRunner, job_id: str, spec: JobSpec, round_index: int,
                   data: bytes) -> tuple[dict[str, Any], str | None]:
    """The final model's metrics from the entrypoint module's evaluation (if it has one), and the
    evaluation's error if it failed (the job still completes). A built-in job has no user code to run here:
    its rounds report validation loss."""
    if spec.trainer is not None:
        return {}, None
    with tempfile.TemporaryDirectory(prefix="apiary-eval-") as tmp:
        path = Path(tmp) / "final.safetensors"
        path.write_bytes(data)
        try:
            return dict(await runner.evaluate(spec.module, spec.env(round_index), path,
                                              timeout=INIT_TIMEOUT) or {}), None
        except UserCodeError as e:
            log.warning("job %s: evaluation failed: %s", job_id, e)
            return {}, str(e)


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
                 last: RoundAggregated, evaluation_error: str | None) -> bytes:
    """The job's metrics report: final metrics and every round, the last one as it just aggregated."""
    rounds = [r for r in history if (r["round"], r["attempt"]) != (last.round, last.attempt)]
    rounds.append({"round": last.round, "attempt": last.attempt, "status": "aggregated", "metrics": last.metrics})
    report = {"job_id": job_id, "name": name, "final": metrics, "rounds": rounds,
              "evaluation_error": evaluation_error}
    return json.dumps(report, indent=1).encode()
