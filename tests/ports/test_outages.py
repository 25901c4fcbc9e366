"""Dependencies that blink (issue 22): the adapters call an outage DependencyUnavailable, and the bus's
subscribe runs the handler again in place, never dead-lettering for it.

The bus tests run on both adapters (the `bus` fixture); the database and storage tests put a proxy
between the adapter and a real PostgreSQL or S3 server and take it down, so the shared servers
themselves are never stopped.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from apiary.backoff import Backoff, while_unavailable
from apiary.bus.base import Bus, Delivery, Unroutable
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import Raw, subscribe
from apiary.contracts import JobFailed, decode, encode
from apiary.db.base import DatabaseUnavailable
from apiary.db.postgres import PostgresDatabase
from apiary.db.sqlite import SqliteDatabase
from apiary.errors import DependencyUnavailable
from apiary.outbox import Outbox, outbox_migration
from apiary.storage.base import StorageUnavailable
from apiary.storage.s3 import S3Storage
from tests.fixtures.s3front import S3Front
from tests.fixtures.tcpproxy import TcpProxy
from tests.ports.test_bus import DEADLINE, Recorder, consuming, eventually

QUICK = Backoff(base=0.01, cap=0.05)
log = logging.getLogger("tests.outages")


class Blinking:
    """A handler whose database is away for its first `away` calls; it records each call."""

    def __init__(self, away: int) -> None:
        self.away = away
        self.calls: list[bytes] = []
        self.deliveries: list[Delivery] = []

    async def __call__(self, delivery: Delivery) -> None:
        self.calls.append(delivery.body)
        self.deliveries.append(delivery)
        if delivery.body == b"first" and self.calls.count(b"first") <= self.away:
            raise DatabaseUnavailable("database restarting", dependency="PostgreSQL at test", reason="restarting")


# --- The bus: retried in place, never dead-lettered ------------------------------------------------


async def test_a_handler_whose_dependency_is_away_runs_again_in_place_and_is_acked_once(bus: Bus) -> None:
    # Prepare: one consumer slot; its handler's database is away for three tries.
    handler, dead = Blinking(away=3), Recorder()
    sub = await subscribe(bus, "aggregator", {"worker.done": Raw(handler)}, prefetch=1, retry=QUICK)

    # Execute: a second message arrives while the first waits for its database.
    async with consuming(bus, "dead", dead):
        await bus.publish("worker.done", b"first")
        await eventually(lambda: len(handler.calls) >= 2, "the first retry")
        await bus.publish("worker.done", b"second")
        await eventually(lambda: handler.calls[-1:] == [b"second"], "the second message")
        await sub.cancel()

    # Assert: four tries of the same delivery (not redeliveries), then the second behind them; the
    # queue is empty (each acked once) and nothing was dead-lettered.
    assert handler.calls == [b"first"] * 4 + [b"second"]
    assert not any(d.redelivered for d in handler.deliveries)
    assert await bus.queue_size("aggregator") == 0
    assert dead.seen == [] and await bus.queue_size("dead") == 0


async def test_stopping_while_a_handler_waits_returns_its_message_to_the_queue(bus: Bus) -> None:
    # Prepare: a handler whose dependency never comes back while the first consumer runs.
    waiting = Blinking(away=10**6)
    first = await subscribe(bus, "aggregator", {"worker.done": Raw(waiting)}, prefetch=1, retry=QUICK)
    await bus.publish("worker.done", b"first")
    await eventually(lambda: len(waiting.calls) >= 2, "the handler to be waiting")

    # Execute: the service stops, and another takes over once the dependency is back.
    await asyncio.wait_for(first.cancel(), DEADLINE)
    recovered = Recorder()
    async with consuming(bus, "aggregator", recovered):
        await eventually(lambda: len(recovered.seen) == 1, "the next consumer to get it")

    # Assert
    assert recovered.bodies == [b"first"]
    assert await bus.queue_size("dead") == 0


async def test_a_decoded_event_handler_is_retried_in_place_too(bus: Bus) -> None:
    # Prepare: an event handler whose storage is away twice.
    tries: list[str] = []

    async def on_job_failed(event: JobFailed, delivery: Delivery) -> None:
        tries.append(event.job_id)
        if len(tries) <= 2:
            raise StorageUnavailable("S3 503", dependency="S3 bucket 'b'", reason="SlowDown")

    sub = await subscribe(bus, "aggregator", {"job.failed": on_job_failed}, retry=QUICK)

    # Execute
    await bus.publish("job.failed", encode(JobFailed(job_id="j1", reason="cancelled")))
    await eventually(lambda: len(tries) == 3, "the third try")
    await sub.cancel()

    # Assert
    assert tries == ["j1"] * 3
    assert await bus.queue_size("dead") == 0


async def test_unroutable_is_not_a_dependency_outage(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("jobs", ["job.*"])

    # Execute / Assert: no queue for the key is the consumer's absence, not the broker's.
    with pytest.raises(Unroutable) as raised:
        await bus.publish("worker.done", b"lost")
    assert not isinstance(raised.value, DependencyUnavailable)


# --- PostgreSQL: connections refused and cut ---------------------------------------------------------


def _through(url: str, address: str) -> str:
    parts = urlsplit(url)
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=credentials + address))


async def test_postgres_going_away_is_database_unavailable_and_work_resumes_when_it_is_back(
        postgres_url: str) -> None:
    # Prepare: the adapter reaches PostgreSQL through a proxy, with a connection already open.
    with TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy:
        db = PostgresDatabase(_through(postgres_url, proxy.address), connect_timeout=2.0)
        await db.connect()
        try:
            await db.execute("CREATE TABLE t (v BIGINT)")

            # Execute: the server goes away (open connections cut, new ones refused).
            proxy.down()
            with pytest.raises(DatabaseUnavailable) as cut:
                await db.execute("INSERT INTO t (v) VALUES ($1)", 1)
            with pytest.raises(DatabaseUnavailable) as refused:
                async with db.transaction() as tx:
                    await tx.execute("INSERT INTO t (v) VALUES ($1)", 1)
            waited = asyncio.create_task(while_unavailable(
                lambda: db.execute("INSERT INTO t (v) VALUES ($1)", 2), QUICK, "test insert", log))
            await asyncio.sleep(0.3)  # the outage lasts a while; the insert keeps trying meanwhile
            proxy.up()
            await asyncio.wait_for(waited, DEADLINE)

            # Assert: both failures name the server; the pool made new connections on its own.
            assert cut.value.dependency == refused.value.dependency == f"PostgreSQL at {proxy.address}/" + \
                urlsplit(postgres_url).path.lstrip("/")
            assert await db.fetch("SELECT v FROM t") == [{"v": 2}]
        finally:
            await db.close()


# --- S3: answering 503 SlowDown, frozen -------------------------------------------------------------


async def test_s3_shedding_load_is_storage_unavailable(s3_server: str, s3_url: str) -> None:
    # Prepare
    with S3Front(s3_server) as front:
        s3 = S3Storage(s3_url, endpoint_url=front.endpoint)
        await s3.ensure_bucket()
        await s3.put_bytes("a", b"1")

        # Execute: every request is answered 503 SlowDown (botocore's own retries included).
        front.slow_down()
        with pytest.raises(StorageUnavailable) as raised:
            await s3.get_bytes("a")
        front.resume()

        # Assert: the outage names the bucket; afterwards the same call works.
        assert "SlowDown" in raised.value.reason and s3.bucket in raised.value.dependency
        assert await s3.get_bytes("a") == b"1"


# --- The outbox: events committed while the broker is away ------------------------------------------


class _BrokerAway(MemoryBus):
    """An in-memory bus whose broker is away until `back` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.back = False

    async def _publish(self, message: Delivery, delay: float | None) -> None:
        if not self.back:
            raise ConnectionRefusedError("broker restarting")
        await super()._publish(message, delay)


