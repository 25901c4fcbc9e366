"""Built-in (causal-LM) jobs on the embedded stack, through the bus: ids named in the request are checked
against the registries, round 0 is the adapter built from the model's config alone, only adapters travel,
and the final PEFT adapter folder lands under the job's prefix; `distributed.enabled: false` is one shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apiary import keys
from apiary.registry import Upload, store_dataset, store_model, zip_folder
from apiary.weights import loads
from services.app.runtime import Embedded
from tests.fixtures import tiny_llm
from tests.fixtures.embedded import StackFactory, toy_request
from tests.unit.test_jobspec_documented import DOCUMENTED

pytest.importorskip("peft")


async def _register(stack: Embedded, tmp_path: Path) -> tuple[int, int]:
    """A tiny llama (model 1) and 12 text records (dataset 1) in the stack's storage."""
    folder = tiny_llm.save_model(tmp_path / "tiny-llama")
    model = await store_model(stack.ports.storage, 1, Upload(zip_folder(folder, tmp_path / "model.zip"), "tiny", "hf"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_llm.records(12)))
    dataset = await store_dataset(stack.ports.storage, 1, Upload(data, "train"))
    return int(model["model_id"]), int(dataset["dataset_id"])


def _request(model_id: Any, dataset_id: Any, **distributed: Any) -> dict[str, Any]:
    return {"name": "lora", "model_id": model_id, "dataset_id": dataset_id,
            "config": {"epochs": 1, "batch_size": 2, "learning_rate": 1e-2, "lora_r": 4, "lora_alpha": 8,
                       "max_seq_length": 32, "validation_split": 0.25},
            "distributed": {"num_rounds": 2, "steps_per_round": 2, "min_workers": 2, "max_workers": 2,
                            "aggregation_timeout": 300, "fault_tolerance": 0, **distributed}}


async def test_unknown_ids_are_rejected_naming_them(embedded: StackFactory) -> None:
    by_path = {**_request(None, "42"), "model": "/models/tiny"}
    del by_path["model_id"]

    async with embedded(workers=1) as stack:
        view = await stack.wait(await stack.submit(_request(7, "42")), timeout=30)
        unregistered = await stack.wait(await stack.submit(by_path), timeout=30)

    assert view["status"] == "rejected"
    assert {e["field"] for e in view["errors"]} == {"model_id", "dataset_id"}
    assert "model_id 7 is unknown" in view["reason"] and "dataset_id '42' is unknown" in view["reason"]
    assert unregistered["status"] == "rejected" and [e["field"] for e in unregistered["errors"]] == ["model"]
    assert "a built-in job fine-tunes a registered model: register '/models/tiny'" in unregistered["reason"]


async def test_a_lora_job_moves_only_adapters_and_ends_with_a_peft_adapter_folder(embedded: StackFactory,
                                                                                  tmp_path: Path) -> None:
    async with embedded(workers=2) as stack:
        model_id, dataset_id = await _register(stack, tmp_path)
        job_id = await stack.submit(_request(str(model_id), dataset_id))
        view = await stack.wait(job_id, timeout=240)
        storage = stack.ports.storage
        initial = loads(await storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await storage.get_bytes(keys.final_model(job_id)))
        stored = await storage.list(f"{keys.job_prefix(job_id)}final/adapter/")

    assert view["status"] == "completed", view.get("reason")
    assert set(initial) == set(final) and all("lora_" in key for key in initial)
    assert sorted(Path(k).name for k in stored) == ["adapter_config.json", "adapter_model.safetensors"]


async def test_the_documented_body_is_accepted_through_the_api_and_waits_for_its_listed_workers(
        embedded: StackFactory, tmp_path: Path) -> None:
    folder = tiny_llm.save_model(tmp_path / "tiny-llama")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_llm.records(12)))

    async with embedded(workers=1) as stack:
        model = await stack.api.register("models", zip_folder(folder, tmp_path / "model.zip"), "tiny")
        dataset = await stack.api.register("datasets", data, "train")
        body = {**DOCUMENTED, "model_id": model["model_id"], "dataset_id": str(dataset["dataset_id"])}
        submitted = await stack.api.submit_job(body)
        view = await stack.wait(submitted["job_id"], timeout=120, until=lambda v: v["status"] == "waiting")
        listed = [m["model_id"] for m in await stack.api.registered("models")]

    assert listed == [model["model_id"]] and view["num_shards"] == 3
    assert "of its pinned workers ['1', '3', '5'] online, min_workers is 2" in view["reason"]


async def test_not_distributed_trains_one_shard_on_one_worker(embedded: StackFactory, toy_dataset: Path) -> None:
    request = toy_request(toy_dataset, enabled=False, num_rounds=1)

    async with embedded(workers=2) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch("SELECT shard, samples FROM contributions WHERE job_id = $1", job_id)

    assert view["status"] == "completed", view.get("reason")
    assert [(r["shard"], r["samples"]) for r in rows] == [(0, 13)]
