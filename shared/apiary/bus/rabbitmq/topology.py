"""Where messages wait on the broker: the port's durable queues, a queue per delay, and private hold queues.

Names: a logical queue `name` is the durable queue `{exchange}.{name}`; dead letters go to `{exchange}.dead`
through the default exchange; a delayed publish waits in `{exchange}.delay.{ms}.{routing_key}` (a queue per
delay value, since RabbitMQ only expires the head of a queue) and dead-letters into the exchange when its TTL
runs out; a re-held delivery waits in `{exchange}.hold.<uuid>` (see `rehold`).

Queue type: `classic`, or `quorum` (RabbitMQ's replicated queue, for a cluster): then every queue declared here
is a quorum queue, and a port queue's message delivered more than `delivery_limit` times (its consumers keep
dying on it) is dead-lettered: into the dead-letter queue, or where the queue reroutes (a reroute queue has one
dead-letter target). All are durable, none exclusive or auto-delete, none with a priority: quorum queues take
the same TTL, dead-letter and expiry arguments.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from aio_pika.abc import AbstractRobustChannel, AbstractRobustQueue
from aiormq.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed

from apiary.bus.base import DEAD_LETTER_QUEUE, Reroute
from apiary.bus.layout import UNROUTABLE
from apiary.bus.rabbitmq.connection import Connection

log = logging.getLogger("apiary.bus.rabbitmq")

_MAX_NAME_BYTES = 255  # AMQP's limit on a queue name
QUEUE_TYPES = ("classic", "quorum")


def milliseconds(seconds: float) -> int:
    """A duration as the broker takes it: whole milliseconds, at least one."""
    return max(1, round(seconds * 1000))


def queue_arguments(exchange: str, expires: float | None, reroute: Reroute | None) -> dict[str, Any] | None:
    """The arguments of a port queue: its idle expiry, and where a message no consumer took in time goes."""
    arguments: dict[str, Any] = {}
    if expires is not None:
        arguments["x-expires"] = milliseconds(expires)
    if reroute is not None:
        # RabbitMQ expires a message only at the head of its queue: fine for these queues, whose
        # messages all wait the same time.
        arguments.update({"x-message-ttl": milliseconds(reroute.after),
                          "x-dead-letter-exchange": exchange, "x-dead-letter-routing-key": reroute.to})
    return arguments or None


def type_arguments(queue_type: str, delivery_limit: int | None = None) -> dict[str, Any]:
    """The arguments that make a queue of this type (none for classic); a quorum queue's delivery limit."""
    if queue_type not in QUEUE_TYPES:
        raise ValueError(f"queue type {queue_type!r} is not supported: expected one of {', '.join(QUEUE_TYPES)}")
    if queue_type == "classic":
        return {}
    arguments: dict[str, Any] = {"x-queue-type": "quorum"}
    if delivery_limit is not None:
        arguments["x-delivery-limit"] = delivery_limit
    return arguments


def delay_queue(exchange: str, routing_key: str, delay: float) -> tuple[str, dict[str, Any]]:
    """The name and arguments of the queue where a message for `routing_key` waits `delay` seconds."""
    ms = milliseconds(delay)
    name = f"{exchange}.delay.{ms}.{routing_key}"
    if len(name.encode()) > _MAX_NAME_BYTES:
        raise ValueError(f"delay queue name {name[:60]!r}… is over 255 bytes: use a shorter routing key")
    # The queue goes once idle well past its TTL; each delayed publish redeclares it, renewing that.
    return name, {"x-message-ttl": ms, "x-dead-letter-exchange": exchange,
                  "x-dead-letter-routing-key": routing_key, "x-expires": ms + 600_000}


# The shortest life of a held copy: the time between publishing a copy to its hold queue and fetching it back must
# stay under it, or the copy expires back to the origin queue while the original is still held (a second delivery
# of the same message). On a loaded 2-core machine that round trip took over a second.
HOLD_TTL_MIN = 5.0


def hold_arguments(origin: str, every: float, ttl: float | None = None) -> dict[str, Any]:
    """The arguments of a hold queue re-held every `every` seconds: a copy left there by a dead process expires
    back to `origin` within its TTL (`ttl`, or `every`, within 5..30 s; at once if it was held longer)."""
    return {
        "x-message-ttl": round(min(max(every if ttl is None else ttl, HOLD_TTL_MIN), 30.0) * 1000),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": origin,
        "x-expires": round((3 * every + 60) * 1000),
    }


