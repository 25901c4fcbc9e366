"""The bus adapters' messaging metrics (OpenTelemetry's messaging conventions), on the in-memory bus and RabbitMQ:
every publish and every handled delivery counted once, with its outcome, under bounded destination names."""

from __future__ import annotations

import asyncio

import pytest

from apiary.bus.base import Bus, Delivery, Poison, Unroutable
from apiary.bus.rabbitmq import RabbitBus
from tests.fixtures.metrics import Readings
from tests.ports.test_bus import eventually


async def test_publishes_and_handled_deliveries_are_counted_by_destination_and_outcome(bus: Bus,
                                                                                       readings: Readings) -> None:
    system = "rabbitmq" if isinstance(bus, RabbitBus) else "apiary.memory"
    await bus.declare_queue("orders", ["order.*", "assign.worker.#"])
    handled: list[str] = []

    async def handler(delivery: Delivery) -> None:
        handled.append(delivery.routing_key)
        if delivery.routing_key == "order.bad":
            raise Poison("never valid")

    await bus.consume("orders", handler, prefetch=4)
    for i in range(5):
        await bus.publish("order.placed", b"%d" % i)
    await bus.publish("order.bad", b"x")
    for worker in ("w1", "w2", "w3"):
        await bus.publish(f"assign.worker.{worker}", b"task")
    await eventually(lambda: len(handled) == 9, "every delivery to be handled")
    await asyncio.sleep(0)  # the last handler's outcome is counted as it is settled

    assert readings.total("messaging.client.sent.messages", messaging__system=system,
                          messaging__destination__name="order.placed") == 5
    # One series for the three workers' routing keys, not one per worker.
    sent_to_workers = [a for a, _ in readings.points("messaging.client.sent.messages")
                       if a["messaging.destination.name"].startswith("assign.worker")]
    assert [a["messaging.destination.name"] for a in sent_to_workers] == ["assign.worker.*"]
    await eventually(lambda: readings.total("messaging.client.consumed.messages") == 9, "9 deliveries counted")
    queue = bus.queue_name("orders") if isinstance(bus, RabbitBus) else "orders"
    assert readings.total("messaging.client.consumed.messages", messaging__destination__name=queue,
                          messaging__rabbitmq__destination__routing_key="order.placed") == 5
    assert readings.total("messaging.client.consumed.messages", error__type="dead") == 1
    assert readings.total("apiary.messages.dead_lettered", messaging__destination__name=queue) == 1
    assert readings.total("messaging.process.duration",
                          messaging__rabbitmq__destination__routing_key="order.placed") == 5


async def test_a_publish_nothing_is_bound_for_counts_as_an_error(bus: Bus, readings: Readings) -> None:
    await bus.declare_queue("orders", ["order.*"])

    with pytest.raises(Unroutable):
        await bus.publish("nobody.listens", b"x")

    assert readings.total("messaging.client.sent.messages", error__type="Unroutable",
                          messaging__destination__name="nobody.listens") == 1
    assert readings.total("messaging.client.sent.messages", messaging__destination__name="order.placed") == 0
