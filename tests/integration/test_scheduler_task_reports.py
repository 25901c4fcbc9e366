"""The scheduler believes a task report (`worker.initialized`, `worker.evaluated`) only with its assignment's
secret and from the broker user of the worker it names (SQLite and PostgreSQL): anything else is announced as
`report.forged` and neither sets a job's initial weights nor records a round's evaluation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from apiary import keys
from apiary.bus import Delivery
from apiary.bus.identity import service_user, worker_user
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import publish_event
from apiary.contracts import (
    Assignment,
    JobSharded,
    ObjectRef,
    RoundAggregated,
    RoundEvaluated,
    RoundStart,
    ShardInfo,
    WeightsInitialized,
    WorkerEvaluated,
    WorkerOnline,
    decode,
)
from apiary.db import Database
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from apiary.weights import dumps
from services.scheduler import Scheduler, store

JOB = "j1"


async def _stored(storage: LocalStorage, key: str) -> ObjectRef:
    data = dumps({"w": torch.zeros(2)})
    await storage.put_bytes(key, data)
    return ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


async def _until(check: Callable[[], bool], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_task_report_counts_only_with_its_secret_from_its_workers_user(database: Database,
                                                                               tmp_path: Path) -> None:
    # Prepare: a scheduler, a tap on what it publishes, worker w1 online, and a one-round job of one shard
    bus = MemoryBus(service_user("tracker"))
    await bus.connect()
    storage = LocalStorage(tmp_path / "store")
    (tmp_path / "data").mkdir()
    settings = Settings(allowed_entrypoints=["tests.toyjobs.*"], data_roots=[tmp_path])
    scheduler = Scheduler(bus.as_user(service_user("scheduler")), database, storage, settings)
    await scheduler.start()
    seen: list[Delivery] = []

    async def tap(delivery: Delivery) -> None:
        seen.append(delivery)

    def events(key: str) -> list[Delivery]:
        return [d for d in seen if d.routing_key == key]

    def task(kind: str) -> list[Assignment]:
        assignments = (decode(d.routing_key, d.body) for d in events("assign.pool"))
        return [a for a in assignments if isinstance(a, Assignment) and a.task == kind]

    await bus.declare_queue("tap", ["#"])  # every event routable, as the tracker makes it
    tapped = await bus.consume("tap", tap)
    w1, w2 = bus.as_user(worker_user("w1")), bus.as_user(worker_user("w2"))
    request = {"job_id": JOB, "name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
               "dataset": str(tmp_path / "data"),
               "distributed": {"num_rounds": 1, "min_workers": 1, "max_workers": 1, "aggregation_timeout": 600}}
    try:
        await publish_event(w1, WorkerOnline(worker_id="w1"))
        await bus.publish("job.requested", json.dumps(request).encode(), content_type="application/json")
        await _polled(database, lambda job, online: job is not None and job.status == "sharding" and "w1" in online)
        shard = ShardInfo(key="shard", size=1, sha256="0" * 64, index=0, num_samples=4)
        await publish_event(bus.as_user(service_user("sharder")), JobSharded(job_id=JOB, shards=[shard]))
        await _until(lambda: bool(task("init")), "the init assignment")
        init = task("init")[0]
        assert init.secret
        weights = await _stored(storage, keys.global_weights(JOB, 0))
        report = WeightsInitialized(job_id=JOB, attempt=init.attempt, worker_id="w1", weights=weights)

        # Execute: the init task's report with a wrong secret, with none, and with the right one from w2's user;
        # then the genuine one
        await publish_event(w1, report.model_copy(update={"secret": "guessed"}))
        await publish_event(w1, report)
        await publish_event(w2, report.model_copy(update={"secret": init.secret}))
        await _until(lambda: len(events("report.forged")) == 3, "three forged init reports")
        started_before = len(events("round.start"))
        await publish_event(w1, report.model_copy(update={"secret": init.secret}))
        await _until(lambda: bool(events("round.start")), "round 1 from the genuine initial weights")

        # ... and round 1's evaluation: a report with a wrong secret, then the genuine one
        await publish_event(bus.as_user(service_user("aggregator")), RoundAggregated(
            job_id=JOB, round=1, weights=await _stored(storage, keys.global_weights(JOB, 1)), contributors=[0],
            total_samples=4))
        await _until(lambda: bool(task("evaluate")), "the evaluate assignment")
        evaluate = task("evaluate")[0]
        assert evaluate.secret and evaluate.secret != init.secret
        evaluated = WorkerEvaluated(job_id=JOB, round=1, attempt=evaluate.attempt, worker_id="w1",
                                    metrics={"accuracy": 0.5})
        await publish_event(w1, evaluated.model_copy(update={"metrics": {"accuracy": 1.0}, "secret": "guessed"}))
        await _until(lambda: len(events("report.forged")) == 4, "the forged evaluation")
        evaluated_before = len(events("round.evaluated"))
        await publish_event(w1, evaluated.model_copy(update={"secret": evaluate.secret}))
        await _until(lambda: bool(events("round.evaluated")), "the genuine evaluation announced")
        job = await store.job(database, JOB)
        stored = await store.evaluations(database, JOB)
    finally:
        await tapped.cancel()
        await scheduler.stop()
        await bus.close()

    # Assert: each forged report announced with why, and nothing it said applied; the genuine ones applied
    forged = [decode("report.forged", d.body).model_dump() for d in events("report.forged")]
    assert [(f["report"], f["worker_id"], f["reason"]) for f in forged] == [
        ("worker.initialized", "w1", "a wrong assignment secret for the task"),
        ("worker.initialized", "w1", "no assignment secret for the task"),
        ("worker.initialized", "w1", "sent by worker 'w2''s broker user, not by worker 'w1'"),
        ("worker.evaluated", "w1", "a wrong assignment secret for the task"),
    ]
    assert started_before == 0 and evaluated_before == 0
    first = decode("round.start", events("round.start")[0].body)
    assert isinstance(first, RoundStart) and first.weights == weights
    assert job is not None and job.status == "completed"
    announced = [decode(d.routing_key, d.body) for d in events("round.evaluated")]
    assert [(e.metrics, e.worker_id) for e in announced if isinstance(e, RoundEvaluated)] == [({"accuracy": 0.5}, "w1")]
    assert all(d.user_id == service_user("scheduler") for d in events("round.evaluated"))
    assert [r["status"] for r in stored] == ["done"]


async def _polled(database: Database, check: Callable[[store.Job | None, set[str]], bool]) -> None:
    """Poll the scheduler's tables until `check(the job, the online workers)` holds."""
    deadline = time.monotonic() + 15
    while not check(await store.job(database, JOB), set(await store.online_workers(database, time.time() - 60))):
        assert time.monotonic() < deadline, f"job {JOB} and the workers online never got there"
        await asyncio.sleep(0.02)
