"""What every bus adapter provides, and the one place that decides ack, requeue or dead-letter."""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from apiary import metrics
from apiary.contracts import MSGPACK, DecodeError
from apiary.errors import DependencyUnavailable

log = logging.getLogger("apiary.bus")

DEAD_LETTER_QUEUE = "dead"
REASON_HEADER = "x-apiary-reason"
ORIGINAL_KEY_HEADER = "x-apiary-routing-key"


class Retryable(Exception):
    """The handler could not finish now (a dependency is down); deliver the message again later."""


class Poison(Exception):
    """The message can never be handled; dead-letter it with this reason."""


class Decline(Exception):
    """Not for this consumer now: the message goes back to its queue at once, for another consumer
    (pause the subscription first, or it may come straight back)."""


class PassOn(Exception):
    """Not for this consumer: the message goes at once where its queue reroutes (`Reroute.to`), as if no
    consumer had taken it in time (on RabbitMQ the broker dead-letters the rejected delivery there, so the
    consumer needs no permission to publish under that key). A queue without a reroute dead-letters it."""


class Unroutable(Retryable):
    """A publish matched no queue (its consumer is not running): it would have been lost.

    A handler that hits it is retried later, like any other dead dependency.
    """


class BrokerUnavailable(DependencyUnavailable):
    """A publish could not reach the broker (connection lost, no confirm in time): not the message's fault.

    Unlike Unroutable, the broker is away, not the consumer: waiting for it is the cure.
    """


class Outcome(enum.Enum):
    """What happens to a delivery after its handler ran."""

    ACK = "ack"
    REQUEUE = "requeue"
    REROUTE = "reroute"  # to the queue's reroute target now (PassOn)
    DEAD = "dead"


def decide(error: BaseException | None, redelivered: bool) -> tuple[Outcome, str | None]:
    """Ack, requeue or dead-letter, by exception type: the only place this is decided.

    Only a message that can never succeed is dead-lettered: a dependency being away (DependencyUnavailable,
    Retryable) is never the message's fault, however often it is delivered.
    """
    if error is None:
        return Outcome.ACK, None
    if isinstance(error, DecodeError | Poison):
        return Outcome.DEAD, str(error)
    if isinstance(error, PassOn):
        return Outcome.REROUTE, str(error)
    if isinstance(error, Decline | Retryable | DependencyUnavailable):
        return Outcome.REQUEUE, str(error)
    if redelivered:
        return Outcome.DEAD, f"handler failed twice: {type(error).__name__}: {error}"
    return Outcome.REQUEUE, f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Reroute:
    """Where a queue's messages go when no consumer takes them in time: published again under `to`."""

    after: float
    to: str


class Kept(ABC):
    """A delivery kept past its handler (`Delivery.keep`): it stays the consumer's, yet holds none of its prefetch
    slots; should the consumer's process die before `release`, the broker gives it back to its queue, marked
    `returned`."""

    @abstractmethod
    async def release(self) -> None:
        """Done with it: it is settled (acked) and never comes back. Safe to call twice, and after the broker
        connection was lost (the delivery has gone back to its queue then)."""


class NothingKept(Kept):
    """What an adapter keeps in a process that nothing outlives (the memory bus): its queues die with it."""

    async def release(self) -> None:
        return None


@dataclass
class Delivery:
    """One message as a consumer receives it."""

    routing_key: str
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    content_type: str | None = MSGPACK
    message_id: str | None = None
    redelivered: bool = False
    # Who published it, as the broker vouches (RabbitMQ checks `user_id` against the connection's user;
    # the memory bus stamps its own user): None when the publisher did not say (other systems, old messages).
    user_id: str | None = None
    # Whether the broker keeps it across its own restart (on disk); a heartbeat, which the next one replaces, is not.
    persistent: bool = True
    # Whether it came back to its queue from a consumer that was lost while it held or kept it (its process died or
    # its connection went; the broker cannot tell which), as opposed to one handed on or requeued by a live one.
    returned: bool = False
    # How the adapter keeps it past the handler (see `keep`); None where nothing outlives the process.
    keeper: Callable[[], Awaitable[Kept]] | None = field(default=None, repr=False, compare=False)

    async def keep(self) -> Kept:
        """Keep this delivery past its handler's return, until `Kept.release`: the handler's return frees its
        consumer's slot for the next message as usual, but the delivery returns to its queue if the process dies
        first, marked `returned`. For work that goes on beside the next message and that another consumer must
        learn of if it is lost (a worker's secure shard waiting for the round's shares)."""
        return NothingKept() if self.keeper is None else await self.keeper()


Handler = Callable[[Delivery], Awaitable[None]]


def judge(error: BaseException | None, delivery: Delivery, queue: str, logger: logging.Logger, *,
          system: str, started: float) -> tuple[Outcome, str | None]:
    """`decide`, logged alike by every adapter: a requeue as a warning (a Decline, a consumer handing
    a message on, is routine), a dead letter as an error; and counted, with the handler's time since
    `started` (time.perf_counter()), in the messaging metrics of `system`."""
    outcome, reason = decide(error, delivery.redelivered)
    metrics.message_handled(system, queue, delivery.routing_key, outcome.value, started)
    if outcome is Outcome.REROUTE:
        logger.debug("reroute %s from %s: %s", delivery.routing_key, queue, reason)
    elif outcome is Outcome.REQUEUE:
        (logger.debug if isinstance(error, Decline) else logger.warning)(
            "requeue %s on %s: %s", delivery.routing_key, queue, reason)
    elif outcome is Outcome.DEAD:
        logger.error("dead-letter %s from %s: %s", delivery.routing_key, queue, reason)
    return outcome, reason


