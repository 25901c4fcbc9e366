"""The tracker writes heartbeats in batches (services/tracker/beats.py), on SQLite and PostgreSQL: the latest
beat of each worker, in one statement, never moving a worker's row back behind a newer report; a malformed
beat is refused naming its field."""

from __future__ import annotations

import pytest

from apiary.bus import Poison
from apiary.db import Database
from services.tracker import store
from services.tracker.beats import ROWS_PER_STATEMENT, Heartbeats, beat_of, heartbeat_of
from services.tracker.store import WorkerSeen
from services.tracker.views import workers_view


async def _workers(database: Database) -> dict[str, dict[str, object]]:
    return {w["worker_id"]: w for w in await workers_view(database, now=1000.0)}


async def test_the_latest_beat_of_each_worker_is_written_in_one_batch(database: Database) -> None:
    # Prepare: two beats of w1 (the later one kept, whatever order they came in), one training beat of w2,
    # and more workers than one statement takes.
    await database.migrate("tracker", store.MIGRATIONS)
    beats = Heartbeats(database)
    beats.keep(beat_of(heartbeat_of({"worker_id": "w1", "state": "idle", "gpu": {"util": 5}}), 102.0))
    beats.keep(beat_of(heartbeat_of({"worker_id": "w1", "state": "training", "job_id": "j"}), 101.0))
    beats.keep(beat_of(heartbeat_of({"worker_id": "w2", "state": "training", "job_id": "j", "round": 2,
                                     "shard": 3, "samples_per_s": 12, "kind": "own"}), 101.5))
    for i in range(ROWS_PER_STATEMENT + 1):
        beats.keep(beat_of(heartbeat_of({"worker_id": f"many-{i:04d}", "state": "idle"}), 100.0))

    # Execute
    written = await beats.write()

    # Assert: every worker once, as of its latest beat; nothing left to write.
    workers = await _workers(database)
    assert written == ROWS_PER_STATEMENT + 3 and beats.pending == 0 and await beats.write() == 0
    assert len(workers) == ROWS_PER_STATEMENT + 3
    w1, w2 = workers["w1"], workers["w2"]
    assert (w1["status"], w1["state"], w1["last_heartbeat"], w1["gpu"], w1["assignment"]) == (
        "online", "idle", 102.0, {"util": 5}, None)
    assert (w2["state"], w2["assignment"], w2["samples_per_s"], w2["kind"], w2["first_seen"]) == (
        "training", {"job_id": "j", "round": 2, "shard": 3}, 12.0, "own", 101.5)


async def test_a_beat_older_than_the_workers_row_changes_nothing(database: Database) -> None:
    # Prepare: w1 went offline at 105 (recorded at once, as the tracker records worker.offline); a beat it
    # sent before is still waiting for the batch. w2's row is older than its beat.
    await database.migrate("tracker", store.MIGRATIONS)
    async with database.transaction() as tx:
        await store.touch_worker(tx, WorkerSeen("w1", 105.0, state="stopped"))
        await store.worker_offline(tx, "w1")
        await store.touch_worker(tx, WorkerSeen("w2", 90.0, state="idle", hostname="h2", gpu='{"util": 1}'))
    beats = Heartbeats(database)
    beats.keep(beat_of(heartbeat_of({"worker_id": "w1", "state": "idle"}), 104.0))
    beats.keep(beat_of(heartbeat_of({"worker_id": "w2", "state": "training", "job_id": "j", "round": 1,
                                     "shard": 0}), 95.0))

    # Execute
    await beats.write()

    # Assert: w1 stays offline as of 105; w2 moves on, keeping what its beat did not say.
    workers = await _workers(database)
    assert (workers["w1"]["status"], workers["w1"]["state"], workers["w1"]["last_heartbeat"]) == (
        "offline", "stopped", 105.0)
    w2 = workers["w2"]
    assert (w2["status"], w2["state"], w2["last_heartbeat"], w2["hostname"], w2["gpu"], w2["first_seen"]) == (
        "online", "training", 95.0, "h2", {"util": 1}, 90.0)


@pytest.mark.parametrize(("body", "says"), [
    ({"state": "idle"}, "a worker_id string"),
    ({"worker_id": ["w"]}, "a worker_id string"),
    ({"worker_id": "w", "round": "one"}, "round has the wrong type (str)"),
    ({"worker_id": "w", "gpu": [1]}, "gpu has the wrong type (list)"),
    ({"worker_id": "w", "samples_per_s": True}, "samples_per_s has the wrong type (bool)"),
])
def test_a_malformed_beat_is_refused_naming_its_field(body: dict[str, object], says: str) -> None:
    with pytest.raises(Poison, match=says.replace("(", r"\(").replace(")", r"\)")):
        heartbeat_of(body)
