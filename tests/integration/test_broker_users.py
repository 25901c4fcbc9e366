"""`apiary broker setup` against the real broker, in a vhost and with user names of the test's own (removed
afterwards): each worker may publish only its own events as itself, and read only its own queues and the
pool; running setup again changes nothing."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import aio_pika
import pytest
from aiormq.exceptions import AMQPError

from apiary.assignments import POOL, PREFER_WAIT, preferred_queue
from apiary.bus import Delivery, make_bus, publish_event
from apiary.bus.rabbitmq import RabbitBus, wire
from apiary.bus.typed import Next
from apiary.contracts import Assignment
from apiary.settings import Settings
from services.app import broker_setup
from services.app.broker_setup import SetupResult
from services.worker import Worker
from tests.fixtures.cluster import SERVICES, Cluster
from tests.fixtures.policy import foreign
from tests.fixtures.services import AMQP_URL
from tests.toyjobs.toy import make_dataset

EXCHANGE = "apiary"
WORKERS = ("w1", "w2")


@dataclass
class Deployment:
    """A vhost set up by `apiary broker setup`, and each user's password."""

    vhost: str
    prefix: str
    credentials: Path
    result: SetupResult

    def user(self, role: str) -> str:
        """The broker user of a service role, or of worker `wN`."""
        return f"{self.prefix}worker.{role}" if role in WORKERS else f"{self.prefix}{role}"

    def url(self, role: str, *, password_of: str | None = None) -> str:
        """An AMQP URL logging in as `role`'s user (with another role's password if asked)."""
        passwords = broker_setup.load_credentials(self.credentials)
        parts = urlsplit(AMQP_URL)
        login = f"{quote(self.user(role), safe='')}:{quote(passwords[self.user(password_of or role)], safe='')}"
        return f"amqp://{login}@{parts.hostname}:{parts.port or 5672}/{quote(self.vhost, safe='')}"


def _listing(vhost: str, prefix: str) -> tuple[str, ...]:
    """The broker's users of this test (other tests add and remove their own meanwhile) and the vhost's grants."""
    ctl = broker_setup.rabbitmqctl
    users = "\n".join(line for line in ctl("list_users", "-q").splitlines() if line.startswith(prefix))
    return (users, ctl("list_permissions", "-p", vhost, "-q"),
            ctl("list_topic_permissions", "-p", vhost, "-q"), ctl("list_policies", "-p", vhost, "-q"))


@pytest.fixture
def deployment(tmp_path: Path, rabbit_url: str) -> Iterator[Deployment]:
    tag = uuid.uuid4().hex[:10]
    vhost, prefix = f"apiary_test_{tag}", f"apiary-test-{tag}-"
    credentials = tmp_path / broker_setup.CREDENTIALS_FILE
    result = broker_setup.setup(EXCHANGE, vhost, list(WORKERS), credentials, prefix=prefix)
    try:
        yield Deployment(vhost, prefix, credentials, result)
    finally:
        broker_setup.remove(result.users)
        broker_setup.rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
async def services_up(deployment: Deployment) -> AsyncIterator[RabbitBus]:
    """The aggregator's bus, which (as every service's) declares the whole topology as it connects."""
    bus = make_bus(deployment.url("aggregator"), exchange=EXCHANGE)
    assert isinstance(bus, RabbitBus)
    await bus.connect()
    yield bus
    await bus.close()


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that takes nothing (it is never allowed to start)."""


async def _publish_raw(url: str, routing_key: str, *, user_id: str | None = None) -> None:
    """Publish with a plain client, as a rogue process holding these credentials could."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(EXCHANGE, ensure=False)
        await exchange.publish(aio_pika.Message(b"{}", user_id=user_id), routing_key, timeout=10)
    finally:
        await connection.close()


async def test_a_worker_publishes_its_events_as_itself_and_nothing_else(
        deployment: Deployment, services_up: RabbitBus, tmp_path: Path) -> None:
    # Prepare: worker w1 started as `apiary worker` starts, on its own user
    seen: list[Delivery] = []
    got = asyncio.Event()

    async def record(delivery: Delivery) -> None:
        seen.append(delivery)
        got.set()

    subscription = await services_up.consume("aggregator", record)
    settings = Settings(home=tmp_path / "w1", heartbeat_interval=60)
    worker_bus = make_bus(deployment.url("w1"), exchange=EXCHANGE)
    await worker_bus.connect()
    worker = Worker(worker_bus, settings, worker_id="w1")
    try:
        await worker.start()

        # Execute
        await worker_bus.publish("worker.done", b"\x80")
        await asyncio.wait_for(got.wait(), 15)
        as_other = _publish_raw(deployment.url("w1"), "worker.done", user_id=deployment.user("w2"))
        off_limits = _publish_raw(deployment.url("w1"), "round.aggregated")
        with pytest.raises(AMQPError, match=r"user_id property set to '.*w2' but authenticated user was"):
            await as_other
        with pytest.raises(AMQPError, match=r"ACCESS_REFUSED.*round.aggregated"):
            await off_limits
        with pytest.raises(AMQPError, match="ACCESS_REFUSED"):
            await aio_pika.connect(deployment.url("w2", password_of="w1"))
    finally:
        await worker.stop()
        await worker_bus.close()
        await subscription.cancel()

    # Assert
    assert [(d.routing_key, d.user_id) for d in seen] == [("worker.done", deployment.user("w1"))]


