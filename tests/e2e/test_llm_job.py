"""The documented LLM fine-tuning request, end to end: a tiny random llama registered with the CLI, a JSONL
dataset uploaded, the documented body POSTed to the HTTP API, three workers of the mixed selection (own 1
and 3, platform 5); the final adapter loads with peft, and after round 1 each worker moves only adapters."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("peft")

from apiary import transfer
from apiary.settings import Settings
from services.app.runtime import Embedded
from services.worker import Worker

WORDS = ["code", "for", "alice", "bruno", "chiara", "lyon", "porto", "kyoto", "is", "-"]
WORKERS = {"1": "own", "3": "own", "5": "platform"}


def tiny_llama(folder: Path) -> Path:
    """A randomly initialised two-layer llama and a word-level tokenizer, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "</s>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="</s>")
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(vocab), pad_token_id=0, eos_token_id=2,
                         bos_token_id=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def jsonl_dataset(path: Path, count: int = 24) -> Path:
    """Prompt/completion records: a name and a city in, the city and the name out."""
    names, cities = WORDS[2:5], WORDS[5:8]
    lines = [json.dumps({"prompt": f"code for {names[i % 3]} {cities[i // 3 % 3]}",
                         "completion": f" {cities[i // 3 % 3]} - {names[i % 3]}"}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


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


@dataclass(frozen=True)
class Moved:
    """One transfer a worker made: when, which worker's file, how many bytes."""

    at: float
    worker: str
    path: Path
    size: int


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Moved]]:
    """Every download and upload the in-process workers make, by worker (from the file's place)."""
    record: list[Moved] = []
    workers_dir = tmp_path / ".apiary" / "workers"
    download, upload = transfer.download, transfer.upload

    def note(path: Path) -> None:
        parts = path.resolve().relative_to(workers_dir.resolve()).parts
        record.append(Moved(time.time(), parts[0], path, path.stat().st_size))

    async def counted_download(url: str, target: Path, sha256: str | None = None, **kw: Any) -> None:
        await download(url, target, sha256, **kw)
        note(target)

    async def counted_upload(url: str, source: Path, **kw: Any) -> None:
        note(source)
        await upload(url, source, **kw)

    monkeypatch.setattr(transfer, "download", counted_download)
    monkeypatch.setattr(transfer, "upload", counted_upload)
    yield record


async def cli(api_url: str, *args: str) -> dict[str, Any]:
    """Run `apiary ARGS --json` against the stack's API; its one JSON object."""
    env = {**os.environ, "APIARY_API_URL": api_url, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.app.cli", *args, "--json",
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env=env)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def test_the_documented_request_fine_tunes_a_registered_llama_moving_only_adapters(
        tmp_path: Path, moved: list[Moved]) -> None:
    # Prepare
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tiny_llama(tmp_path / "tiny-llama")
    data = jsonl_dataset(tmp_path / "records.jsonl")
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.0)
    stack = Embedded(settings, workers=0)
    stack.workers = [Worker(stack.ports.bus, settings.model_copy(update={"worker_kind": kind}), worker_id=wid)
                     for wid, kind in WORKERS.items()]
    async with stack:
        url = await stack.tracker.start_http()
        model = await cli(url, "model", "add", str(base), "--name", "tiny-llama")
        dataset = await cli(url, "dataset", "upload", str(data), "--name", "records")

        # Execute
        async with httpx.AsyncClient(base_url=url) as http:
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
        later = [m for m in moved if m.worker == worker and m.at >= round_2]
        per_round = sum(m.size for m in later) / 2
        assert per_round <= 1.05 * 2 * adapter_size, (worker, adapter_size, later)
        assert later, f"worker {worker} moved nothing after round 1"
