"""Built-in (causal-LM) jobs on the embedded stack, through the bus: ids named in the request are checked
against the registries, round 0 is the adapter built from the model's config alone (without peft, the base's
weights read by a worker), only adapters travel, the final PEFT adapter folder lands under the job's prefix and
the merged model (merge_adapter) is made by a worker; the scheduler never reads the base model.
`distributed.enabled: false` is one shard."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from apiary import keys
from apiary.contracts import MERGE, Assignment, ObjectRef
from apiary.registry import Upload, model_info, store_dataset, store_model, zip_folder
from apiary.settings import Settings
from apiary.storage import Storage
from apiary.storage.local import LocalStorage
from apiary.weights import loads
from services.app.runtime import Embedded
from services.scheduler.builtin import final_folder, merged_upload, store_merged
from services.worker import Worker
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


def _request(model_id: Any, dataset_id: Any, config: dict[str, Any] | None = None,
             **distributed: Any) -> dict[str, Any]:
    return {"name": "lora", "model_id": model_id, "dataset_id": dataset_id,
            "config": {"epochs": 1, "batch_size": 2, "learning_rate": 1e-2, "lora_r": 4, "lora_alpha": 8,
                       "max_seq_length": 32, "validation_split": 0.25, **(config or {})},
            "distributed": {"num_rounds": 2, "steps_per_round": 2, "min_workers": 2, "max_workers": 2,
                            "aggregation_timeout": 300, "fault_tolerance": 0, **distributed}}


def _record_reads(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys read through the stack's storage port from now on: by its services (the scheduler among them);
    workers read by presigned URL, never through it."""
    read: list[str] = []
    for name in ("get_bytes", "get_file"):
        original = getattr(storage, name)

        async def recorded(key: str, *args: Any, _original: Any = original) -> Any:
            read.append(key)
            return await _original(key, *args)

        monkeypatch.setattr(storage, name, recorded)
    return read


