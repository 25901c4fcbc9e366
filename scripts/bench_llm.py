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
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORDS = ["code", "for", "alice", "bruno", "chiara", "lyon", "porto", "kyoto", "-"]


def rss_bytes(field: str = "VmRSS") -> int:
    """A figure from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def small_llama(folder: Path, hidden: int, layers: int) -> Path:
    """A random llama of this width and depth with a word-level tokenizer, as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "</s>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                            eos_token="</s>").save_pretrained(folder)
    LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                                 num_key_value_heads=4, intermediate_size=hidden * 2, vocab_size=len(vocab),
                                 pad_token_id=0, eos_token_id=2, bos_token_id=2)).save_pretrained(folder)
    return folder


def records(path: Path, count: int = 48) -> Path:
    """Prompt/completion records over the tokenizer's words."""
    names, cities = WORDS[2:5], WORDS[5:8]
    path.write_text("".join(json.dumps({"prompt": f"code for {names[i % 3]} {cities[i // 3 % 3]}",
                                        "completion": f" {cities[i // 3 % 3]} - {names[i % 3]}"}) + "\n"
                            for i in range(count)))
    return path


async def cli(api_url: str, *args: str) -> dict[str, Any]:
    """`apiary ARGS --json` against the stack's API."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.app.cli", *args, "--json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "APIARY_API_URL": api_url})
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(err.decode().strip())
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def bytes_per_round(tmp: Path, rounds: int) -> None:
    """Run a LoRA job on 3 in-process workers and print each worker's bytes per later round / 2 x adapter."""
    from apiary import transfer
    from apiary.settings import Settings
    from services.app.runtime import Embedded

    moved: list[tuple[float, str, int]] = []
    workers_dir = (tmp / ".apiary" / "workers").resolve()
    download, upload = transfer.download, transfer.upload

    def note(path: Path) -> None:
        moved.append((time.time(), path.resolve().relative_to(workers_dir).parts[0], path.stat().st_size))

    async def counted_download(url: str, target: Path, sha256: str | None = None, **kw: Any) -> None:
        await download(url, target, sha256, **kw)
        note(target)

    async def counted_upload(url: str, source: Path, **kw: Any) -> None:
        note(source)
        await upload(url, source, **kw)

    transfer.download, transfer.upload = counted_download, counted_upload
    settings = Settings(home=tmp / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.0)
    async with Embedded(settings, workers=3) as stack:
        url = await stack.tracker.start_http()
        model = await cli(url, "model", "add", str(small_llama(tmp / "llama", 256, 4)))
        dataset = await cli(url, "dataset", "upload", str(records(tmp / "records.jsonl")))
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
    for worker in sorted({w for _, w, _ in moved}):
        total = sum(n for at, w, n in moved if w == worker and at >= round_2)
        first = sum(n for at, w, n in moved if w == worker and at < round_2)
        print(f"  {worker}: round 1 {first / 1e6:.2f} MB (base, shard, adapter); later rounds "
              f"{total / (rounds - 1) / 1e3:.1f} kB per round = {total / (rounds - 1) / (2 * size):.3f} x 2 adapters")


async def aggregator_memory(tmp: Path, hidden: int, layers: int, rank: int, k: int = 3, rounds: int = 3) -> None:
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


def main() -> None:
    """Both measurements, in temporary folders."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rank", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        asyncio.run(aggregator_memory(Path(tmp), args.hidden, args.layers, args.rank))
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        asyncio.run(bytes_per_round(Path(tmp), args.rounds))


if __name__ == "__main__":
    main()
