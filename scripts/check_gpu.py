"""Check Apiary's GPU path on a machine with NVIDIA GPUs (the test suite runs without one).

    python examples/digits/prepare.py && python scripts/check_gpu.py [--workers 3] [--only llm|digits]

1. NVML readings of every GPU this process may use (name, utilisation, memory).
2. A training function that returns its weights on the GPU: Apiary stores them as CPU tensors, unchanged.
3. The digits job on the embedded stack with the workers spread over the GPUs (`apiary run --gpus auto`):
   it completes with held-out accuracy >= 0.9, every shard trained on `cuda:0` of its worker's child with
   only that worker's GPU visible, and the workers' live GPU readings reached the tracker while the job
   ran or just after (on the GPU each worker was given, with the memory its own training process holds).
4. The same job on the CPU (`--gpus none`), for the wall-time ratio.
5. `apiary worker --gpu N` for a GPU that is not there: one clear line, no traceback.
6. The built-in causal-LM trainer (a job without an entrypoint) on the embedded stack, 2 workers on the GPUs,
   LoRA on tiny_llm's random llama (built from a config, nothing downloaded): with `mixed_precision: bf16` it
   completes with val_loss lower at the last round than at the first, and each worker's training child holds
   memory on its GPU (NVML, by the child's pid) while no worker says it fell back to the CPU; with `fp16`
   (which the trainer refuses on a CPU) it completes too. Each says whether the heartbeats' per-process GPU
   reading (the dashboard's) followed that child (`heartbeat_reads_training_child`, part of `ok` on a GPU).
7. A real GPU out of memory in that trainer (a 512 x 1024-token batch through a 2^19-word vocabulary: the
   logits alone need about 550 GB) fails the job in one line naming batch_size and max_seq_length.

`--only llm` runs 1 and 6-7, `--only digits` 1-5. `--cpu` runs 6-7 on the CPU to debug them without a GPU
(fp16 is then expected to be refused, and the oversized batch to fail in one line from the CPU's allocator).
Prints one JSON object; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROBE = '''
import os, torch

def fl_train_model(payload, out_dir, logger=None):
    device = torch.device(payload["device"])
    weights = {k: (v.to(device) * 2 + 1) for k, v in payload["initial_weights"].items()}
    return {"weights": weights, "samples": 3,
            "metrics": {"on_gpu": float(all(t.is_cuda for t in weights.values())),
                        "visible": float(torch.cuda.device_count())}}
'''


def check_readings() -> dict[str, Any]:
    from services.worker.gpu import choose_gpu, gpu_stats, usable_gpus

    count = usable_gpus()
    readings = [gpu_stats(choose_gpu(i)) for i in range(count)]
    ok = count > 0 and all(r and r["memory_total"] > 0 and r["name"] for r in readings)
    return {"ok": ok, "gpus": count, "readings": readings}


async def check_gpu_weights(tmp: Path) -> dict[str, Any]:
    import torch

    from apiary import weights as w
    from apiary.trainers import TrainCall, UserCodeRunner
    from services.worker.gpu import choose_gpu

    (tmp / "gpu_probe.py").write_text(PROBE)
    initial = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    (tmp / "w.safetensors").write_bytes(w.dumps(initial))
    gpu = choose_gpu(0)
    assert gpu is not None
    runner = UserCodeRunner([str(tmp)], environment=gpu.child_environment())
    call = TrainCall(module="gpu_probe", function="fl_train_model", weights_path=str(tmp / "w.safetensors"),
                     result_path=str(tmp / "out.safetensors"), out_dir=str(tmp / "out"), env={}, dataset={},
                     round={"index": 1, "total": 1}, job={"id": "probe", "name": "probe"})
    try:
        result = await runner.train(call, timeout=120)
    finally:
        await runner.stop()
    back = w.loads((tmp / "out.safetensors").read_bytes())
    same = all(torch.equal(back[k], initial[k] * 2 + 1) and back[k].dtype == initial[k].dtype for k in initial)
    ok = result.metrics == {"on_gpu": 1.0, "visible": 1.0} and result.samples == 3 and same
    return {"ok": ok, "metrics": result.metrics, "weights_equal_on_cpu": same}


def _train_logs(storage: Path) -> list[dict[str, Any]]:
    """Every shard's train_log.json, from the run files the workers uploaded."""
    logs = []
    for path in storage.rglob("*"):
        if path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                if "train_log.json" in zf.namelist():
                    logs.append(json.loads(zf.read("train_log.json")))
    return logs


