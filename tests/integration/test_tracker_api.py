"""The tracker's HTTP API against a running embedded stack, with its tables on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from apiary import proof
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import publish_event
from apiary.contracts import (
    JobCancelRequested,
    JobFailed,
    ObjectRef,
    RoundStart,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerProgress,
)
from apiary.db.sqlite import SqliteDatabase
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from services.app.runtime import Embedded
from services.tracker import Tracker, token_store
from services.tracker.client import watch_job
from services.tracker.views import TERMINAL, job_view
from services.worker.gpu import gpu_stats
from tests.toyjobs.toy import Gates, make_dataset

REPO = Path(__file__).resolve().parents[2]
API = "/api/v1"
T = TypeVar("T")


@dataclass
class Api:
    """A running stack, an HTTP client on its tracker, and a toy dataset."""

    stack: Embedded
    http: httpx.AsyncClient
    dataset: Path

    def request(self, **distributed: Any) -> dict[str, Any]:
        """A toy job request on two shards; keyword arguments override `distributed`."""
        return {
            "name": "toy",
            "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(self.dataset),
            "config": {"mode": "ok"},
            "distributed": {"num_rounds": 3, "min_workers": 2, "max_workers": 2, **distributed},
        }

    async def wait_for(self, job_id: str, predicate: Callable[[dict[str, Any]], bool],
                       timeout: float = 60) -> dict[str, Any]:
        """The tracker's view of the job once `predicate` holds."""

        async def probe() -> dict[str, Any] | None:
            view = await job_view(self.stack.ports.db, job_id)
            return view if view is not None and predicate(view) else None

        return await self.until(probe, timeout)

    async def until(self, probe: Callable[[], Awaitable[T | None]], timeout: float = 60) -> T:
        """What `probe` returns once it is not None, probing again after each change the tracker records."""
        tracker = self.stack.tracker
        deadline = time.monotonic() + timeout
        while True:
            seen = tracker.version
            result = await probe()
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout}s")
            async with tracker.changed:
                await asyncio.wait_for(tracker.changed.wait_for(lambda v=seen: tracker.version != v), remaining)


