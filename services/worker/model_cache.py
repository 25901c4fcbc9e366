"""Base models on this worker: each downloaded once, checked, kept across jobs under its sha256 (an HF
zip unpacked once, its files read-only), and the least recently used dropped when the cache outgrows
its limit. Workers of one machine may share the folder (`APIARY_MODEL_CACHE`; `apiary run`'s workers do):
a lock file in it lets one of them download a model while the others wait for it and reuse it."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path

from apiary import transfer
from apiary.contracts import ModelRef
from apiary.dataset import extract_shard
from apiary.filelock import exclusive_async

LOCK = ".lock"  # held by the worker that fills or cleans the folder
READY = ".ready"  # written last: an entry without it is incomplete; its mtime is when it was last used
HF_FOLDER = "model"


class ModelCache:
    """A folder of base models keyed by sha256, cleaned least recently used first past `limit` bytes."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self._lock = asyncio.Lock()

    async def fetch(self, ref: ModelRef, *, deadline: float | None = None) -> tuple[Path, int]:
        """The model's path here (a model folder or its single file), and the bytes downloaded for it."""
        async with self._lock, exclusive_async(self.root / LOCK):
            entry = self.root / ref.sha256
            moved = 0
            if not (entry / READY).is_file():
                moved = await self._download(ref, entry, deadline)
            (entry / READY).touch()
            await asyncio.to_thread(self.clean, keep=entry)
            return model_path(ref, entry), moved

    async def _download(self, ref: ModelRef, entry: Path, deadline: float | None) -> int:
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        if ref.format == "hf":
            archive = entry / "model.zip"
            await transfer.download(ref.url, archive, ref.sha256, deadline=deadline)
            await asyncio.to_thread(extract_shard, archive, entry / HF_FOLDER)
            archive.unlink()
        else:
            await transfer.download(ref.url, entry / ref.filename, ref.sha256, deadline=deadline)
        # Jobs share the files: none may change them.
        for path in entry.rglob("*"):
            if path.is_file():
                path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        return ref.size

    def clean(self, keep: Path) -> None:
        """Drop the least recently used models (never `keep`) until the cache fits its limit."""
        entries = [e for e in self.root.iterdir() if e.is_dir()] if self.root.is_dir() else []
        sizes = {e: _size(e) for e in entries}
        total = sum(sizes.values())
        for entry in sorted(entries, key=_last_used):
            if total <= self.limit:
                return
            if entry != keep:
                shutil.rmtree(entry, ignore_errors=True)
                total -= sizes[entry]


def model_path(ref: ModelRef, entry: Path) -> Path:
    """Where the trainer finds the model: the unpacked folder (or the one folder it holds), else the file."""
    if ref.format != "hf":
        return entry / ref.filename
    folder = entry / HF_FOLDER
    inner = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if not (folder / "config.json").is_file() and len(inner) == 1 and inner[0].is_dir():
        return inner[0]
    return folder


def _last_used(entry: Path) -> float:
    ready = entry / READY
    return ready.stat().st_mtime if ready.is_file() else 0.0


def _size(entry: Path) -> int:
    return sum(os.path.getsize(p) for p in entry.rglob("*") if p.is_file())
