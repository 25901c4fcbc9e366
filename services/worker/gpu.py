"""Which GPU a worker trains on, and readings of it through NVIDIA's management library (NVML);
readings are absent (None), never faked, without a GPU.

`--gpu INDEX` counts the GPUs this process may use, as CUDA does: every GPU of the machine, or those
CUDA_VISIBLE_DEVICES lists (a container's, a batch system's). The training child sees only the chosen
one, as `cuda:0`; NVML, which ignores CUDA_VISIBLE_DEVICES, is pointed at the same physical GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

VISIBLE = "CUDA_VISIBLE_DEVICES"


class GpuChoiceError(ValueError):
    """`--gpu` names a GPU this process may not use."""


@dataclass(frozen=True)
class GpuChoice:
    """One GPU: how the training child's environment names it, and how NVML finds it."""

    index: int  # as given to --gpu
    visible: str  # the CUDA_VISIBLE_DEVICES entry for the child (a physical index or a UUID)

    def child_environment(self) -> dict[str, str]:
        """What the training child runs with: only this GPU, numbered as nvidia-smi numbers it."""
        return {VISIBLE: self.visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def choose_gpu(index: int | None, visible: str | None = None, option: str = "--gpu") -> GpuChoice | None:
    """The GPU `--gpu index` means under this CUDA_VISIBLE_DEVICES (None: the process's own); errors
    name the command-line `option` that gave the index."""
    if index is None:
        return None
    if index < 0:
        raise GpuChoiceError(f"{option} {index}: a GPU index is 0 or more")
    entries = _visible_entries(visible)
    if entries is None:
        return GpuChoice(index, str(index))
    if index >= len(entries):
        shown = os.environ.get(VISIBLE) if visible is None else visible
        raise GpuChoiceError(f"{option} {index}: {VISIBLE}={shown!r} lets this process use {len(entries)} GPU(s)")
    return GpuChoice(index, entries[index])


def _handle(pynvml: Any, choice: GpuChoice | None) -> Any:
    entry = choice.visible if choice is not None else _first_visible()
    if entry is None:
        return None
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def _visible_entries(visible: str | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's GPUs (CUDA stops at the first negative entry); None where it is unset."""
    visible = os.environ.get(VISIBLE) if visible is None else visible
    if visible is None:
        return None
    entries = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def _first_visible() -> str | None:
    """The GPU an unpinned child trains on (CUDA's first visible one); None where CUDA may use none."""
    entries = _visible_entries()
    if entries is None:
        return "0"
    return entries[0] if entries else None


_nvml: list[Any] = []  # the initialised NVML module, or None where it cannot start; once per process


def _started_nvml() -> Any:
    if not _nvml:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml.append(pynvml)
        except Exception:  # no NVML library, no driver: no GPU (NVML raises its own error types)
            _nvml.append(None)
    return _nvml[0]


def usable_gpus() -> int:
    """How many GPUs this process may use: NVML's count (0 without a driver), or as many as
    CUDA_VISIBLE_DEVICES lists."""
    pynvml = _started_nvml()
    try:
        count = int(pynvml.nvmlDeviceGetCount()) if pynvml is not None else 0
    except Exception:  # NVML's own error types
        return 0
    entries = _visible_entries()
    return count if entries is None or count == 0 else len(entries)


def require_gpu(index: int, option: str = "--gpu") -> None:
    """Refuse an index that names no GPU this process can really use."""
    choose_gpu(index, option=option)
    count = usable_gpus()
    if index >= count:
        why = "NVML finds no NVIDIA driver or GPU" if count == 0 else f"it may use {count}"
        raise GpuChoiceError(f"{option} {index}: no such GPU here ({why})")


def _process_memory(pynvml: Any, handle: Any, pid: int | None) -> int | None:
    """GPU memory one process holds on this GPU: 0 if it holds none, None where NVML cannot tell (no
    pid given, or a container whose pids NVML does not see)."""
    if pid is None:
        return None
    try:
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # NVML's own error types: not supported here
        return None
    used = [p.usedGpuMemory for p in processes if p.pid == pid]
    if used:
        return int(used[0]) if isinstance(used[0], int) else None  # None: NVML withholds it here
    # Not listed: it holds none, unless NVML lists another pid namespace's processes (a container's
    # view of the host), where no listed process is one of ours and absence says nothing.
    seen_here = not processes or any(os.path.exists(f"/proc/{p.pid}") for p in processes)
    return 0 if seen_here else None


def gpu_stats(choice: GpuChoice | None, pid: int | None = None) -> dict[str, Any] | None:
    """Utilisation and memory of the worker's GPU (the first visible one where none was chosen), and
    the memory the process `pid` (the worker's training child) holds on it; None where NVML or the GPU
    is missing."""
    pynvml = _started_nvml()
    if pynvml is None:
        return None
    try:
        handle = _handle(pynvml, choice)
        if handle is None:
            return None
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return {
            "index": choice.index if choice is not None else 0,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "utilization": float(util.gpu),
            "memory_used": int(memory.used),
            "memory_total": int(memory.total),
            "process_memory_used": _process_memory(pynvml, handle, pid),
        }
    except Exception:  # NVML raises its own error types when no driver or device is present
        return None
