"""Which GPU a worker trains on: `--gpu N` counts as CUDA counts, the training child sees only that GPU
as cuda:0, and readings come from the same physical GPU. Runs without a GPU; scripts/check_gpu.py runs
the same on a real one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.bus.memory import MemoryBus
from apiary.settings import Settings
from apiary.trainers import TrainCall
from apiary.weights import dumps
from services.worker import Worker
from services.worker.gpu import VISIBLE, GpuChoice, GpuChoiceError, choose_gpu, gpu_stats, usable_gpus

PROBE = '''
import json, os
from pathlib import Path

def fl_train_model(payload, out_dir, logger=None):
    seen = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    Path(out_dir, "seen.json").write_text(json.dumps({**seen, "device": payload["device"]}))
    return {"weights": payload["initial_weights"], "samples": 1}
'''


@pytest.mark.parametrize(
    ("index", "visible", "expected"),
    [
        (None, None, None),
        (0, None, "0"),
        (3, None, "3"),
        (1, "4,6", "6"),  # a batch system gave this process GPUs 4 and 6: --gpu 1 is physical GPU 6
        (0, "GPU-8f2e, GPU-11aa", "GPU-8f2e"),
        (1, "2,-1,3", None),  # CUDA stops at a negative entry: only GPU 2 is usable
        (0, "", None),
    ],
)
def test_gpu_index_counts_as_cuda_counts(index: int | None, visible: str | None, expected: str | None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    if visible is not None:
        monkeypatch.setenv(VISIBLE, visible)
    if index is not None and expected is None:
        with pytest.raises(GpuChoiceError, match=f"--gpu {index}: "):
            choose_gpu(index)
        return
    choice = choose_gpu(index)
    assert (choice.visible if choice else None) == expected


def test_the_child_sees_only_its_gpu_numbered_as_nvidia_smi_does() -> None:
    assert GpuChoice(1, "6").child_environment() == {VISIBLE: "6", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_a_negative_index_is_refused() -> None:
    with pytest.raises(GpuChoiceError, match="0 or more"):
        choose_gpu(-1)


def test_there_are_readings_for_each_usable_gpu_and_none_past_them() -> None:
    # Execute: every GPU this process may use (none on a machine without one), and one more.
    count = usable_gpus()
    readings = [gpu_stats(choose_gpu(i)) for i in range(count + 1)]

    # Assert: a real reading for each usable GPU; past them nothing, never a made-up figure.
    assert all(r is not None and r["memory_total"] > 0 and r["name"] for r in readings[:count])
    assert readings[count] is None


@pytest.fixture
def probe_call(tmp_path: Path) -> TrainCall:
    (tmp_path / "gpu_probe.py").write_text(PROBE)
    (tmp_path / "w.safetensors").write_bytes(dumps({}))
    return TrainCall(module="gpu_probe", function="fl_train_model", weights_path=str(tmp_path / "w.safetensors"),
                     result_path=str(tmp_path / "result.safetensors"), out_dir=str(tmp_path / "out"), env={},
                     dataset={}, round={"index": 1, "total": 1}, job={"id": "j", "name": "gpu"})


async def _seen(worker: Worker, call: TrainCall) -> dict[str, str | None]:
    try:
        await worker.runner.train(call, timeout=60)
    finally:
        await worker.runner.stop()
    return json.loads(Path(call.out_dir, "seen.json").read_text())


async def test_a_worker_given_a_gpu_trains_with_only_that_gpu_visible(
    probe_call: TrainCall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: this process may use physical GPUs 4 and 6; the worker is given the second.
    monkeypatch.setenv(VISIBLE, "4,6")
    settings = Settings(home=tmp_path, gpu=1, code_path=[str(tmp_path)])

    # Execute
    seen = await _seen(Worker(MemoryBus(), settings, worker_id="w"), probe_call)

    # Assert: GPU 6 alone is visible to the child. There is no GPU 6 here (nor CUDA), so the child
    # trains on the CPU and says so; on a GPU machine it is cuda:0 (scripts/check_gpu.py).
    assert seen == {VISIBLE: "6", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "device": "cpu"}
    assert any(r.levelname == "WARNING" and "worker was given GPU 6, but" in r.getMessage()
               and r.getMessage().endswith("training runs on the CPU") for r in caplog.records)


async def test_a_worker_without_a_gpu_leaves_the_environment_alone(
    probe_call: TrainCall, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VISIBLE, raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    settings = Settings(home=tmp_path, code_path=[str(tmp_path)])

    seen = await _seen(Worker(MemoryBus(), settings, worker_id="w"), probe_call)

    import torch

    assert seen == {VISIBLE: None, "CUDA_DEVICE_ORDER": None,
                    "device": "cuda:0" if torch.cuda.is_available() else "cpu"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.app.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_asking_for_a_gpu_the_machine_lacks_is_one_clear_line(tmp_path: Path) -> None:
    # Prepare: the first index past this machine's GPUs (0 where it has none).
    missing = usable_gpus()
    why = "NVML finds no NVIDIA driver or GPU" if missing == 0 else f"it may use {missing}"

    # Execute
    worker = _cli("worker", "--gpu", str(missing))
    run = _cli("run", "examples/digits/job.yaml", "--gpus", str(missing))

    # Assert
    assert worker.returncode != 0 and run.returncode != 0
    assert worker.stderr.strip() == f"error: --gpu {missing}: no such GPU here ({why})"
    assert run.stderr.strip() == f"error: --gpus {missing}: no such GPU here ({why})"


class _Proc:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


class _Nvml:
    """NVML's process list, as a GPU shared by several workers' training processes shows it."""

    def __init__(self, processes: list[_Proc]) -> None:
        self.processes = processes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[_Proc]:
        return self.processes


def test_a_workers_own_gpu_memory_is_that_of_its_training_process() -> None:
    import os

    from services.worker.gpu import _process_memory

    mine, other = os.getpid(), 1  # pids that exist here: this process stands for the training child
    shared = _Nvml([_Proc(other, 3 * 2**30), _Proc(mine, 2**30)])

    assert _process_memory(shared, None, mine) == 2**30
    assert _process_memory(_Nvml([_Proc(other, 3 * 2**30)]), None, mine) == 0  # not on the GPU (yet)
    assert _process_memory(_Nvml([]), None, mine) == 0
    assert _process_memory(_Nvml([_Proc(mine, None)]), None, mine) is None  # NVML withholds the figure
    assert _process_memory(shared, None, None) is None  # no training process
    # NVML lists another pid namespace's processes (a container seeing the host's): unknown, not 0.
    assert _process_memory(_Nvml([_Proc(4_000_000, 2**30)]), None, mine) is None
