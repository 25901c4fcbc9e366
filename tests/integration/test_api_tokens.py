"""The HTTP API's tokens against a running stack, with the tracker's tables on SQLite and on PostgreSQL: no
token 401, a role too low 403, a submitter cancels only its own jobs, a revoked token stops working."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.tracker import token_store
from tests.fixtures.served import Served
from tests.toyjobs.toy import make_dataset

API = "/api/v1"
WORKERS = 2  # the `served` stack's in-process workers (tests/fixtures/served.py)


@pytest.fixture
def toy_request(tmp_path: Path) -> dict[str, Any]:
    """A toy job that runs long enough to be cancelled."""
    dataset = make_dataset(tmp_path / "toy-data", 12)
    return {"name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model", "dataset": str(dataset),
            "config": {"mode": "ok"}, "distributed": {"num_rounds": 50, "min_workers": 2, "max_workers": 2}}


async def test_every_api_route_refuses_a_request_without_a_valid_token(
        served: Served, toy_request: dict[str, Any]) -> None:
    # Execute
    async with served.client(None) as anonymous:
        missing = [await anonymous.get(f"{API}{path}") for path in
                   ("/training-jobs", "/training-jobs/x", "/workers", "/models", "/datasets", "/stream")]
        submitted = await anonymous.post(f"{API}/training-jobs", json=toy_request)
        forged = await anonymous.get(f"{API}/workers", headers={"Authorization": "Bearer apiary_not-a-token"})
        dashboard = await anonymous.get("/")

    # Assert
    assert [r.status_code for r in missing] == [401] * 6
    assert submitted.status_code == 401 and "missing token" in submitted.json()["detail"]
    assert missing[0].headers["www-authenticate"] == "Bearer"
    assert forged.status_code == 401 and "unknown or revoked token" in forged.json()["detail"]
    assert dashboard.status_code == 200  # the page itself asks for a token


async def test_a_viewer_reads_but_may_not_submit_or_cancel(
        served: Served, toy_request: dict[str, Any]) -> None:
    # Prepare
    async with served.client("submitter") as submitter:
        job_id = (await submitter.post(f"{API}/training-jobs", json=toy_request)).json()["job_id"]

    # Execute
    async with served.client("viewer") as viewer:
        listed = await viewer.get(f"{API}/training-jobs")
        submitted = await viewer.post(f"{API}/training-jobs", json=toy_request)
        cancelled = await viewer.post(f"{API}/training-jobs/{job_id}/cancel")
        registered = await viewer.post(f"{API}/datasets", params={"name": "d", "filename": "d.zip"}, content=b"x")

    # Assert
    assert listed.status_code == 200 and job_id in [j["job_id"] for j in listed.json()]
    assert (submitted.status_code, cancelled.status_code, registered.status_code) == (403, 403, 403)
    assert "'viewer-1' is a viewer token, which may only read" in cancelled.json()["detail"]


async def test_a_submitter_cancels_only_its_own_jobs_and_an_admin_any(
        served: Served, toy_request: dict[str, Any]) -> None:
    # Prepare
    async with served.client("submitter") as submitter, served.client("other") as other, \
            served.client("admin") as admin:
        mine = (await submitter.post(f"{API}/training-jobs", json=toy_request)).json()["job_id"]
        theirs = (await other.post(f"{API}/training-jobs", json=toy_request)).json()["job_id"]
        on_the_bus = await served.stack.submit(toy_request)

        # Execute
        refused = await submitter.post(f"{API}/training-jobs/{theirs}/cancel")
        refused_bus = await submitter.post(f"{API}/training-jobs/{on_the_bus}/cancel", params={"ahead": "true"})
        refused_ahead = await submitter.post(f"{API}/training-jobs/never-seen/cancel", params={"ahead": "true"})
        own = await submitter.post(f"{API}/training-jobs/{mine}/cancel")
        by_admin = await admin.post(f"{API}/training-jobs/{theirs}/cancel")

    # Assert
    assert refused.status_code == 403 and "was submitted by 'submitter-2'" in refused.json()["detail"]
    assert refused_bus.status_code == 403
    assert refused_ahead.status_code == 403 and "only an admin" in refused_ahead.json()["detail"]
    assert own.status_code == 202 and by_admin.status_code == 202
    assert await token_store.submitter(served.stack.ports.db, mine) == "submitter-1"
    assert await token_store.submitter(served.stack.ports.db, on_the_bus) is None


async def test_the_live_stream_takes_its_token_in_the_query_and_a_revoked_token_stops_working(
        served: Served) -> None:
    # Execute
    async with served.client(None) as anonymous:
        async with anonymous.stream("GET", f"{API}/stream", params={"token": served.tokens["viewer"]}) as stream:
            first = await anext(stream.aiter_lines())
        not_elsewhere = await anonymous.get(f"{API}/workers", params={"token": served.tokens["viewer"]})
    await token_store.revoke(served.stack.ports.db, "viewer-1")
    async with served.client("viewer") as viewer:
        revoked = await viewer.get(f"{API}/workers")

    # Assert
    assert first == "event: jobs"
    assert not_elsewhere.status_code == 401
    assert revoked.status_code == 401


async def test_only_the_hash_of_a_token_is_stored(served: Served) -> None:
    # Execute
    rows = await served.stack.ports.db.fetch("SELECT * FROM api_tokens")

    # Assert
    stored = {str(v) for row in rows for v in row.values()}
    assert not set(served.tokens.values()) & stored
    assert token_store.digest(served.tokens["admin"]) in stored