def _state(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


async def test_full_fine_tuning_starts_from_the_base_weights_read_by_a_worker_not_the_scheduler(
        embedded: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    from transformers import AutoModelForCausalLM

    async with embedded(workers=2) as stack:
        model_id, dataset_id = await _register(stack, tmp_path)
        storage = stack.ports.storage
        model_key = (await model_info(storage, model_id))["key"]
        read = _record_reads(storage, monkeypatch)

        # Execute
        job_id = await stack.submit(_request(model_id, dataset_id, {"use_peft": False}, num_rounds=1))
        view = await stack.wait(job_id, timeout=300)
        initial = loads(await storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await storage.get_bytes(keys.final_model(job_id)))

    # Assert
    base = _state(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama"))
    assert view["status"] == "completed", view.get("reason")
    assert set(initial) == set(base) == set(final)
    assert all((initial[k] == base[k]).all() for k in base)
    assert any(not (final[k] == base[k]).all() for k in base)
    assert model_key not in read, "the scheduler read the base model"


async def test_merge_adapter_is_a_workers_task_and_its_folder_is_the_base_with_the_adapter_merged(
        embedded: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    async with embedded(workers=2) as stack:
        model_id, dataset_id = await _register(stack, tmp_path)
        storage = stack.ports.storage
        model_key = (await model_info(storage, model_id))["key"]
        read = _record_reads(storage, monkeypatch)

        # Execute
        job_id = await stack.submit(_request(model_id, dataset_id, {"merge_adapter": True}))
        view = await stack.wait(job_id, timeout=300)
        stored = await storage.list(final_folder(job_id, "merged"))
        upload_left = await storage.exists(merged_upload(job_id))

    # Assert
    assert view["status"] == "completed", view.get("reason")
    assert model_key not in read, "the scheduler read the base model"
    assert "config.json" in {Path(k).name for k in stored} and not upload_left
    final = stack.settings.home / "storage" / "jobs" / job_id / "final"
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    AutoTokenizer.from_pretrained(final / "merged")
    here = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama"),
                                     str(final / "adapter")).merge_and_unload()
    expected, got = _state(here), _state(merged)
    assert set(got) == set(expected)
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in expected)
    assert any(not torch.equal(got[k], v) for k, v in _state(AutoModelForCausalLM.from_pretrained(
        tmp_path / "tiny-llama")).items()), "the merged model is the base: the adapter was not merged"


class _CutsItsCachedModel(Worker):
    """A worker whose cached base model is truncated (as a full disk would leave it) before it merges."""

    async def on_assignment(self, assignment: Assignment, delivery: Any) -> None:
        if assignment.task == MERGE:
            for path in self.models.root.rglob("*.safetensors"):
                path.chmod(0o644)
                path.write_bytes(path.read_bytes()[:64])
        await super().on_assignment(assignment, delivery)


async def test_a_failed_merge_fails_the_job_in_one_line_and_keeps_the_adapter(tmp_path: Path) -> None:
    # Prepare
    settings = Settings(home=tmp_path / ".apiary", heartbeat_interval=0.5, progress_interval=0.0)
    stack = Embedded(settings, workers=0)
    stack.workers = [_CutsItsCachedModel(stack.ports.bus, settings, worker_id=f"w{i}") for i in (1, 2)]
    async with stack:
        model_id, dataset_id = await _register(stack, tmp_path)

        # Execute
        job_id = await stack.submit(_request(model_id, dataset_id, {"merge_adapter": True}))
        view = await stack.wait(job_id, timeout=300)
        adapter = await stack.ports.storage.list(final_folder(job_id, "adapter"))
        merged = await stack.ports.storage.list(final_folder(job_id, "merged"))

    # Assert
    reason = view.get("reason") or ""
    assert view["status"] == "failed" and "\n" not in reason, reason
    assert reason.startswith("merging round 2's adapter into the base model: failed on worker w"), reason
    assert "cannot be loaded" in reason and "the adapter is kept at" in reason, reason
    assert sorted(Path(k).name for k in adapter) == ["adapter_config.json", "adapter_model.safetensors"]
    assert merged == []


@pytest.mark.parametrize("fault", ["sha256", "no config", "escaping member"])
async def test_a_bad_merged_upload_is_refused_and_leaves_nothing_stored(tmp_path: Path, fault: str) -> None:
    # Prepare: an upload as a merge assignment leaves it, then spoiled
    storage = LocalStorage(tmp_path / "storage")
    archive = tmp_path / "merged.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("model.safetensors", b"weights")
        zf.writestr("config.json" if fault != "no config" else "other.json", b"{}")
        if fault == "escaping member":
            zf.writestr("../outside.json", b"{}")
    ref = await storage.put_file(merged_upload("j"), archive)
    if fault == "sha256":
        ref = ObjectRef(key=ref.key, size=ref.size, sha256="0" * 64)

    # Execute
    with pytest.raises(ValueError) as refused:
        await store_merged(storage, "j", ref)

    # Assert
    assert "merged model" in str(refused.value) and "\n" not in str(refused.value)
    assert await storage.list(final_folder("j", "merged")) == []


async def test_a_job_stopped_early_merges_its_best_rounds_adapter_and_starts_no_more_rounds(
        embedded: StackFactory, tmp_path: Path) -> None:
    # Prepare: the training loss falls round after round, so with mode max and patience 1 round 2 stops the job
    # keeping round 1; round 3 starts as soon as round 2 is aggregated, before the merge is asked for.
    stopping = {"metric": "loss", "mode": "max", "patience": 1}
    async with embedded(workers=2) as stack:
        model_id, dataset_id = await _register(stack, tmp_path)
        storage = stack.ports.storage

        # Execute
        job_id = await stack.submit(_request(model_id, dataset_id, {"merge_adapter": True}, num_rounds=5,
                                             early_stopping=stopping))
        view = await stack.wait(job_id, timeout=300)
        started = [r["round"] for r in await stack.ports.db.fetch(
            "SELECT round FROM rounds WHERE job_id = $1 ORDER BY round", job_id)]
        final = await storage.get_bytes(keys.final_model(job_id))
        kept = await storage.get_bytes(keys.global_weights(job_id, 1))
        merged = await storage.list(final_folder(job_id, "merged"))

    # Assert
    assert view["status"] == "completed", view.get("reason")
    assert view["reason"].startswith("stopped early at round 2"), view["reason"]
    assert started == [1, 2, 3], started  # round 3 was cancelled with the job, no round 4 started
    assert final == kept and "config.json" in {Path(k).name for k in merged}
