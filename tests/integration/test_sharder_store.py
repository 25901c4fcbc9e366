"""The sharder's table keeps each shard's label histogram, so a redelivered shard.requested announces the same
shards (on SQLite and on PostgreSQL)."""

from __future__ import annotations

from apiary.contracts import ShardInfo
from apiary.db import Database
from services.sharder import store


async def test_stored_shards_come_back_with_their_histograms(database: Database) -> None:
    # Prepare
    await database.migrate("sharder", store.MIGRATIONS)
    shards = [ShardInfo(index=0, key="jobs/j/shards/shard-0000.zip", size=10, sha256="a" * 64, num_samples=5,
                        labels={"2": 3, "10": 2}),
              ShardInfo(index=1, key="jobs/j/shards/shard-0001.zip", size=11, sha256="b" * 64, num_samples=4)]

    # Execute
    async with database.transaction() as tx:
        await store.record_shards(tx, "j", shards, "7", 1.0)
    again, dataset_id = await store.job_shards(database, "j")

    # Assert
    assert again == shards
    assert again[0].labels == {"2": 3, "10": 2} and again[1].labels is None
    assert dataset_id == "7"
