"""What the sharder does on shard.requested: split the job's dataset once, store the shards, announce them."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from apiary import keys
from apiary.bus import Delivery
from apiary.contracts import JobSharded, ShardInfo, ShardRequested
from apiary.dataset import DatasetError, DatasetSource, label_histogram, split, write_shard
from apiary.dataset_text import TextDataset, write_text_shard
from apiary.db import Database
from apiary.outbox import KeyedLocks, Outbox
from apiary.registry import dataset_info
from apiary.storage import ObjectNotFound, Storage
from services.sharder import store
from services.sharder.source import locate

log = logging.getLogger("apiary.sharder")


class ShardHandlers:
    """Splits datasets into shards, seeded, and stores them under the job's prefix."""

    def __init__(self, db: Database, storage: Storage, outbox: Outbox) -> None:
        self._db, self._storage, self._outbox = db, storage, outbox
        self._locks = KeyedLocks()

    async def on_shard_requested(self, event: ShardRequested, delivery: Delivery) -> None:
        """Split the job's dataset (once per job) and announce the shards."""
        async with self._locks(event.job_id):
            shards, dataset_id = await store.job_shards(self._db, event.job_id)
            if len(shards) == event.num_shards:
                reply = JobSharded(job_id=event.job_id, dataset_id=dataset_id, shards=shards)
            else:
                reply = await self._shard(event)
            async with self._db.transaction() as tx:
                await store.record_shards(tx, event.job_id, reply.shards, reply.dataset_id, time.time())
                await self._outbox.add(tx, reply)
            await self._outbox.flush()

    async def _shard(self, event: ShardRequested) -> JobSharded:
        """Split the dataset and store each shard; a bad dataset is the reply's error."""
        with tempfile.TemporaryDirectory(prefix="apiary-shard-") as tmp:
            try:
                path, dataset_id = await self._locate(event, Path(tmp))
                files = await asyncio.to_thread(split_to_files, event, path, Path(tmp) / "out")
            except DatasetError as e:
                log.warning("job %s: %s", event.job_id, e)
                return JobSharded(job_id=event.job_id, error=str(e))
            shards = []
            for index, file in enumerate(files):
                ref = await self._storage.put_file(keys.shard(event.job_id, index), file.path)
                shards.append(ShardInfo(index=index, key=ref.key, size=ref.size, sha256=ref.sha256,
                                        num_samples=file.num_samples, labels=file.labels))
        log.info("job %s: %d shards of %s samples", event.job_id, len(shards),
                 [s.num_samples for s in shards])
        return JobSharded(job_id=event.job_id, dataset_id=dataset_id, shards=shards)

    async def _locate(self, event: ShardRequested, tmp: Path) -> tuple[Path, str | None]:
        """A local path for the dataset (fetched into `tmp` from storage when it is there), and its id."""
        if event.dataset_id:
            info = await dataset_info(self._storage, event.dataset_id)
            return await self._fetch(info["key"], tmp), event.dataset_id
        ref = event.dataset or ""
        where = locate(ref, self._storage.uri("x").removesuffix("x"))
        if where.key is not None:
            return await self._fetch(where.key, tmp), None
        if where.path is None or (where.plain and not where.path.exists()):
            raise DatasetError(f"dataset {ref} does not exist (give a folder or zip with a manifest.json)")
        return where.path, None

    async def _fetch(self, key: str, tmp: Path) -> Path:
        """Download a dataset object into `tmp`."""
        target = tmp / "dataset" / Path(key).name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            await self._storage.get_file(key, target)
        except ObjectNotFound:
            raise DatasetError(f"dataset object {key!r} is not in storage") from None
        return target


# Writes one shard's zip from the dataset's indices and the shard's facts; returns its sample count.
WriteShard = Callable[[Sequence[int], dict[str, Any], Path], int]


class ShardFile(NamedTuple):
    """One shard written by the splitter: its zip, its sample count and its label histogram (if labelled)."""

    path: Path
    num_samples: int
    labels: dict[str, int] | None


def split_to_files(event: ShardRequested, path: Path, out: Path) -> list[ShardFile]:
    """Split the dataset at `path` as the request asks, one zip per shard under `out`. A text dataset's records
    are split exactly as a manifest's samples."""
    text = TextDataset.open(path)
    if text is not None:
        return _write_shards(event, text.records, out, partial(write_text_shard, text))
    source = DatasetSource(path)
    try:
        manifest = source.manifest()
        return _write_shards(event, manifest.samples, out, partial(write_shard, source, manifest))
    finally:
        source.close()


def _write_shards(event: ShardRequested, samples: Sequence[dict[str, Any]], out: Path,
                  write: WriteShard) -> list[ShardFile]:
    """Split `samples` seeded as the request asks and write each shard under `out`."""
    parts = split(samples, event.num_shards, strategy=event.strategy, seed=event.seed, alpha=event.alpha,
                  group_key=event.group_key)
    files = []
    for index, indices in enumerate(parts):
        target = out / f"shard-{index:04d}.zip"
        info = {"index": index, "count": event.num_shards, "seed": event.seed, "strategy": event.strategy}
        files.append(ShardFile(target, write(indices, info, target), label_histogram(samples, indices)))
    return files
