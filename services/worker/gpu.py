"""GPU readings through NVIDIA's management library; absent (None), never faked, without a GPU."""

from __future__ import annotations

from typing import Any


def gpu_stats(index: int | None) -> dict[str, Any] | None:
    """Utilisation and memory of one GPU, or None where NVML or the GPU is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index or 0)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return {
            "index": index or 0,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "utilization": float(util.gpu),
            "memory_used": int(memory.used),
            "memory_total": int(memory.total),
        }
    except Exception:  # NVML raises its own error types when no driver or device is present
        return None