def _keep_highest(seen: dict[str, dict[str, Any]], worker_id: str, g: dict[str, Any]) -> None:
    """Fold one GPU reading of a worker into its highest memory and utilisation so far."""
    best = seen.setdefault(worker_id, {**g, "max_memory_used": 0, "max_util": 0.0, "max_process_memory_used": 0})
    best["max_memory_used"] = max(best["max_memory_used"], g["memory_used"])
    best["max_process_memory_used"] = max(best["max_process_memory_used"], g.get("process_memory_used") or 0)
    best["max_util"] = max(best["max_util"], g["utilization"])


async def _watch_readings(stack: Any, seen: dict[str, dict[str, Any]]) -> None:
    """The workers' GPU readings as the tracker holds them (their heartbeats'), highest per worker, until cancelled."""
    from services.tracker.views import workers_view

    while True:
        for view in await workers_view(stack.ports.db):
            if view["gpu"] is not None:
                _keep_highest(seen, view["worker_id"], view["gpu"])
        await asyncio.sleep(0.1)


# The digits job trains for a few seconds: at the default 5 s a worker may beat once while it trains, before its
# child first touched the GPU (the children of the workers that did not run the init task start torch and CUDA at
# their first shard). Its workers beat every DIGITS_BEAT s, and the readings are watched for two more beats and
# the tracker's next write of them (services.tracker.beats.WRITE_EVERY) after the job ends, while each worker's
# training child, kept warm, still holds its memory.
DIGITS_BEAT = 0.5


async def run_digits(home: Path, workers: int, gpus: list[int]) -> dict[str, Any]:
    from apiary.settings import Settings
    from services.app.jobfile import load_job_file
    from services.app.runtime import Embedded
    from services.tracker.beats import WRITE_EVERY

    request = load_job_file(ROOT / "examples/digits/job.yaml")
    settings = Settings(home=home, heartbeat_interval=DIGITS_BEAT)
    seen: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    async with Embedded(settings, workers=workers, code_paths=[str(ROOT)], gpus=gpus) as stack:
        watcher = asyncio.create_task(_watch_readings(stack, seen))
        try:
            job_id = await stack.submit(request)
            view = await stack.wait(job_id, timeout=600)
            wall = time.monotonic() - started
            await asyncio.sleep(2 * DIGITS_BEAT + WRITE_EVERY)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    logs = _train_logs(home / "storage")
    return {"status": view["status"], "reason": view.get("reason"), "metrics": view.get("metrics"),
            "wall_s": round(wall, 2), "devices": sorted({log["device"] for log in logs}), "shards": len(logs),
            "gpu_readings": seen}


LLM_WORKERS = 2
# The out-of-memory job's batch: batch_size x max_seq_length tokens through a 2^19-word vocabulary. The logits
# alone are 512 x 1024 x 2^19 bfloat16 values (550 GB, about 4x an H200's memory); everything before them (two
# 32-wide layers) is small and quick, so the job fails at its first forward pass.
OOM_BATCH, OOM_SEQ, OOM_VOCAB = 512, 1024, 1 << 19
# On a CPU (--cpu) a 68 GB batch of logits: more than the machine's memory, refused at once rather than swapped.
CPU_OOM_BATCH, CPU_OOM_SEQ = 128, 512
FELL_BACK = "training runs on the CPU"  # a training child's warning when it cannot use its worker's GPU


class _Warnings(logging.Handler):
    """The warnings Apiary's loggers give (a training child's fallback to the CPU among them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the warning's text."""
        self.lines.append(record.getMessage())


