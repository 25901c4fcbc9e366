"""Who may do what, on a deployment: the HTTP API without a token or with one whose role is too low, and a
worker using its broker credentials to pass for another worker or to publish outside its own events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlsplit

import aio_pika
import httpx
import pytest
from aiormq.exceptions import AMQPError

from apiary.settings import Settings
from services.app import broker_setup, tokens
from tests.faults.support import Faults

Record = Callable[[str, str, str, int], None]


def test_the_api_refuses_a_request_without_a_token_and_a_viewer_cancelling(
        faults: Faults, tmp_path: Path, outcome: Record) -> None:
    # Prepare
    cluster = faults.cluster
    cluster.start(workers=[])
    base = f"http://127.0.0.1:{cluster.http_port}/api/v1"
    viewer = asyncio.run(tokens.create(Settings(database_url=cluster.database_url), "fault-viewer", "viewer"))
    admin = {"Authorization": f"Bearer {cluster.api_token}"}
    job_id = f"identity-{uuid.uuid4().hex[:8]}"
    cluster.publish_job({"job_id": job_id, "name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
                         "dataset": str(tmp_path / "none"), "distributed": {"num_rounds": 1}})
    cluster.wait_for(lambda: httpx.get(f"{base}/training-jobs/{job_id}", headers=admin).status_code == 200, 60,
                     "the tracker to record the job")

    # Execute
    anonymous = httpx.post(f"{base}/training-jobs/{job_id}/cancel")
    cancelled_by_viewer = httpx.post(f"{base}/training-jobs/{job_id}/cancel",
                                     headers={"Authorization": f"Bearer {viewer}"})
    read_by_viewer = httpx.get(f"{base}/training-jobs/{job_id}", headers={"Authorization": f"Bearer {viewer}"})

    # Assert
    assert anonymous.status_code == 401 and "missing token" in anonymous.json()["detail"]
    assert cancelled_by_viewer.status_code == 403 and "viewer token" in cancelled_by_viewer.json()["detail"]
    assert read_by_viewer.status_code == 200
    outcome("API call without a token; a viewer's token cancelling a job", "401; 403 naming the role needed",
            f"{anonymous.status_code}; {cancelled_by_viewer.status_code} ({cancelled_by_viewer.json()['detail'][:40]}"
            "...)", 0)


async def _publish(url: str, exchange: str, routing_key: str, user_id: str | None) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange, ensure=False)
        await target.publish(aio_pika.Message(b"{}", user_id=user_id), routing_key, timeout=10)
    finally:
        await connection.close()


def test_a_worker_cannot_pass_for_another_worker_nor_publish_a_services_event(
        faults: Faults, tmp_path: Path, outcome: Record) -> None:
    # Prepare: broker users for the deployment's exchange, each process on its own
    cluster, prefix = faults.cluster, f"apiary-test-{uuid.uuid4().hex[:10]}-"
    credentials = tmp_path / broker_setup.CREDENTIALS_FILE
    made = broker_setup.setup(cluster.exchange, "/", ["w1", "w2"], credentials, prefix=prefix)
    try:
        cluster.start(workers=[])
        password = broker_setup.load_credentials(credentials)[f"{prefix}worker.w1"]
        parts = urlsplit(cluster.amqp_url)
        url = f"amqp://{quote(prefix + 'worker.w1', safe='')}:{quote(password, safe='')}@{parts.hostname}:" \
              f"{parts.port or 5672}/"

        # Execute
        refused = []
        for routing_key, user_id in (("worker.done", f"{prefix}worker.w2"), ("round.aggregated", None),
                                     ("assign.pool", None), ("job.initialized", None), ("round.evaluated", None)):
            with pytest.raises(AMQPError) as caught:
                asyncio.run(_publish(url, cluster.exchange, routing_key, user_id))
            refused.append(str(caught.value))
        asyncio.run(_publish(url, cluster.exchange, "worker.heartbeat", f"{prefix}worker.w1"))  # its own: taken
    finally:
        broker_setup.remove(made.users)
        broker_setup.remove_policy(cluster.exchange, "/")

    # Assert
    assert "user_id property set to" in refused[0] and "PRECONDITION_FAILED" in refused[0]
    for message, key in zip(refused[1:], ("round.aggregated", "assign.pool", "job.initialized", "round.evaluated"),
                            strict=True):
        assert "ACCESS_REFUSED" in message and key in message
    outcome("a worker publishing worker.done as another worker; publishing round.aggregated, assign.pool, "
            "job.initialized or round.evaluated",
            "refused by the broker (user_id checked; topic permissions: worker.* only)",
            f"all {len(refused)} refused; its own heartbeat taken", 0)