@pytest.mark.parametrize("routing_key", ["assign.pool", "job.initialized", "round.evaluated", "job.requested"])
async def test_a_worker_may_not_publish_assignments_nor_the_schedulers_events(
        deployment: Deployment, services_up: RabbitBus, routing_key: str) -> None:
    # Execute / Assert: only worker.* is a worker's to publish
    with pytest.raises(AMQPError, match=rf"ACCESS_REFUSED.*{re.escape(routing_key)}"):
        await _publish_raw(deployment.url("w1"), routing_key)


async def test_a_busy_worker_passes_a_preferred_assignment_to_the_pool_on_its_own_user(
        deployment: Deployment, services_up: RabbitBus, tmp_path: Path) -> None:
    # Prepare: worker w1 on its own user, busy; what reaches it from the pool is recorded.
    scheduler = make_bus(deployment.url("scheduler"), exchange=EXCHANGE)
    await scheduler.connect()
    worker_bus = make_bus(deployment.url("w1"), exchange=EXCHANGE)
    await worker_bus.connect()
    worker = Worker(worker_bus, Settings(home=tmp_path / "w1", heartbeat_interval=60), worker_id="w1")
    pooled: list[tuple[int, str, str | None, bool]] = []
    at: list[float] = []
    pool_turn = worker.turns.pool_turn

    async def recorded(a: Assignment, delivery: Delivery, call_next: Next) -> None:
        pooled.append((a.shard, delivery.routing_key, delivery.user_id, delivery.redelivered))
        at.append(time.monotonic())
        await pool_turn(a, delivery, call_next)

    worker.turns.pool_turn = recorded  # type: ignore[method-assign]
    # Stale by the time it is trained: the worker skips it once free.
    assignment = Assignment(job_id="j1", round=2, attempt=1, job_name="j", num_rounds=2, shard=3, env={},
                            deadline=time.time() - 1)
    try:
        await worker.start()
        async with worker.slot.held():
            # Execute: the scheduler offers w1 the shard it trained last round.
            sent = time.monotonic()
            await publish_event(scheduler, assignment, routing_key=preferred_queue("w1"))
            deadline = sent + 15
            while not pooled and time.monotonic() < deadline:  # noqa: ASYNC110 - the broker gives no event
                await asyncio.sleep(0.05)
    finally:
        await worker.stop()
        await worker_bus.close()
        await scheduler.close()

    # Assert: in the pool well before the preferred queue's wait ran out, under the pool's key, still the
    # scheduler's message and no redelivery, though w1 may not publish to the pool.
    assert pooled == [(3, POOL, deployment.user("scheduler"), False)]
    assert at[0] - sent < PREFER_WAIT


async def test_a_worker_cannot_read_another_workers_queue_nor_bind_its_own_to_other_events(
        deployment: Deployment, services_up: RabbitBus) -> None:
    # Prepare: w2's pinned queue exists (the scheduler declares it before queuing an assignment there)
    await services_up.declare_queue("assign.worker.w2", ["assign.worker.w2"])
    connection = await aio_pika.connect(deployment.url("w1"))
    try:
        # Execute
        channel = await connection.channel()
        with pytest.raises(AMQPError, match=r"ACCESS_REFUSED.*assign.worker.w2"):
            queue = await channel.declare_queue(f"{EXCHANGE}.assign.worker.w2", passive=True)
            await queue.consume(_ignore)
        channel = await connection.channel()
        own = await channel.declare_queue(f"{EXCHANGE}.control.worker.w1", durable=True)
        with pytest.raises(AMQPError, match=r"ACCESS_REFUSED.*worker.done"):
            await own.bind(EXCHANGE, "worker.done")
        channel = await connection.channel()
        own = await channel.declare_queue(f"{EXCHANGE}.control.worker.w1", durable=True)
        await own.bind(EXCHANGE, "presence.pace.w1")  # the pace told to it alone; not another worker's
        with pytest.raises(AMQPError, match=r"ACCESS_REFUSED.*presence.pace.w2"):
            await own.bind(EXCHANGE, "presence.pace.w2")
        channel = await connection.channel()
        with pytest.raises(AMQPError, match="ACCESS_REFUSED"):
            await channel.queue_delete(f"{EXCHANGE}.aggregator")
    finally:
        await connection.close()

    # Assert: the aggregator's queue is still there
    assert await services_up.queue_size("aggregator") == 0


async def test_the_deployments_queues_get_the_queue_policy(deployment: Deployment, services_up: RabbitBus) -> None:
    # Execute: the services' bus declared the whole topology as it connected (services_up)
    listed = broker_setup.rabbitmqctl("list_queues", "-p", deployment.vhost, "-q", "--no-table-headers", "name",
                                      "policy")

    # Assert
    rows = dict(line.split("\t") for line in listed.strip().splitlines())
    assert "apiary.aggregator" in rows and "apiary.assign.pool" in rows
    assert set(rows.values()) == {"apiary-queues"}, rows