async def test_events_committed_while_the_broker_is_away_are_published_once_it_is_back(tmp_path: Path) -> None:
    # Prepare: a service's outbox holding two committed events; the broker is away.
    db, bus = SqliteDatabase(str(tmp_path / "svc.db")), _BrokerAway()
    await db.connect()
    await db.migrate("svc", [outbox_migration("svc_outbox")])
    await bus.declare_queue("tracker", ["job.failed"])
    outbox = Outbox(db, bus, "svc_outbox", retry=QUICK)
    async with db.transaction() as tx:
        await outbox.add(tx, JobFailed(job_id="j1", reason="first"))
        await outbox.add(tx, JobFailed(job_id="j2", reason="second"))
    received = Recorder()
    try:
        # Execute: the flush after the commit meets the outage; later the broker returns.
        published = await outbox.flush()
        kept = await db.fetchval("SELECT COUNT(*) FROM svc_outbox")
        bus.back = True
        async with consuming(bus, "tracker", received):
            await eventually(lambda: len(received.seen) == 2, "both events from the background flush")

        # Assert: nothing lost or raised to the caller; published in order once back; none left.
        assert (published, kept) == (0, 2)
        assert [decode("job.failed", d.body).job_id for d in received.seen] == ["j1", "j2"]
        assert await db.fetchval("SELECT COUNT(*) FROM svc_outbox") == 0
    finally:
        await outbox.close()
        await bus.close()
        await db.close()
