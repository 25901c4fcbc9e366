"""Choose a bus adapter from a URL."""

from __future__ import annotations

from apiary.bus.base import Bus
from apiary.bus.layout import SERVICE_QUEUES


def make_bus(url: str, *, exchange: str = "apiary", queue_type: str = "classic", delivery_limit: int = 20,
             ) -> Bus:
    """`memory://` for the in-process bus, `amqp://...` for RabbitMQ; either declares the whole topology of
    the services (apiary.bus.layout) when it connects. `queue_type` and `delivery_limit`: RabbitMQ's (see
    apiary.bus.rabbitmq.topology)."""
    bus: Bus
    if url.startswith("memory:"):
        from apiary.bus.memory import MemoryBus

        bus = MemoryBus()
    elif url.startswith(("amqp://", "amqps://")):
        from apiary.bus.rabbitmq import RabbitBus

        bus = RabbitBus(url, exchange=exchange, keep_unroutable=True, queue_type=queue_type,
                        delivery_limit=delivery_limit)
    else:
        raise ValueError(f"APIARY_BUS_URL {url!r} is not supported: use memory:// or amqp://user:pass@host/")
    bus.layout = SERVICE_QUEUES
    return bus