def _llama(folder: Path, vocab: int | None = None, positions: int | None = None) -> Path:
    """tiny_llm's random llama and tokenizer saved in `folder`; with `vocab`, a (tied) vocabulary that wide, far
    wider than its tokenizer's, and `positions` long sequences."""
    from tests.fixtures import tiny_llm

    if vocab is None:
        return tiny_llm.save_model(folder)
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_llm.tokenizer()
    config = tiny_llm.llama_config(vocab)
    config.max_position_embeddings = positions or config.max_position_embeddings
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    """The records written to `path` as JSONL."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _long_texts(count: int, words: int) -> list[dict[str, Any]]:
    """`count` text records of `words` of tiny_llm's words each (every one at least that many tokens)."""
    from tests.fixtures import tiny_llm

    text = " ".join(tiny_llm.WORDS[i % len(tiny_llm.WORDS)] for i in range(words))
    return [{"text": text} for _ in range(count)]


def _llm_request(name: str, model_id: Any, dataset_id: Any, config: dict[str, Any],
                 **distributed: Any) -> dict[str, Any]:
    """A LoRA job of the built-in trainer (no entrypoint) on 2 workers; keyword arguments override `distributed`."""
    return {"name": name, "model_id": model_id, "dataset_id": dataset_id,
            "config": {"epochs": 1, "batch_size": 4, "learning_rate": 1e-2, "lora_r": 8, "lora_alpha": 16,
                       "max_seq_length": 32, "validation_split": 0.25, **config},
            "distributed": {"num_rounds": 3, "steps_per_round": 8, "min_workers": LLM_WORKERS,
                            "max_workers": LLM_WORKERS, "aggregation_timeout": 300, "fault_tolerance": 0,
                            **distributed}}


async def _run_llm_job(stack: Any, request: dict[str, Any], warnings: _Warnings) -> dict[str, Any]:
    """Run one built-in job: its outcome, each round's losses, the warnings given meanwhile, and two sets of GPU
    readings taken while it ran: the workers' heartbeats' (as the tracker holds them) and NVML's of each
    worker's built-in training child, by its pid (the process that trains a job without an entrypoint)."""
    from apiary.trainers import BUILT_IN
    from services.worker.gpu import gpu_stats

    reported: dict[str, dict[str, Any]] = {}
    children: dict[str, dict[str, Any]] = {}
    first_warning = len(warnings.lines)

    async def watch_children() -> None:
        while True:
            for worker in stack.workers:
                trainer = worker._trainers.get(BUILT_IN)
                pid = trainer.pid if trainer is not None else None
                g = gpu_stats(worker.gpu, pid) if pid is not None else None
                if g is not None:
                    child = children.setdefault(worker.worker_id, {"index": g["index"], "name": g["name"],
                                                                   "pid": pid, "max_process_memory_used": None})
                    if g["process_memory_used"] is not None:
                        child["max_process_memory_used"] = max(child["max_process_memory_used"] or 0,
                                                               g["process_memory_used"])
            await asyncio.sleep(0.2)

    watchers = [asyncio.create_task(_watch_readings(stack, reported)), asyncio.create_task(watch_children())]
    started = time.monotonic()
    try:
        view = await stack.wait(await stack.submit(request), timeout=300)
    finally:
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    rounds = sorted((r for r in view.get("rounds") or [] if r["round"] >= 1), key=lambda r: r["round"])
    return {"status": view["status"], "reason": view.get("reason"), "wall_s": round(time.monotonic() - started, 2),
            "rounds": [r["status"] for r in rounds], "loss": [r["metrics"].get("loss") for r in rounds],
            "val_loss": [r["metrics"].get("val_loss") for r in rounds],
            "warnings": warnings.lines[first_warning:][-5:],
            # A training child warns once, at its first call: a fallback counts for the stack's later jobs too.
            "fell_back_to_cpu": any(FELL_BACK in line for line in warnings.lines),
            "training_child_gpu": children, "reported_gpu": reported}


