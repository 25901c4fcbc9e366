"""The bus port suite again on RabbitMQ quorum queues (`APIARY_QUEUE_TYPE=quorum`), and what only they do.

The tests of tests/ports/test_bus.py marked `queue_types` (what a queue does with a message: expiry, redelivery,
dead-lettering, delays, returning a consumer's held messages) run here once more, on a bus that declares quorum
queues; routing, headers and the client's own behaviour do not depend on the queue type and run once. The memory
bus has no queue types, so it is not repeated.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import pytest

from apiary.bus.base import Bus, Delivery, PassOn, Reroute, Retryable
from apiary.bus.rabbitmq import RabbitBus
from tests.fixtures.services import rabbitmqctl
from tests.ports import test_bus
from tests.ports.test_bus import Recorder, consuming, eventually


def _depends_on_queue_type(test: object) -> bool:
    return any(mark.name == "queue_types" for mark in getattr(test, "pytestmark", []))


# The suite's queue-type tests, collected here as this module's own (pytest collects every test_* name of a module).
globals().update({name: test for name, test in vars(test_bus).items()
                  if name.startswith("test_") and _depends_on_queue_type(test)})

QuorumBus = functools.partial(RabbitBus, queue_type="quorum")


@pytest.fixture
async def bus(rabbit_url: str, bus_namespace: str) -> AsyncIterator[Bus]:
    """The suite's bus, on quorum queues."""
    adapter = QuorumBus(rabbit_url, exchange=bus_namespace, retry_delay=0.2)
    await adapter.connect()
    yield adapter
    await adapter.close()


@pytest.fixture(autouse=True)
def _rabbit_only_section_on_quorum(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's RabbitMQ-only tests build their bus with `test_bus.RabbitBus`: make that a quorum one."""
    monkeypatch.setattr(test_bus, "RabbitBus", QuorumBus)


def queue_types(namespace: str) -> dict[str, str]:
    """Each queue of the namespace and its type, as the broker lists them."""
    rows = rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "type")
    types = {}
    for line in rows.splitlines():
        name, _, kind = line.strip().rpartition("\t")
        if name.startswith(f"{namespace}."):
            types[name.removeprefix(f"{namespace}.")] = kind
    return types


async def test_every_queue_is_a_quorum_queue(bus: Bus, bus_namespace: str) -> None:
    # Prepare / Execute: a port queue, the dead-letter queue (on connect) and a delay queue.
    await bus.declare_queue("scheduler", ["job.*"])
    await bus.publish("job.requested", b"later", delay=60)

    # Assert
    assert queue_types(bus_namespace) == {"scheduler": "quorum", "dead": "quorum",
                                          "delay.60000.job.requested": "quorum"}


async def test_a_message_whose_consumer_dies_past_the_delivery_limit_is_dead_lettered(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a delivery limit of 2, and a message that kills each consumer that takes it.
    survivor = QuorumBus(rabbit_url, exchange=bus_namespace, delivery_limit=2)
    await survivor.connect()
    await survivor.declare_queue("work", ["work"])
    await survivor.publish("work", b"crashes-its-consumer", headers={"job_id": "j1"})

    # Execute: three consumers die holding it (their connection goes, nothing is settled).
    await _die_holding(rabbit_url, bus_namespace, "work", 3)

    # Assert: the broker dead-lettered it into the dead-letter queue; nothing is left to deliver.
    try:
        await eventually(lambda: survivor.queue_size("dead"), "the dead letter")
        recorder = Recorder()
        async with consuming(survivor, "dead", recorder):
            await eventually(lambda: len(recorder.seen) == 1, "the dead letter to be read")
        assert recorder.bodies == [b"crashes-its-consumer"]
        assert recorder.seen[0].headers == {"job_id": "j1"}
        assert await survivor.queue_size("work") == 0
    finally:
        await survivor.close()


async def test_a_retryable_requeued_more_often_than_the_delivery_limit_is_still_handled(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a delivery limit of 1, and a handler whose dependency is away for its first four tries.
    bus = QuorumBus(rabbit_url, exchange=bus_namespace, delivery_limit=1, retry_delay=0.05)
    await bus.connect()
    tries: list[bool] = []

    async def waits_for_a_dependency(delivery: Delivery) -> None:
        tries.append(delivery.redelivered)
        if len(tries) <= 4:
            raise Retryable("the database is away")

    try:
        await bus.declare_queue("aggregator", ["worker.done"])
        async with consuming(bus, "aggregator", waits_for_a_dependency):
            # Execute
            await bus.publish("worker.done", b"report")
            await eventually(lambda: len(tries) == 5, "the fifth try")

        # Assert: handled on the fifth try, never dead-lettered.
        assert tries == [False, True, True, True, True]
        assert await bus.queue_size("dead") == 0
        assert await bus.queue_size("aggregator") == 0
    finally:
        await bus.close()


async def test_a_queue_declared_as_the_other_type_is_refused_in_one_line(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a classic deployment declared the scheduler's queue.
    classic = RabbitBus(rabbit_url, exchange=bus_namespace)
    await classic.connect()
    await classic.declare_queue("scheduler", ["job.*"])
    await classic.close()
    quorum = QuorumBus(rabbit_url, exchange=bus_namespace)

    # Execute / Assert: a process given quorum queues says what to do.
    try:
        with pytest.raises(ValueError, match="same APIARY_QUEUE_TYPE") as refused:
            await quorum.connect()  # the dead-letter queue, declared classic above, is the first refusal
        assert "\n" not in str(refused.value)
    finally:
        await quorum.close()


async def _die_holding(rabbit_url: str, namespace: str, queue: str, times: int) -> None:
    """`times` consumers in turn take the queue's first message and die holding it (their connection goes)."""
    for _ in range(times):
        taken = asyncio.Event()

        async def hangs(delivery: Delivery, taken: asyncio.Event = taken) -> None:
            taken.set()
            await asyncio.Event().wait()

        dying = QuorumBus(rabbit_url, exchange=namespace, delivery_limit=2)
        await dying.connect()
        await dying.consume(queue, hangs, prefetch=1)
        await asyncio.wait_for(taken.wait(), test_bus.DEADLINE)
        assert dying._connection is not None
        await dying._connection.close()


async def test_a_message_passed_on_starts_a_fresh_delivery_count_where_it_is_rerouted(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a delivery limit of 2; a preferred assignment whose consumers died twice holding it.
    bus = QuorumBus(rabbit_url, exchange=bus_namespace, delivery_limit=2)
    await bus.connect()
    try:
        await bus.declare_queue("prefer.w1", ["assign.prefer.w1"], reroute=Reroute(after=60, to="assign.pool"))
        await bus.declare_queue("pool", ["assign.pool"])
        await bus.publish("assign.prefer.w1", b"assignment")
        await _die_holding(rabbit_url, bus_namespace, "prefer.w1", 2)

        # Execute: its third consumer passes it on; in the pool, one consumer dies holding it, and the next
        # handles it.
        async def busy(delivery: Delivery) -> None:
            raise PassOn("busy")

        async with consuming(bus, "prefer.w1", busy):
            await eventually(lambda: bus.queue_size("pool"), "the assignment in the pool")
        await _die_holding(rabbit_url, bus_namespace, "pool", 1)
        recorder = Recorder()
        async with consuming(bus, "pool", recorder):
            await eventually(lambda: len(recorder.seen) == 1, "the assignment handled from the pool")

        # Assert: the preferred queue's deliveries did not count in the pool: handled, not dead-lettered.
        assert recorder.bodies == [b"assignment"]
        assert await bus.queue_size("dead") == 0
    finally:
        await bus.close()