def dead_letter_headers(delivery: Delivery, reason: str) -> dict[str, Any]:
    """The headers of a message going to the dead-letter queue: why, and under which routing key it came."""
    return {**delivery.headers, REASON_HEADER: reason, ORIGINAL_KEY_HEADER: delivery.routing_key}


class Subscription(ABC):
    """A running consumer; cancel it to stop taking messages."""

    @abstractmethod
    async def cancel(self) -> None:
        """Stop consuming; messages not yet acked go back to the queue."""

    @abstractmethod
    async def pause(self) -> None:
        """Take no new message until `resume` (those being handled go on); the queue keeps the rest
        for other consumers."""

    @abstractmethod
    async def resume(self) -> None:
        """Take messages again after `pause`."""


class Bus(ABC):
    """A topic exchange with durable queues, manual acks, dead letters and delayed publish.

    Queue names are logical (`scheduler`, `assign.pool`, `dead`): an adapter may namespace them
    (RabbitMQ prefixes them with the exchange name so several deployments can share a broker).
    """

    # What `_publish` raises when the broker is away; `publish` raises BrokerUnavailable for them. An
    # adapter adds its client's own connection and channel errors.
    unavailable: tuple[type[Exception], ...] = (ConnectionError, TimeoutError)
    # OpenTelemetry's `messaging.system` of the adapter's metrics.
    system = "apiary.memory"
    # Queues (logical name -> bindings) declared on connect, so no message waits for its consumer's first
    # start (an Apiary process's bus: apiary.bus.layout.SERVICE_QUEUES; make_bus sets it).
    layout: Mapping[str, Sequence[str]] = {}

    @abstractmethod
    async def connect(self) -> None:
        """Open the connection and declare the exchange and dead-letter queue."""

    async def declare_layout(self) -> None:
        """Declare every queue of `layout`, bound as it says (called by `connect`)."""
        for name, bindings in self.layout.items():
            await self.declare_queue(name, bindings)

    @abstractmethod
    async def close(self) -> None:
        """Stop every consumer and close the connection."""

    @abstractmethod
    async def declare_queue(self, name: str, bindings: Sequence[str], *, expires: float | None = None,
                            reroute: Reroute | None = None) -> None:
        """Declare a durable queue bound to the exchange with these topic patterns.

        With `expires` (seconds) the queue is deleted, messages and all, once it has had no consumer for
        that long: for a queue of one process, which may never come back to empty it. With `reroute`, a
        message no consumer has taken within `reroute.after` seconds is published again under
        `reroute.to` (on RabbitMQ: a message TTL dead-lettering into the exchange). Whoever declares a
        queue must declare it with the same `expires` and `reroute`.
        """

    async def publish(
        self,
        routing_key: str,
        body: bytes,
        *,
        headers: dict[str, Any] | None = None,
        content_type: str = MSGPACK,
        message_id: str | None = None,
        delay: float | None = None,
        persistent: bool = True,
    ) -> None:
        """Publish persistently (unless `persistent` is False: the broker keeps it in memory only, and a
        restart of the broker loses it) and wait for the broker's confirm; raise Unroutable if no queue
        matches, BrokerUnavailable if the broker cannot be reached.

        With `delay` (seconds) the message is routed only after that long, even across restarts.
        """
        message = Delivery(routing_key=routing_key, body=bytes(body), headers=dict(headers or {}),
                           content_type=content_type, message_id=message_id, persistent=persistent)
        try:
            await self._publish(message, delay if delay and delay > 0 else None)
        except (Unroutable, DependencyUnavailable) as e:
            metrics.message_sent(self.system, routing_key, type(e).__name__)
            raise
        except self.unavailable as e:
            metrics.message_sent(self.system, routing_key, BrokerUnavailable.__name__)
            reason = str(e) or type(e).__name__
            raise BrokerUnavailable(f"cannot publish {routing_key}: the broker is unreachable: {reason}",
                                    dependency="the message broker", reason=reason) from e
        metrics.message_sent(self.system, routing_key)

    @abstractmethod
    async def _publish(self, message: Delivery, delay: float | None) -> None:
        """Send what `publish` built (the adapter names it when `message_id` is None); `delay` is
        None or positive."""

    @abstractmethod
    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 16) -> Subscription:
        """Deliver the queue's messages to `handler`, at most `prefetch` at a time."""

    @abstractmethod
    async def purge(self, queue: str) -> int:
        """Drop every ready message of a queue; return how many."""

    @abstractmethod
    async def queue_size(self, queue: str) -> int:
        """How many messages are ready in a queue."""


@lru_cache(maxsize=4096)
def _compile(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split("."))


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: `*` is exactly one word, `#` is zero or more words."""
    return _match(_compile(pattern), tuple(routing_key.split(".")))


def _match(pat: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pat:
        return not words
    head, rest = pat[0], pat[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _match(rest, words[1:])
