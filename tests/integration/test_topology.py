"""On RabbitMQ: every Apiary process declares the services' whole topology when it connects, and the
exchange's alternate exchange keeps a message no queue takes in the dead-letter queue."""

from __future__ import annotations

import logging

import pytest

from apiary.bus import make_bus
from apiary.bus.base import Unroutable
from apiary.bus.layout import SERVICE_QUEUES
from apiary.bus.rabbitmq import RabbitBus
from tests.ports.test_bus import observed


async def test_a_process_bus_declares_every_service_queue_on_connect(rabbit_url: str, bus_namespace: str) -> None:
    # Prepare
    bus = make_bus(rabbit_url, exchange=bus_namespace)

    # Execute: the first process to connect publishes a job request; no service has ever started.
    await bus.connect()
    try:
        await bus.publish("job.requested", b"{}")

        # Assert: the request waits in the scheduler's queue for its first start.
        assert await observed(lambda: bus.queue_size("scheduler"), 1) == 1
        for name in SERVICE_QUEUES:
            assert await bus._topology.ready_count(bus.queue_name(name)) is not None, name  # type: ignore[attr-defined]
    finally:
        await bus.close()


async def test_a_message_no_queue_takes_is_kept_in_the_dead_letter_queue(rabbit_url: str,
                                                                      bus_namespace: str) -> None:
    # Prepare
    bus = RabbitBus(rabbit_url, exchange=bus_namespace, keep_unroutable=True)
    await bus.connect()
    try:
        await bus.declare_queue("jobs", ["job.*"])

        # Execute: no queue is bound for this key.
        await bus.publish("nobody.listens", b"kept")

        # Assert: not returned as Unroutable, nor lost: it is in the dead-letter queue.
        assert await observed(lambda: bus.queue_size("dead"), 1) == 1
        assert await bus.queue_size("jobs") == 0
    finally:
        await bus.close()


async def test_an_exchange_declared_before_without_the_alternate_is_used_as_it_is(
        rabbit_url: str, bus_namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a deployment's exchange from before this version (no alternate exchange).
    old = RabbitBus(rabbit_url, exchange=bus_namespace)
    await old.connect()
    await old.close()
    bus = RabbitBus(rabbit_url, exchange=bus_namespace, keep_unroutable=True)

    # Execute
    with caplog.at_level(logging.WARNING, logger="apiary.bus.rabbitmq"):
        await bus.connect()
    try:
        # Assert: it connects (no PRECONDITION_FAILED), says how to add the alternate, and works as before.
        assert "rabbitmqctl set_policy" in caplog.text
        await bus.declare_queue("jobs", ["job.*"])
        await bus.publish("job.requested", b"routed")
        assert await observed(lambda: bus.queue_size("jobs"), 1) == 1
        with pytest.raises(Unroutable):
            await bus.publish("nobody.listens", b"returned")
    finally:
        await bus.close()
