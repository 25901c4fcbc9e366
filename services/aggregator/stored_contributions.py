"""A closing round's accepted contributions read back from storage one tensor at a time, for strategies
that cannot fold as contributions arrive (median, trimmed mean, Krum): peak memory is K x one tensor."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from apiary.storage import Storage


class StoredRound:
    """The round's accepted contributions, each downloaded once to a file; `tensor` maps one name from each."""

    def __init__(self, paths: list[Path], samples: list[int]) -> None:
        self._paths, self._samples = paths, samples

    @classmethod
    async def download(cls, storage: Storage, accepted: list[dict[str, Any]], folder: Path) -> StoredRound:
        """Fetch each accepted contribution (rows in arrival order) into `folder`, checked against its row."""
        paths = []
        for index, row in enumerate(accepted):
            path = folder / f"contribution-{index:05d}.safetensors"
            await storage.get_file(row["result_key"], path)
            _check(path, row)
            paths.append(path)
        return cls(paths, [int(row["samples"]) for row in accepted])

    @property
    def samples(self) -> Sequence[int]:
        """Each contribution's sample count, in arrival order."""
        return self._samples

    def tensor(self, name: str) -> list[torch.Tensor]:
        """Tensor `name` of every contribution, in arrival order (read from its file alone)."""
        out = []
        for path in self._paths:
            with safe_open(str(path), framework="pt") as f:
                out.append(f.get_tensor(name))
        return out


def _check(path: Path, row: dict[str, Any]) -> None:
    """The file is the object the contribution's row names (its size and sha256), or ValueError."""
    # The contribution was checked when accepted; a later change of the object must not slip in silently.
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if path.stat().st_size != row["size"] or digest != row["sha256"]:
        raise ValueError(f"{row['result_key']}: stored contribution changed since it was accepted")
