"""Sharder handlers: shard.requested -> job.sharded."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from apiary import keys
from apiary.bus import Delivery, subscribe
from apiary.component import Component
from apiary.contracts import JobSharded, ShardInfo, ShardRequested
from apiary.dataset import DatasetError, DatasetSource, split, write_shard
from apiary.outbox import KeyedLocks, Outbox, outbox_migration
from apiary.registry import dataset_info
from apiary.storage import ObjectNotFound

log = logging.getLogger("apiary.sharder")

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS shards (
      job_id TEXT NOT NULL, shard BIGINT NOT NULL, storage_key TEXT NOT NULL, size BIGINT NOT NULL,
      sha256 TEXT NOT NULL, num_samples BIGINT NOT NULL, dataset_id TEXT,
      created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, shard));
    """,
    outbox_migration("sharder_outbox"),
]


class Sharder(Component):
    """Splits datasets into shards, seeded, and stores them under the job's prefix."""

    name = "sharder"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox = Outbox(self.db, self.bus, "sharder_outbox")
        self._locks = KeyedLocks()

    async def start(self) -> None:
        await self.db.migrate(self.name, MIGRATIONS)
        await self.outbox.flush()
        self._subscriptions.append(
            await subscribe(self.bus, "sharder", {"shard.requested": self.on_shard_requested},
                            prefetch=self.settings.prefetch)
        )

    async def on_shard_requested(self, event: ShardRequested, delivery: Delivery) -> None:
        """Split the job's dataset (once per job) and announce the shards."""
        async with self._locks(event.job_id):
            rows = await self.db.fetch(
                "SELECT shard, storage_key, size, sha256, num_samples, dataset_id FROM shards"
                " WHERE job_id = $1 ORDER BY shard",
                event.job_id,
            )
            if len(rows) == event.num_shards:
                shards = [
                    ShardInfo(index=r["shard"], key=r["storage_key"], size=r["size"], sha256=r["sha256"],
                              num_samples=r["num_samples"])
                    for r in rows
                ]
                reply = JobSharded(job_id=event.job_id, dataset_id=rows[0]["dataset_id"], shards=shards)
            else:
                reply = await self._shard(event)
            async with self.db.transaction() as tx:
                for s in reply.shards:
                    await tx.execute(
                        "INSERT INTO shards (job_id, shard, storage_key, size, sha256, num_samples,"
                        " dataset_id, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
                        " ON CONFLICT DO NOTHING",
                        event.job_id, s.index, s.key, s.size, s.sha256, s.num_samples, reply.dataset_id,
                        time.time(),
                    )
                await self.outbox.add(tx, reply)
            await self.outbox.flush()

    async def _shard(self, event: ShardRequested) -> JobSharded:
        with tempfile.TemporaryDirectory(prefix="apiary-shard-") as tmp:
            try:
                path, dataset_id = await self._locate(event, Path(tmp))
                files = await asyncio.to_thread(self._split_to_files, event, path, Path(tmp) / "out")
            except DatasetError as e:
                log.warning("job %s: %s", event.job_id, e)
                return JobSharded(job_id=event.job_id, error=str(e))
            shards = []
            for index, (file, count) in enumerate(files):
                ref = await self.storage.put_file(keys.shard(event.job_id, index), file)
                shards.append(ShardInfo(index=index, key=ref.key, size=ref.size, sha256=ref.sha256,
                                        num_samples=count))
        log.info("job %s: %d shards of %s samples", event.job_id, len(shards),
                 [s.num_samples for s in shards])
        return JobSharded(job_id=event.job_id, dataset_id=dataset_id, shards=shards)

    async def _locate(self, event: ShardRequested, tmp: Path) -> tuple[Path, str | None]:
        """A local path for the dataset: a path, a file:// URI, a storage URI or key, or a dataset id."""
        if event.dataset_id:
            info = await dataset_info(self.storage, event.dataset_id)
            return await self._fetch(info["key"], tmp), event.dataset_id
        ref = event.dataset or ""
        if ref.startswith("file:"):
            return Path(unquote(urlparse(ref).path)), None
        if ref.startswith("s3://"):
            key = self._key_from_uri(ref)
            return await self._fetch(key, tmp), None
        path = Path(ref)
        if not path.exists():
            raise DatasetError(f"dataset {ref} does not exist (give a folder or zip with a manifest.json)")
        return path, None

    def _key_from_uri(self, uri: str) -> str:
        own = self.storage.uri("x").removesuffix("x")
        if not uri.startswith(own):
            raise DatasetError(f"dataset {uri} is outside this deployment's storage ({own})")
        return uri.removeprefix(own)

    async def _fetch(self, key: str, tmp: Path) -> Path:
        target = tmp / "dataset" / Path(key).name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            await self.storage.get_file(key, target)
        except ObjectNotFound:
            raise DatasetError(f"dataset object {key!r} is not in storage") from None
        return target

    @staticmethod
    def _split_to_files(event: ShardRequested, path: Path, out: Path) -> list[tuple[Path, int]]:
        source = DatasetSource(path)
        try:
            manifest = source.manifest()
            parts = split(manifest.samples, event.num_shards, strategy=event.strategy, seed=event.seed,
                          alpha=event.alpha, group_key=event.group_key)
            files = []
            for index, indices in enumerate(parts):
                target = out / f"shard-{index:04d}.zip"
                info = {"index": index, "count": event.num_shards, "seed": event.seed, "strategy": event.strategy}
                files.append((target, write_shard(source, manifest, indices, info, target)))
            return files
        finally:
            source.close()