def _device(part: dict[str, Any], workers: list[str], idle: dict[int, int]) -> tuple[str, str]:
    """Where a job trained, from its readings, and how that is known: `cuda:0` where NVML saw every worker's
    built-in training child hold memory on the worker's GPU (or, where NVML cannot tell a process's memory,
    every worker's GPU hold more than `idle`, its memory in use before the stack started), and no worker
    warned that it fell back to the CPU."""
    children = part["training_child_gpu"]
    if part["fell_back_to_cpu"]:
        return "cpu", "a worker warned that its training child fell back to the CPU"
    if set(children) != set(workers):
        return "cpu", f"NVML saw no built-in training child on a GPU for {sorted(set(workers) - set(children))}"
    held = [c["max_process_memory_used"] for c in children.values()]
    if all(m is not None and m > 0 for m in held):
        return "cuda:0", "NVML: every worker's built-in training child held memory on the worker's GPU"
    reported = [part["reported_gpu"].get(w) for w in workers]
    rose = all(r is not None and r["max_memory_used"] > idle.get(r["index"], r["memory_total"]) for r in reported)
    if all(m is None for m in held) and rose:
        return "cuda:0", "NVML cannot tell a process's memory here; every worker's GPU held more than when idle"
    return "cpu", "NVML saw the training children hold no memory on their GPUs"


async def run_llm(home: Path, gpus: list[int], cpu: bool) -> dict[str, dict[str, Any]]:
    """The built-in trainer's checks on one embedded stack of 2 workers: bf16, fp16 and a batch too large."""
    from apiary.registry import zip_folder
    from apiary.settings import Settings
    from services.app.runtime import Embedded
    from services.worker.gpu import choose_gpu, gpu_stats
    from tests.fixtures import tiny_llm

    idle = {i: g["memory_used"] for i in gpus if (g := gpu_stats(choose_gpu(i))) is not None}
    batch, seq = (CPU_OOM_BATCH, CPU_OOM_SEQ) if cpu else (OOM_BATCH, OOM_SEQ)
    small, wide = _llama(home / "tiny-llama"), _llama(home / "wide-llama", OOM_VOCAB, seq)
    records = _jsonl(home / "records.jsonl", tiny_llm.records(48))
    long = _jsonl(home / "long.jsonl", _long_texts(batch * LLM_WORKERS, seq + 1))
    warnings = _Warnings()
    logging.getLogger("apiary").addHandler(warnings)
    settings = Settings(home=home / ".apiary", heartbeat_interval=0.5, progress_interval=0.0)
    out: dict[str, dict[str, Any]] = {}
    async with Embedded(settings, workers=LLM_WORKERS, code_paths=[str(ROOT)], gpus=gpus) as stack:
        workers = [w.worker_id for w in stack.workers]
        model = await stack.api.register("models", zip_folder(small, home / "tiny-llama.zip"), "tiny-llama")
        wide_model = await stack.api.register("models", zip_folder(wide, home / "wide-llama.zip"), "wide-llama")
        data = await stack.api.register("datasets", records, "records")
        long_data = await stack.api.register("datasets", long, "long")
        for precision in ("bf16", "fp16"):
            part = await _run_llm_job(stack, _llm_request(f"lora-{precision}", model["model_id"], data["dataset_id"],
                                                          {"mixed_precision": precision}), warnings)
            part["mixed_precision"], part["gpu_memory_idle"] = precision, idle
            part["device"], part["device_proof"] = _device(part, workers, idle)
            # Whether the heartbeats' per-process reading (the dashboard's) follows the built-in training child.
            part["heartbeat_reads_training_child"] = bool(part["reported_gpu"]) and all(
                r["max_process_memory_used"] > 0 for r in part["reported_gpu"].values())
            val = part["val_loss"]
            part["val_loss_decreased"] = len(val) > 1 and None not in val and val[-1] < val[0]
            out[f"llm_{precision}"] = part
        oom: dict[str, Any] = {"batch_size": batch, "max_seq_length": seq, "vocab_size": OOM_VOCAB,
                               "mixed_precision": "bf16", "logits_bytes": batch * seq * OOM_VOCAB * 2}
        oom.update(await _run_llm_job(stack, _llm_request(
            "lora-oom", wide_model["model_id"], long_data["dataset_id"],
            {"mixed_precision": "bf16", "batch_size": batch, "max_seq_length": seq, "validation_split": 0.0},
            num_rounds=1, steps_per_round=1), warnings))
        out["llm_oom"] = oom
    logging.getLogger("apiary").removeHandler(warnings)
    bf16, fp16 = out["llm_bf16"], out["llm_fp16"]
    reason = oom["reason"] or ""
    if cpu:  # the CPU's expectations: fp16 refused, the batch refused by the allocator
        bf16["ok"] = bf16["status"] == "completed" and bf16["val_loss_decreased"]
        refused = "fp16 is not supported on this worker's CPU"
        fp16["ok"] = fp16["status"] == "failed" and refused in (fp16["reason"] or "")
        oom["ok"] = oom["status"] == "failed" and "\n" not in reason
        return out
    said = f"out of GPU memory on cuda:0 (batch_size {batch}, max_seq_length {seq}): lower them or use a larger GPU"
    bf16["ok"] = (bf16["status"] == "completed" and bf16["val_loss_decreased"] and bf16["device"] == "cuda:0"
                  and bf16["heartbeat_reads_training_child"])
    fp16["ok"] = (fp16["status"] == "completed" and fp16["device"] == "cuda:0"  # on a CPU it would be refused
                  and fp16["heartbeat_reads_training_child"])
    oom["ok"] = oom["status"] == "failed" and "\n" not in reason and said in reason
    return out


