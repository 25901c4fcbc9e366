"""The documented LLM fine-tuning request, end to end: a tiny random llama registered with the CLI, a JSONL
dataset uploaded, the documented body POSTed to the HTTP API, three workers of the mixed selection (own 1
and 3, platform 5); the final adapter loads with peft, and after round 1 each worker moves only adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("peft")

from apiary.settings import Settings
from services.app.runtime import Embedded
from services.worker import Worker
from tests.fixtures.llm import TransferLog, cli_json, jsonl_dataset, llama_folder

WORKERS = {"1": "own", "3": "own", "5": "platform"}


def documented_body(model_id: int, dataset_id: int) -> dict[str, Any]:
    """The request the product documentation shows, verbatim in shape, with small steps."""
    return {
        "name": "distributed-llama-finetune",
        "dataset_id": dataset_id,
        "model_id": model_id,
        "config": {"epochs": 3, "batch_size": 4, "learning_rate": 2e-4, "mixed_precision": "bf16",
                   "use_peft": True, "lora_r": 16, "lora_alpha": 32},
        "distributed": {"enabled": True, "strategy": "federated_averaging", "num_rounds": 3, "steps_per_round": 2,
                        "min_workers": 2, "max_workers": 5, "aggregation_timeout": 600, "fault_tolerance": 1},
        "worker_selection": {"mode": "mixed", "worker_ids": [1, 3], "parsyn_worker_ids": [5]},
    }


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> TransferLog:
    """Every download and upload the in-process workers make, by worker."""
    log = TransferLog(tmp_path / ".apiary" / "workers")
    log.install(monkeypatch.setattr)
    return log


async def test_the_documented_request_fine_tunes_a_registered_llama_moving_only_adapters(
        tmp_path: Path, transfers: TransferLog) -> None:
    # Prepare
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = llama_folder(tmp_path / "tiny-llama")
    data = jsonl_dataset(tmp_path / "records.jsonl")
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.0)
    stack = Embedded(settings, workers=0)
    stack.workers = [Worker(stack.ports.bus, settings.model_copy(update={"worker_kind": kind}), worker_id=wid)
                     for wid, kind in WORKERS.items()]
    async with stack:
        url, token = await stack.tracker.start_http(), await stack.api_token()
        model = await cli_json(url, "model", "add", str(base), "--name", "tiny-llama", token=token)
        dataset = await cli_json(url, "dataset", "upload", str(data), "--name", "records", token=token)

        # Execute
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            response = await http.post("/api/v1/training-jobs",
                                       json=documented_body(model["model_id"], dataset["dataset_id"]))
            assert response.status_code in (200, 201, 202), response.text
            job_id = response.json()["job_id"]
            view = await stack.wait(job_id, timeout=600)
            workers = {w["worker_id"]: w["kind"] for w in (await http.get("/api/v1/workers")).json()}

    # Assert
    assert view["status"] == "completed", view.get("reason")
    assert [r["status"] for r in view["rounds"]] == ["aggregated"] * 3
    assert all(isinstance(r["metrics"].get("val_loss"), float) for r in view["rounds"])
    assert workers == WORKERS
    adapter = settings.home / "storage" / "jobs" / job_id / "final" / "adapter"
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    assert getattr(tuned.peft_config["default"], "r", None) == 16
    adapter_size = (adapter / "adapter_model.safetensors").stat().st_size
    round_2 = next(r["started_at"] for r in view["rounds"] if r["round"] == 2)
    for worker in WORKERS:
        later = transfers.since(worker, round_2)
        per_round = sum(m.size for m in later) / 2
        assert per_round <= 1.05 * 2 * adapter_size, (worker, adapter_size, later)
        assert later, f"worker {worker} moved nothing after round 1"
