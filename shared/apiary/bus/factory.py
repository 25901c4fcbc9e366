"""Choose a bus adapter from a URL."""

from __future__ import annotations

from apiary.bus.base import Bus


def make_bus(url: str, *, exchange: str = "apiary") -> Bus:
    """`memory://` for the in-process bus, `amqp://...` for RabbitMQ."""
    if url.startswith("memory:"):
        from apiary.bus.memory import MemoryBus

        return MemoryBus()
    if url.startswith(("amqp://", "amqps://")):
        from apiary.bus.rabbitmq import RabbitBus

        return RabbitBus(url, exchange=exchange)
    raise ValueError(f"APIARY_BUS_URL {url!r} is not supported: use memory:// or amqp://user:pass@host/")