@pytest.mark.slow
def test_setting_up_again_changes_nothing(deployment: Deployment) -> None:
    # Prepare
    before = _listing(deployment.vhost, deployment.prefix)
    passwords = broker_setup.load_credentials(deployment.credentials)

    # Execute
    again = broker_setup.setup(EXCHANGE, deployment.vhost, list(WORKERS), deployment.credentials,
                               prefix=deployment.prefix)

    # Assert
    assert again.created == {} and again.applied["users"] == []
    assert _listing(deployment.vhost, deployment.prefix) == before
    assert broker_setup.load_credentials(deployment.credentials) == passwords
    assert len(deployment.result.created) == 4 + len(WORKERS)
    assert (deployment.credentials.stat().st_mode & 0o777) == 0o600


@pytest.mark.slow
def test_a_job_runs_with_every_process_on_its_own_broker_user(cluster: Cluster, tmp_path: Path) -> None:
    # Prepare: users for the cluster's exchange (on the default vhost), then each process started as its own
    workers, prefix = ["worker-1", "worker-2"], f"apiary-test-{uuid.uuid4().hex[:10]}-"
    credentials = tmp_path / broker_setup.CREDENTIALS_FILE
    result = broker_setup.setup(cluster.exchange, "/", workers, credentials, prefix=prefix)
    passwords = broker_setup.load_credentials(credentials)

    def login(user: str) -> dict[str, str]:
        return {"APIARY_BUS_USER": user, "APIARY_BUS_PASSWORD": passwords[user]}

    try:
        for name in SERVICES:
            cluster.start_service(name, **login(f"{prefix}{name}"))
        cluster.wait_for(lambda: all(cluster.consumers(n) for n in SERVICES), 60, "the services to consume")
        for name in workers:
            cluster.start_worker(name, **login(f"{prefix}worker.{name}"))
        cluster.wait_workers(workers)
        connected = set(broker_setup.rabbitmqctl("list_connections", "-q", "user").split())
        job_id = f"users-{uuid.uuid4().hex[:8]}"

        # Execute
        cluster.publish_job({
            "job_id": job_id, "name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "toy", 12)), "config": {"mode": "ok"},
            "distributed": {"num_rounds": 2, "min_workers": 2, "max_workers": 2}})
        job = cluster.wait_job(job_id, timeout=180)
    finally:
        cluster.stop_all()
        broker_setup.remove(result.users)
        broker_setup.remove_policy(cluster.exchange, "/")

    # Assert
    assert {u.name for u in result.users} <= connected
    assert job["status"] == "completed", job["reason"]
    trained_by = {r["worker_id"] for r in cluster.query(
        "SELECT DISTINCT worker_id FROM contributions WHERE job_id = $1 AND status = 'accepted'", job_id)}
    assert trained_by <= set(workers) and trained_by


def test_a_worker_started_before_the_services_says_so_in_one_line(deployment: Deployment, tmp_path: Path) -> None:
    # Prepare: the vhost has users but no exchange yet (no service has connected)
    env = {k: v for k, v in os.environ.items() if not foreign(k)}
    env.update({"APIARY_BUS_URL": deployment.url("w1"), "APIARY_HOME": str(tmp_path / "w1")})

    # Execute
    run = subprocess.run([sys.executable, "-m", "services.app.cli", "worker", "--id", "w1"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)

    # Assert
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("error: RabbitMQ at 127.0.0.1:5672 has no exchange 'apiary' yet: "
                                                    "start the services first (they declare it), then the workers")
    assert "Traceback" not in run.stderr


async def test_a_message_a_worker_drops_straight_into_a_service_queue_keeps_its_true_key_and_sender(
        deployment: Deployment, services_up: RabbitBus) -> None:
    # Prepare: a worker may publish to the default exchange (it dead-letters and re-holds its own deliveries)
    seen: list[Delivery] = []
    got = asyncio.Event()

    async def record(delivery: Delivery) -> None:
        seen.append(delivery)
        got.set()

    subscription = await services_up.consume("scheduler", record)
    connection = await aio_pika.connect(deployment.url("w1"))
    try:
        # Execute: a "copy" claiming to be the aggregator's round.aggregated
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(aio_pika.Message(b"{}", user_id=deployment.user("w1"), headers={
            wire.HELD_KEY_HEADER: "round.aggregated", wire.HELD_USER_HEADER: deployment.user("aggregator")}),
            f"{EXCHANGE}.scheduler")
        await asyncio.wait_for(got.wait(), 15)
    finally:
        await connection.close()
        await subscription.cancel()

    # Assert: the consumer sees where it really came from, and no handler takes it for round.aggregated
    assert [(d.routing_key, d.user_id) for d in seen] == [(f"{EXCHANGE}.scheduler", deployment.user("w1"))]
