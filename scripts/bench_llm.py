#!/usr/bin/env python
"""LLM LoRA benchmark (issue 16): what travels and what the aggregator holds when only adapters move.

Reports, measured in the same run:
  - bytes each worker moves per round after the first (downloads and uploads, counted at the transfer
    functions of in-process workers), divided by 2 x the adapter's size (goal <= 1.05), for a job of the
    built-in causal-LM trainer on a small random llama with 3 workers;
  - the aggregator's peak extra memory per round (its path: verified bytes from storage, zero-copy load,
    validate and fold, finish), divided by the adapter's size (goal <= 2), for the adapter of a larger
    llama built on the meta device (no base weights anywhere).

Usage: python scripts/bench_llm.py [--rounds 4] [--hidden 2048] [--layers 16] [--rank 64]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test fixtures' tiny model and transfer log

from bench_record import add_json_argument, record  # noqa: E402

def rss_bytes(field: str = "VmRSS") -> int:
    """A figure from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


async def bytes_per_round(tmp: Path, rounds: int, hidden: int = 256, layers: int = 4) -> dict[str, object]:
    """Run a LoRA job on 3 in-process workers (a random llama, `hidden` wide) and print each worker's bytes
    per round after the first over 2 x the adapter."""
    from apiary.settings import Settings
    from services.app.runtime import Embedded
    from tests.fixtures.llm import SHARED, TransferLog, cli_json, jsonl_dataset, llama_folder

    transfers = TransferLog(tmp / ".apiary" / "workers")
    transfers.install()
    settings = Settings(home=tmp / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.0)
    async with Embedded(settings, workers=3) as stack:
        url, token = await stack.tracker.start_http(), await stack.api_token()
        model = await cli_json(url, "model", "add", str(llama_folder(tmp / "llama", hidden, layers)), token=token)
        dataset = await cli_json(url, "dataset", "upload", str(jsonl_dataset(tmp / "records.jsonl", 48)),
                                 token=token)
        job_id = await stack.submit({
            "name": "bench-llm", "model_id": model["model_id"], "dataset_id": dataset["dataset_id"],
            "config": {"batch_size": 4, "use_peft": True, "lora_r": 16, "lora_alpha": 32},
            "distributed": {"num_rounds": rounds, "steps_per_round": 2, "min_workers": 3, "max_workers": 3}})
        view = await stack.wait(job_id, timeout=1200)
    if view["status"] != "completed":
        raise SystemExit(f"the benchmark's job {view['status']}: {view.get('reason')}")
    adapter = (settings.home / "storage" / "jobs" / job_id / "final" / "adapter" / "adapter_model.safetensors")
    size = adapter.stat().st_size
    round_2 = next(r["started_at"] for r in view["rounds"] if r["round"] == 2)
    print(f"bytes moved: base model {model['size'] / 1e6:.1f} MB, adapter {size / 1e3:.1f} kB, {rounds} rounds")
    shared = sum(m.size for m in transfers.moved if m.worker == SHARED)
    print(f"  the workers' shared model cache: {shared / 1e6:.2f} MB (the base, fetched once for all of them)")
    per_worker = {}
    for worker in sorted({m.worker for m in transfers.moved} - {SHARED}):
        total = sum(m.size for m in transfers.since(worker, round_2))
        first = sum(m.size for m in transfers.before(worker, round_2))
        print(f"  {worker}: round 1 {first / 1e6:.2f} MB (shard, adapters); later rounds "
              f"{total / (rounds - 1) / 1e3:.1f} kB per round = {total / (rounds - 1) / (2 * size):.3f} x 2 adapters")
        per_worker[worker] = {"round_1_bytes": first, "later_bytes_per_round": round(total / (rounds - 1)),
                              "later_over_two_adapters": round(total / (rounds - 1) / (2 * size), 3)}
    return {"rounds": rounds, "base_model_bytes": model["size"], "adapter_bytes": size,
            "shared_model_cache_bytes": shared, "workers": per_worker}


async def aggregator_memory(tmp: Path, hidden: int, layers: int, rank: int, k: int = 3,
                            rounds: int = 3) -> dict[str, object]:
    """The aggregator's path over K stored adapter contributions per round; print its peak extra memory."""
    import torch

    from apiary.contracts import ObjectRef
    from apiary.storage.local import LocalStorage
    from apiary.strategies.base import Contribution, create
    from apiary.strategies.format import UpdateFormat
    from apiary.trainers.causal_lm_adapter import initial_adapter
    from apiary.trainers.causal_lm_config import CausalLMConfig
    from apiary.weights import dumps, loads, spec_of

    hf_config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": hidden * 4,
                 "vocab_size": 32000}
    adapter = initial_adapter(hf_config, CausalLMConfig(lora_r=rank, lora_alpha=2 * rank))
    blob = dumps(adapter)
    spec, adapter_bytes = spec_of(blob), len(blob)
    storage = LocalStorage(tmp / "storage")
    refs: list[ObjectRef] = []
    for i in range(k):
        tensors = {name: t + torch.randn_like(t) * 0.01 for name, t in adapter.items()}
        refs.append(await storage.put_bytes(f"contrib/{i}.safetensors", dumps(tensors)))
    del adapter, blob, tensors
    peaks = []
    for _ in range(rounds):
        gc.collect()
        base = rss_bytes()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
        strategy = create("federated_averaging")
        strategy.begin(spec, UpdateFormat.FULL)
        for i, ref in enumerate(refs):
            data = await storage.verified_bytes(ref)
            strategy.accept(Contribution(loads(data, copy=False), 10 + i, {"loss": 1.0}))
            del data
        result = strategy.finish()
        peaks.append(rss_bytes("VmHWM") - base)
        del result, strategy
    print(f"aggregator: adapter of a {layers}-layer, {hidden}-wide llama at r={rank}: {adapter_bytes / 1e6:.1f} MB; "
          f"K={k}; peak extra memory per round {max(peaks) / 1e6:.1f} MB = {max(peaks) / adapter_bytes:.2f}x the "
          f"adapter (worst of {rounds} rounds)")
    return {"hidden": hidden, "layers": layers, "rank": rank, "k": k, "adapter_bytes": adapter_bytes,
            "peak_extra_memory_bytes": max(peaks), "peak_over_adapter": round(max(peaks) / adapter_bytes, 3)}


def main() -> None:
    """Both measurements, in temporary folders."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rank", type=int, default=64)
    add_json_argument(parser, "llm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        memory = asyncio.run(aggregator_memory(Path(tmp), args.hidden, args.layers, args.rank))
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        traffic = asyncio.run(bytes_per_round(Path(tmp), args.rounds))
    record("llm", args.json, {"aggregator_memory": memory, "bytes_per_round": traffic},
           reference="the adapter's size (2 x the adapter for a round's download and upload)")


if __name__ == "__main__":
    main()