def check_cli_refuses_missing_gpu(count: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "services.app.cli", "worker", "--gpu", str(count + 7)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    text = (proc.stdout + proc.stderr).strip()
    ok = proc.returncode != 0 and f"--gpu {count + 7}: no such GPU here" in text and "Traceback" not in text
    return {"ok": ok, "output": text[-300:]}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="the digits job's workers")
    parser.add_argument("--only", choices=["llm", "digits"], help="the built-in trainer's checks alone, or the others")
    parser.add_argument("--cpu", action="store_true", help="the built-in trainer's checks on the CPU (no GPU needed)")
    args = parser.parse_args()
    from apiary.trainers import quiet_openmp

    quiet_openmp()
    report: dict[str, Any] = {}
    if args.cpu:
        report["mode"] = "cpu: the built-in trainer's checks with CUDA_VISIBLE_DEVICES='' (no GPU used)"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as `apiary run --gpus none`: the children see no GPU
        with tempfile.TemporaryDirectory() as tmp:
            report.update(await run_llm(Path(tmp), [], cpu=True))
        return _print(report)
    report["readings"] = check_readings()
    count = report["readings"]["gpus"]
    gpus = list(range(count))
    if count == 0:
        report["error"] = "no GPU: NVML finds no NVIDIA driver or GPU here (--cpu runs the LLM checks on the CPU)"
        return _print(report)
    if args.only != "digits":
        with tempfile.TemporaryDirectory() as tmp:
            report.update(await run_llm(Path(tmp), gpus, cpu=False))
    if args.only == "llm":
        return _print(report)
    with tempfile.TemporaryDirectory() as tmp:
        report["weights_on_gpu"] = await check_gpu_weights(Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        gpu = await run_digits(Path(tmp), args.workers, gpus)
    assigned = {f"worker-{i + 1}": gpus[i % len(gpus)] for i in range(args.workers)} if gpus else {}
    gpu["ok"] = (
        gpu["status"] == "completed" and (gpu["metrics"] or {}).get("accuracy", 0) >= 0.9
        and gpu["devices"] == ["cuda:0"] and gpu["shards"] > 0
        and set(gpu["gpu_readings"]) == set(assigned)
        and all(r["index"] == assigned[w] and 0 < r["max_process_memory_used"] <= r["max_memory_used"]
                for w, r in gpu["gpu_readings"].items())
    )
    report["digits_gpu"] = gpu
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as `apiary run --gpus none`
    with tempfile.TemporaryDirectory() as tmp:
        cpu = await run_digits(Path(tmp), args.workers, [])
    del os.environ["CUDA_VISIBLE_DEVICES"]
    cpu["ok"] = cpu["status"] == "completed" and cpu["devices"] == ["cpu"] and not cpu["gpu_readings"]
    report["digits_cpu"] = cpu
    report["wall_gpu_over_cpu"] = round(gpu["wall_s"] / cpu["wall_s"], 3)
    report["cli_missing_gpu"] = check_cli_refuses_missing_gpu(count)
    return _print(report)


def _print(report: dict[str, Any]) -> int:
    """Print the report with the names of the checks that failed; 1 if any did (or an error stopped them)."""
    failed = [name for name, part in report.items() if isinstance(part, dict) and not part.get("ok", True)]
    report["failed"] = failed
    print(json.dumps(report, indent=2, default=str))
    return 1 if failed or "error" in report else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
