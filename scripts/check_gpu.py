"""Check Apiary's GPU path on a machine with NVIDIA GPUs (the test suite runs without one).

    python examples/digits/prepare.py && python scripts/check_gpu.py [--workers 3]

1. NVML readings of every GPU this process may use (name, utilisation, memory).
2. A training function that returns its weights on the GPU: Apiary stores them as CPU tensors, unchanged.
3. The digits job on the embedded stack with the workers spread over the GPUs (`apiary run --gpus auto`):
   it completes with held-out accuracy >= 0.9, every shard trained on `cuda:0` of its worker's child with
   only that worker's GPU visible, and the workers' live GPU readings reached the tracker while the job
   ran (on the GPU each worker was given, with the memory its own training process holds).
4. The same job on the CPU (`--gpus none`), for the wall-time ratio.
5. `apiary worker --gpu N` for a GPU that is not there: one clear line, no traceback.

Prints one JSON object; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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


async def run_digits(home: Path, workers: int, gpus: list[int]) -> dict[str, Any]:
    from apiary.settings import Settings
    from services.app.jobfile import load_job_file
    from services.app.runtime import Embedded
    from services.tracker.views import workers_view

    request = load_job_file(ROOT / "examples/digits/job.yaml")
    settings = Settings(home=home)
    seen: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    async with Embedded(settings, workers=workers, code_paths=[str(ROOT)], gpus=gpus) as stack:

        async def watch() -> None:
            while True:
                for view in await workers_view(stack.ports.db):
                    g = view["gpu"]
                    if g is not None:
                        best = seen.setdefault(view["worker_id"], {**g, "max_memory_used": 0, "max_util": 0.0,
                                                                   "max_process_memory_used": 0})
                        best["max_memory_used"] = max(best["max_memory_used"], g["memory_used"])
                        best["max_process_memory_used"] = max(best["max_process_memory_used"],
                                                              g.get("process_memory_used") or 0)
                        best["max_util"] = max(best["max_util"], g["utilization"])
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        try:
            job_id = await stack.submit(request)
            view = await stack.wait(job_id, timeout=600)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    wall = time.monotonic() - started
    logs = _train_logs(home / "storage")
    return {"status": view["status"], "reason": view.get("reason"), "metrics": view.get("metrics"),
            "wall_s": round(wall, 2), "devices": sorted({log["device"] for log in logs}), "shards": len(logs),
            "gpu_readings": seen}


def check_cli_refuses_missing_gpu(count: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "services.app.cli", "worker", "--gpu", str(count + 7)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    text = (proc.stdout + proc.stderr).strip()
    ok = proc.returncode != 0 and f"--gpu {count + 7}: no such GPU here" in text and "Traceback" not in text
    return {"ok": ok, "output": text[-300:]}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    from apiary.trainers import quiet_openmp

    quiet_openmp()
    report: dict[str, Any] = {"readings": check_readings()}
    count = report["readings"]["gpus"]
    with tempfile.TemporaryDirectory() as tmp:
        report["weights_on_gpu"] = await check_gpu_weights(Path(tmp))
    gpus = list(range(count))
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
    failed = [name for name, part in report.items() if isinstance(part, dict) and not part.get("ok", True)]
    report["failed"] = failed
    print(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