class Topology:
    """Declares, counts, purges and deletes the queues of one exchange, remembering those it declared."""

    def __init__(self, connection: Connection, exchange: str, *, queue_type: str = "classic",
                 delivery_limit: int = 20) -> None:
        type_arguments(queue_type)  # refuses an unknown type now, not at the first declare
        self._connection = connection
        self.exchange = exchange
        self.queue_type, self.delivery_limit = queue_type, delivery_limit
        self.declared: set[str] = set()
        self.rerouting: set[str] = set()  # the port queues declared with a reroute (a rejection goes there)

    def queue_name(self, name: str) -> str:
        """The broker's name for a logical queue."""
        return f"{self.exchange}.{name}"

    @property
    def unroutable_exchange(self) -> str:
        """The fanout exchange that takes what the exchange cannot route (its alternate exchange)."""
        return f"{self.exchange}.{UNROUTABLE}"

    async def bind_unroutable(self) -> None:
        """Bind the dead-letter queue to the alternate exchange: an unroutable message is kept there."""
        channel, _ = self._connection.publishing()
        # Passive: declared just before, with the arguments of its type (a quorum queue refuses a redeclare without).
        queue = await channel.declare_queue(self.queue_name(DEAD_LETTER_QUEUE), passive=True)
        await queue.bind(self.unroutable_exchange, "")

    async def declare(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                      reroute: Reroute | None = None) -> None:
        """Declare a port queue, durable, bound to the exchange with these topic patterns."""
        channel, exchange = self._connection.publishing()
        arguments = {**(queue_arguments(self.exchange, expires, reroute) or {}), **self._limit(name, reroute)}
        try:
            queue = await channel.declare_queue(self.queue_name(name), durable=True, arguments=arguments or None)
        except ChannelPreconditionFailed as e:
            raise ValueError(
                f"queue {self.queue_name(name)!r} exists with other arguments ({e.args[0] if e.args else e}):"
                f" give every process of the deployment the same APIARY_QUEUE_TYPE (here {self.queue_type}) and"
                f" APIARY_QUEUE_DELIVERY_LIMIT (here {self.delivery_limit}), or delete the queue") from None
        self.declared.add(queue.name)
        if reroute is not None:
            self.rerouting.add(queue.name)
        for pattern in bindings:
            await queue.bind(exchange, pattern)

    def _limit(self, name: str, reroute: Reroute | None) -> dict[str, Any]:
        """The type arguments of a port queue: a quorum one (but the dead-letter queue) dead-letters a message
        past the delivery limit, to the dead-letter queue unless it reroutes."""
        if self.queue_type == "classic" or name == DEAD_LETTER_QUEUE:
            return type_arguments(self.queue_type)
        arguments = type_arguments(self.queue_type, self.delivery_limit)
        if reroute is None:
            arguments.update({"x-dead-letter-exchange": "",
                              "x-dead-letter-routing-key": self.queue_name(DEAD_LETTER_QUEUE)})
        return arguments

    async def declare_delay(self, routing_key: str, delay: float) -> str:
        """Declare (again: that renews its expiry) the queue a delayed message waits in; return its name."""
        name, arguments = delay_queue(self.exchange, routing_key, delay)
        arguments.update(type_arguments(self.queue_type))
        channel, _ = self._connection.publishing()
        await channel.declare_queue(name, durable=True, robust=False, arguments=arguments)
        self.declared.add(name)
        return name

    async def declare_hold(self, channel: AbstractRobustChannel, origin: str, every: float,
                           ttl: float | None = None) -> AbstractRobustQueue:
        """Declare a private queue on `channel` to re-hold a delivery of `origin` through (`hold_arguments`)."""
        name = f"{self.exchange}.hold.{uuid.uuid4().hex}"
        arguments = {**hold_arguments(origin, every, ttl), **type_arguments(self.queue_type)}
        queue = await channel.declare_queue(name, durable=True, robust=False, arguments=arguments)
        self.declared.add(name)
        return queue

    async def ready_count(self, name: str) -> int | None:
        """How many messages are ready in the broker's queue `name`; None if there is no such queue."""
        async with self._connection.admin() as channel:
            try:
                ok = await channel.queue_declare(name, passive=True)
            except ChannelNotFoundEntity:
                return None
            return int(ok.message_count or 0)

    async def purge(self, queue: str) -> int:
        """Drop the ready messages of a logical queue; return how many."""
        async with self._connection.admin() as channel:
            try:
                ok = await channel.queue_purge(self.queue_name(queue))
            except ChannelNotFoundEntity:
                raise ValueError(f"queue {queue!r} is not declared") from None
            return int(ok.message_count or 0)

    async def delete(self, name: str) -> None:
        """Delete the broker's queue `name`; a failure is only logged (it expires or is swept later)."""
        async with self._connection.admin() as channel:
            try:
                await channel.queue_delete(name)
                self.declared.discard(name)
            except Exception as e:
                log.warning("could not delete queue %s: %s", name, e)

    async def delete_all(self) -> None:
        """Delete every queue declared here, the dead-letter queue and the exchange."""
        for name in sorted(self.declared | {self.queue_name(DEAD_LETTER_QUEUE)}):
            await self.delete(name)
        async with self._connection.admin() as channel:
            await channel.exchange_delete(self.exchange)
            await channel.exchange_delete(self.unroutable_exchange)
