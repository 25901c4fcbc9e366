"""The link to RabbitMQ: one robust connection, its confirming channel with the exchange, and channels on it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractRobustChannel, AbstractRobustConnection, AbstractRobustExchange
from aiormq.exceptions import AMQPConnectionError, ChannelNotFoundEntity, ChannelPreconditionFailed

log = logging.getLogger("apiary.bus.rabbitmq")

NOT_CONNECTED = "RabbitBus is not connected: call connect() first"


def where(url: str) -> str:
    """The broker's host:port in a URL, without its credentials (for error messages)."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5672}"


def user_of(url: str) -> str:
    """The broker user a URL logs in as (aio-pika's default, `guest`, when it names none)."""
    return unquote(urlsplit(url).username or "guest")


class Connection:
    """A connection that reconnects by itself after a broker restart, restoring its channels."""

    def __init__(self, url: str, *, name: str, reconnect_interval: float) -> None:
        self.url = url
        self.name = name
        self.reconnect_interval = reconnect_interval
        self.robust: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._exchange: AbstractRobustExchange | None = None

    async def open(self, exchange: str, alternate: str | None = None) -> bool:
        """Connect, and declare the durable topic exchange on a channel with publisher confirms; with
        `alternate`, a fanout exchange of that name first, as the topic exchange's alternate exchange.
        Returns whether the exchange has it (see `declare_exchanges` for one declared before without)."""
        await self._connect()
        return await declare_exchanges(self, exchange, alternate)

    async def _connect(self) -> None:
        try:
            self.robust = await aio_pika.connect_robust(
                self.url,
                client_properties={"connection_name": self.name},
                timeout=10,
                reconnect_interval=self.reconnect_interval,
            )
        except (TimeoutError, OSError, AMQPConnectionError) as e:
            raise ConnectionError(
                f"cannot reach RabbitMQ at {where(self.url)}: {e or type(e).__name__};"
                " check APIARY_BUS_URL and that the broker is running"
            ) from e

    async def open_existing(self, exchange: str) -> None:
        """Connect, and use the exchange as the services declared it (a passive declare: for a user that may not
        declare it, such as a worker's)."""
        await self._connect()
        assert self.robust is not None
        self._channel = await self.robust.channel(publisher_confirms=True, on_return_raises=True)
        try:
            self._exchange = await self._channel.declare_exchange(exchange, passive=True)
        except ChannelNotFoundEntity:
            await self.close()
            raise ConnectionError(f"RabbitMQ at {where(self.url)} has no exchange {exchange!r} yet: start the "
                                  "services first (they declare it), then the workers") from None

    async def close(self) -> None:
        """Close the connection and every channel on it."""
        if self.robust is not None:
            with contextlib.suppress(Exception):
                await self.robust.close()
        self.robust = self._channel = self._exchange = None

    def publishing(self) -> tuple[AbstractRobustChannel, AbstractRobustExchange]:
        """The confirming channel and the exchange on it."""
        if self._channel is None or self._exchange is None:
            raise RuntimeError(NOT_CONNECTED)
        return self._channel, self._exchange

    async def consumer_channel(self) -> AbstractRobustChannel:
        """A channel of its own for one subscription (restored with its consumers after a reconnect)."""
        if self.robust is None:
            raise RuntimeError(NOT_CONNECTED)
        return await self.robust.channel(publisher_confirms=False)

    @contextlib.asynccontextmanager
    async def admin(self) -> AsyncIterator[aiormq.abc.AbstractChannel]:
        """A plain channel for calls that may fail with a channel error (it is thrown away after)."""
        if self.robust is None:
            raise RuntimeError(NOT_CONNECTED)
        await self.robust.ready()
        transport = self.robust.transport
        if transport is None:
            raise ConnectionError(f"RabbitMQ at {where(self.url)} is not connected")
        channel = await transport.connection.channel(publisher_confirms=False)
        try:
            yield channel
        finally:
            if not channel.is_closed:
                await channel.close()


async def declare_exchanges(link: Connection, exchange: str, alternate: str | None) -> bool:
    """Declare the exchange (and its alternate exchange) on a new confirming channel of `link`; whether the
    exchange has the alternate. One declared earlier without it cannot take it by redeclaring
    (PRECONDITION_FAILED): it is then used as it is, with a warning saying how to add it."""
    assert link.robust is not None
    link._channel = await link.robust.channel(publisher_confirms=True, on_return_raises=True)
    if alternate is None:
        link._exchange = await link._channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        return False
    await link._channel.declare_exchange(alternate, aio_pika.ExchangeType.FANOUT, durable=True)
    try:
        link._exchange = await link._channel.declare_exchange(
            exchange, aio_pika.ExchangeType.TOPIC, durable=True, arguments={"alternate-exchange": alternate})
        return True
    except ChannelPreconditionFailed:
        log.warning("exchange %r was declared without an alternate exchange, so a message no queue takes is "
                    "dropped: add it with `rabbitmqctl set_policy apiary-unroutable '^%s$' "
                    "'{\"alternate-exchange\":\"%s\"}' --apply-to exchanges` (see the README)",
                    exchange, exchange, alternate)
    link._channel = await link.robust.channel(publisher_confirms=True, on_return_raises=True)
    link._exchange = await link._channel.declare_exchange(exchange, passive=True)
    return False