@pytest.fixture(params=["sqlite", "postgres"])
async def api(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Api]:
    """Two workers and every service in one process, the tracker's HTTP API on a free port."""
    database_url = (f"sqlite:///{tmp_path / 'apiary.db'}" if request.param == "sqlite"
                    else request.getfixturevalue("postgres_url"))
    settings = Settings(home=tmp_path / ".apiary", database_url=database_url, http_port=0,
                        heartbeat_interval=0.5, progress_interval=0.0)
    async with Embedded(settings, workers=2, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        headers = {"Authorization": f"Bearer {await stack.api_token()}"}
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as http:
            yield Api(stack, http, make_dataset(tmp_path / "toy-data", 12))


# ---------------------------------------------------------------- submitting


BAD_BODIES = [
    ("wrong types and ranges, unknown fields",
     {"name": "", "entrypoint": "not an entrypoint", "dataset": "d",
      "distributed": {"num_rounds": 0, "max_workers": "many", "bogus": 1}, "colour": "red"},
     {"name", "entrypoint", "distributed.num_rounds", "distributed.max_workers", "distributed.bogus", "colour"}),
    ("missing required fields", {"dataset": "d"}, {"name", "entrypoint"}),
    ("a nested block of the wrong shape", {"name": "x", "entrypoint": "m:f", "dataset": "d",
                                            "worker_selection": {"mode": "everywhere"}}, {"worker_selection.mode"}),
    ("a rule across fields", {"name": "x", "entrypoint": "m:f"}, {"(request)"}),
    ("not an object", ["name", "x"], {"(request)"}),
]


async def test_a_malformed_job_request_gets_422_naming_each_bad_field(api: Api) -> None:
    for case, body, fields in BAD_BODIES:
        response = await api.http.post(f"{API}/training-jobs", json=body)

        assert response.status_code == 422, case
        problem = response.json()
        assert {e["field"] for e in problem["errors"]} == fields, case
        assert all(e["message"] for e in problem["errors"]), case
        for field in fields - {"(request)"}:
            assert field in problem["detail"], case
    broken = await api.http.post(f"{API}/training-jobs", content=b"{not json",
                                 headers={"content-type": "application/json"})
    assert broken.status_code == 422
    assert "not valid JSON" in broken.json()["errors"][0]["message"]
    assert (await api.http.get(f"{API}/training-jobs")).json() == []


async def test_a_request_across_fields_names_the_rule_it_broke(api: Api) -> None:
    body = {**api.request(), "dataset_id": "also-given"}

    response = await api.http.post(f"{API}/training-jobs", json=body)

    assert response.status_code == 422
    assert "either 'dataset' or 'dataset_id'" in response.json()["errors"][0]["message"]


async def test_unknown_jobs_are_404_on_every_job_endpoint(api: Api) -> None:
    responses = [
        await api.http.get(f"{API}/training-jobs/nope"),
        await api.http.get(f"{API}/training-jobs/nope/metrics"),
        await api.http.get(f"{API}/training-jobs/nope/events"),
        await api.http.post(f"{API}/training-jobs/nope/cancel"),
    ]

    assert [r.status_code for r in responses] == [404, 404, 404, 404]
    assert all("nope" in r.json()["detail"] for r in responses)


# ---------------------------------------------------------------- following a job


async def test_a_submitted_job_is_listed_detailed_and_charted(api: Api) -> None:
    response = await api.http.post(f"{API}/training-jobs", json={**api.request(), "job_id": "toy-1"})
    assert response.status_code == 202
    assert response.json()["job_id"] == "toy-1"
    assert response.headers["location"] == f"{API}/training-jobs/toy-1"
    right_away = await api.http.get(f"{API}/training-jobs/toy-1")
    await api.stack.wait("toy-1", timeout=120)

    listed = (await api.http.get(f"{API}/training-jobs")).json()
    detail = (await api.http.get(f"{API}/training-jobs/toy-1")).json()
    metrics = (await api.http.get(f"{API}/training-jobs/toy-1/metrics")).json()
    later = (await api.http.get(f"{API}/training-jobs/toy-1/metrics", params={"after": metrics["cursor"]})).json()
    taken = await api.http.post(f"{API}/training-jobs", json={**api.request(), "job_id": "toy-1"})

    assert right_away.status_code == 200
    assert [(j["job_id"], j["status"], j["round"], j["num_rounds"]) for j in listed] == [("toy-1", "completed", 3, 3)]
    assert detail["status"] == "completed" and detail["reason"] is None
    assert (detail["round"], detail["num_rounds"]) == (3, 3)
    assert [(r["round"], r["status"]) for r in detail["rounds"]] == [(1, "aggregated"), (2, "aggregated"),
                                                                     (3, "aggregated")]
    assert all("loss" in r["metrics"] for r in detail["rounds"])
    assert [s["state"] for s in detail["shards"]] == ["reported", "reported"]
    assert sorted(detail["reported"]) == sorted(s["worker_id"] for s in detail["shards"])
    assert detail["training"] == [] and detail["progress"]["reported"] == 2
    assert detail["final_model"].endswith("jobs/toy-1/final/model.safetensors")
    # The toy logs three points per shard and round: 1 / (round + shard) + 0.1 * (2 - step).
    points = [p for series in metrics["workers"] for p in series["points"]]
    assert len(points) == 3 * 2 * 3
    for p in points:
        assert p["y"] == pytest.approx(1 / (p["round"] + p["shard"]) + 0.1 * (2 - p["step"]))
    assert all(a["x"] <= b["x"] for series in metrics["workers"]
               for a, b in zip(series["points"], series["points"][1:], strict=False))
    assert metrics["rounds"] == [{"x": r["round"], "y": r["metrics"]["loss"], "attempt": 1} for r in detail["rounds"]]
    assert [m["round"] for m in metrics["round_marks"]] == [1, 2, 3]
    assert later["workers"] == [] and later["cursor"] == metrics["cursor"]
    assert taken.status_code == 409


async def test_the_event_stream_pushes_a_job_live_until_it_ends(api: Api) -> None:
    job_id = (await api.http.post(f"{API}/training-jobs", json=api.request(num_rounds=4))).json()["job_id"]
    events: list[tuple[str, dict[str, Any]]] = []

    async with asyncio.timeout(120):
        async with api.http.stream("GET", f"{API}/training-jobs/{job_id}/events", timeout=None) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            name = ""
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    events.append((name, json.loads(line.removeprefix("data: "))))

    rounds_seen = [data["round"] for name, data in events if name == "job"]
    points = sum(len(s["points"]) for name, data in events if name == "metrics" for s in data["workers"])
    assert events[-1] == ("end", {"job_id": job_id, "status": "completed"})
    assert len(set(rounds_seen)) > 1 and rounds_seen == sorted(rounds_seen)
    assert points == 3 * 2 * 4
    assert any(name == "workers" for name, _ in events)


async def test_the_client_watches_a_job_over_http(api: Api) -> None:
    job_id = (await api.http.post(f"{API}/training-jobs", json=api.request(num_rounds=2))).json()["job_id"]
    views = []

    async with asyncio.timeout(120):
        async for view in watch_job(str(api.http.base_url), job_id, token=await api.stack.api_token()):
            views.append(view)

    assert views[-1]["status"] == "completed"
    assert views[-1]["round"] == 2


# ---------------------------------------------------------------- workers and cancelling


async def test_workers_report_presence_assignment_and_throughput(api: Api, tmp_path: Path) -> None:
    gates = Gates(tmp_path)  # the shards train until the test has seen a worker's assignment
    body = api.request(num_rounds=1)
    body["config"] = {"mode": "gated", "gate": gates.path}
    job_id = (await api.http.post(f"{API}/training-jobs", json=body)).json()["job_id"]

    async def busy() -> list[dict[str, Any]] | None:
        workers = (await api.http.get(f"{API}/workers")).json()
        return workers if any(w["assignment"] for w in workers) else None

    during = await api.until(busy)
    gates.open_through(1)
    trained = set((await api.stack.wait(job_id, timeout=120))["reported"])

    async def measured() -> list[dict[str, Any]] | None:
        workers = (await api.http.get(f"{API}/workers")).json()
        done = [w for w in workers if w["worker_id"] in trained and w["samples_per_s"] is not None]
        return workers if len(done) == len(trained) else None

    after = await api.until(measured)  # throughput arrives with the next heartbeat after a shard

    assert sorted(w["worker_id"] for w in after) == ["worker-1", "worker-2"]
    assignment = next(w["assignment"] for w in during if w["assignment"])
    assert assignment["job_id"] == job_id and assignment["round"] == 1 and assignment["shard"] in (0, 1)
    for w in after:
        assert w["status"] == "online"
        assert w["seconds_since_heartbeat"] < 30
        assert w["assignment"] is None  # the job is over
        if w["worker_id"] in trained:
            assert w["samples_per_s"] > 0
        # Read through NVML where a GPU is present; null, never made up, where it is not.
        if gpu_stats(None) is None:
            assert w["gpu"] is None
        else:
            assert 0 <= w["gpu"]["utilization"] <= 100 and w["gpu"]["memory_total"] > 0


async def test_a_gpu_reading_in_a_heartbeat_reaches_the_workers_endpoint(api: Api) -> None:
    gpu = {"index": 0, "name": "NVIDIA H200", "utilization": 87.0, "memory_used": 40 * 2**30,
           "memory_total": 141 * 2**30, "process_memory_used": 12 * 2**30}
    await publish_event(api.stack.ports.bus, WorkerHeartbeat(worker_id="gpu-box", state="idle", gpu=gpu,
                                                             samples_per_s=1234.5))

    async def seen() -> dict[str, Any] | None:
        workers = (await api.http.get(f"{API}/workers")).json()
        return next((w for w in workers if w["worker_id"] == "gpu-box"), None)

    worker = await api.until(seen)

    assert worker["gpu"] == gpu
    assert worker["samples_per_s"] == 1234.5 and worker["status"] == "online"


async def test_a_shard_whose_worker_went_offline_shows_as_offline(api: Api) -> None:
    # Events only the tracker consumes, for a job no other service knows.
    weights = ObjectRef(key="k", size=1, sha256="0" * 64)
    secrets = {shard: proof.new_secret() for shard in (0, 1)}
    await publish_event(api.stack.ports.bus, RoundStart(
        job_id="ghost", round=1, num_rounds=2, shards=[0, 1], min_workers=1, weights=weights,
        deadline=time.time() + 60, secret_digests={s: proof.digest(secret) for s, secret in secrets.items()},
        progress_digests={s: proof.digest(proof.progress_token(secret)) for s, secret in secrets.items()}))
    await publish_event(api.stack.ports.bus, WorkerProgress(job_id="ghost", round=1, worker_id="w-gone", shard=0,
                                                            metrics={"loss": 0.5}, step=3,
                                                            token=proof.progress_token(secrets[0])))
    await api.wait_for("ghost", lambda v: v["progress"]["training"] == 1)
    await publish_event(api.stack.ports.bus, WorkerOffline(worker_id="w-gone"))
    await api.wait_for("ghost", lambda v: v["progress"]["offline"] == 1)

    detail = (await api.http.get(f"{API}/training-jobs/ghost")).json()

    assert [(s["shard"], s["worker_id"], s["state"], s["step"]) for s in detail["shards"]] == [
        (0, "w-gone", "offline", 3), (1, None, "assigned", None)]
    assert detail["training"] == [] and detail["status"] == "running"


async def test_a_running_job_can_be_cancelled_once(api: Api) -> None:
    body = api.request(num_rounds=1000)
    body["config"] = {"mode": "slow", "slow_seconds": 0.3}
    job_id = (await api.http.post(f"{API}/training-jobs", json=body)).json()["job_id"]
    await api.wait_for(job_id, lambda v: v["status"] == "running")

    first = await api.http.post(f"{API}/training-jobs/{job_id}/cancel")
    view = await api.wait_for(job_id, lambda v: v["status"] == "cancelled")
    second = await api.http.post(f"{API}/training-jobs/{job_id}/cancel")

    assert first.status_code == 202 and first.json() == {"job_id": job_id, "status": "cancelling"}
    assert view["reason"] == "cancelled by user" and view["round"] < 1000
    assert second.status_code == 409
    assert "already ended" in second.json()["detail"]


async def test_a_cancel_that_arrives_before_its_job_request_stops_the_job_before_it_starts(api: Api) -> None:
    # Another system cancels at once; its cancel overtakes the request (they travel separately).
    job_id = "cancelled-early"
    await publish_event(api.stack.ports.bus, JobCancelRequested(job_id=job_id, reason="cancelled by its owner"))
    db = api.stack.ports.db
    deadline = time.monotonic() + 30
    while not await db.fetch("SELECT job_id FROM early_cancels WHERE job_id = $1", job_id):
        assert time.monotonic() < deadline, "the scheduler never recorded the early cancel"
        await asyncio.sleep(0.02)
    await api.stack.submit({**api.request(), "job_id": job_id})

    await api.wait_for(job_id, lambda v: v["status"] == "cancelled")
    view = (await api.http.get(f"{API}/training-jobs/{job_id}")).json()

    assert view["status"] == "cancelled" and view["reason"] == "cancelled by its owner"
    # The scheduler stored the job as cancelled before it told anyone: no round was or will be started.
    assert await db.fetch("SELECT round FROM rounds WHERE job_id = $1", job_id) == []
    assert view["round"] == 0 and view["rounds"] == []
    assert await db.fetch("SELECT * FROM early_cancels") == []


async def test_a_failure_whose_reason_mentions_cancelling_is_still_a_failure(api: Api) -> None:
    # Prepare: a job that failed (its user code raised, saying "cancelled"), and one that was cancelled.
    bus = api.stack.ports.bus

    # Execute
    crash = "RuntimeError: download cancelled by the data server"
    await publish_event(bus, JobFailed(job_id="crashed", reason=crash, round=2))
    await publish_event(bus, JobFailed(job_id="stopped", reason="budget spent", round=3, cancelled=True))

    # Assert: the flag decides, not the words of the reason.
    crashed = await api.wait_for("crashed", lambda v: v["status"] in TERMINAL)
    stopped = await api.wait_for("stopped", lambda v: v["status"] in TERMINAL)
    assert (crashed["status"], stopped["status"]) == ("failed", "cancelled")


async def test_the_openapi_schema_documents_every_endpoint(api: Api) -> None:
    schema = (await api.http.get("/openapi.json")).json()

    assert set(schema["paths"]) == {
        f"{API}/training-jobs", f"{API}/training-jobs/{{job_id}}", f"{API}/training-jobs/{{job_id}}/metrics",
        f"{API}/training-jobs/{{job_id}}/cancel", f"{API}/training-jobs/{{job_id}}/events", f"{API}/workers",
        f"{API}/stream", f"{API}/models", f"{API}/models/{{item_id}}", f"{API}/datasets",
        f"{API}/datasets/{{item_id}}", f"{API}/code", f"{API}/token", f"{API}/job-defaults",
        f"{API}/training-jobs/{{job_id}}/request", f"{API}/uploads", f"{API}/uploads/{{upload_id}}",
        f"{API}/uploads/{{upload_id}}/complete",
    }
    submit = schema["paths"][f"{API}/training-jobs"]["post"]
    body_schema = submit["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/JobRequested"}
    assert set(submit["responses"]) >= {"202", "409", "422"}


# ---------------------------------------------------------------- serving


async def test_the_tracker_serves_http_when_asked_and_stops_cleanly(tmp_path: Path) -> None:
    bus, db = MemoryBus(), SqliteDatabase(str(tmp_path / "t.db"))
    await bus.connect()
    await db.connect()
    tracker = Tracker(bus, db, LocalStorage(tmp_path / "store"), Settings(http_port=0), http=True)
    try:
        await tracker.start()
        url = tracker.http_url
        assert url is not None
        await token_store.migrate(db)
        token = await token_store.create(db, "watcher", "viewer")
        async with httpx.AsyncClient(base_url=url) as http:
            dashboard = await http.get("/")
            stream = http.stream("GET", f"{API}/stream", params={"token": token}, timeout=None)
            opened = await stream.__aenter__()
            lines = opened.aiter_lines()
            first = await anext(lines)

            await tracker.stop()  # ends the open stream, then the server

            async with asyncio.timeout(10):
                rest = [line async for line in lines]
            await stream.__aexit__(None, None, None)
            with pytest.raises(httpx.ConnectError):
                await http.get("/openapi.json")
    finally:
        await tracker.stop()
        await db.close()
        await bus.close()

    assert dashboard.status_code == 200 and "<title>Apiary</title>" in dashboard.text
    assert first == "event: jobs"
    assert "event: workers" in rest
    assert tracker.http_url is None
