"""A closing round's accepted contributions read back from storage one tensor at a time, for strategies
that cannot fold as contributions arrive (median, trimmed mean, Krum): peak memory is K x one tensor."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from apiary.storage import Storage
from apiary.weights import dumps
from apiary.wire_codec import file_is_encoded

# Turns an upload's bytes into the weights it stands for (apiary.wire_codec, through the round's global weights).
Decode = Callable[[bytes], Awaitable[Mapping[str, torch.Tensor]]]


class StoredRound:
    """The round's accepted contributions, each downloaded once to a file; `tensor` maps one name from each."""

    def __init__(self, paths: list[Path], samples: list[int]) -> None:
        self._paths, self._samples = paths, samples

    @classmethod
    async def download(cls, storage: Storage, accepted: list[dict[str, Any]], folder: Path,
                       decode: Decode | None = None) -> StoredRound:
        """Fetch each accepted contribution (rows in arrival order) into `folder`, checked against its row; one
        encoded for the wire (`distributed.transfer`) rewritten there as the full-precision weights `decode` makes
        of it."""
        paths = []
        for index, row in enumerate(accepted):
            path = folder / f"contribution-{index:05d}.safetensors"
            await storage.get_file(row["result_key"], path)
            _check(path, row)
            if decode is not None:
                await _decoded(path, decode)
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


async def _decoded(path: Path, decode: Decode) -> None:
    """Rewrite an encoded contribution's file as the plain weights it stands for (a plain one is left alone)."""
    if not await asyncio.to_thread(file_is_encoded, path):
        return
    weights = await decode(await asyncio.to_thread(path.read_bytes))
    await asyncio.to_thread(path.write_bytes, dumps(weights))


def _check(path: Path, row: dict[str, Any]) -> None:
    """The file is the object the contribution's row names (its size and sha256), or ValueError."""
    # The contribution was checked when accepted; a later change of the object must not slip in silently.
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if path.stat().st_size != row["size"] or digest != row["sha256"]:
        raise ValueError(f"{row['result_key']}: stored contribution changed since it was accepted")
