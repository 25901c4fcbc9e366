"""One behaviour suite for the bus port, run against the in-memory bus and RabbitMQ.

The last section holds RabbitMQ-only behaviour: surviving the broker's consumer acknowledgement
timeout, returning a dead consumer's held message, and recovering from a dropped connection.

Tests marked `queue_types` rest on what a RabbitMQ queue does with a message (expiry, redelivery, dead-lettering,
delays, returning a consumer's held messages): tests/ports/test_bus_quorum.py runs those again on quorum queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest

from apiary.bus.base import (
    ORIGINAL_KEY_HEADER,
    REASON_HEADER,
    Bus,
    Decline,
    Delivery,
    Kept,
    PassOn,
    Poison,
    Reroute,
    Retryable,
    Subscription,
    Unroutable,
)
from apiary.bus.memory import MemoryBus
from apiary.bus.rabbitmq import RabbitBus
from apiary.bus.rabbitmq.connection import user_of
from apiary.bus.typed import subscribe
from tests.fixtures.services import AMQP_URL, rabbitmqctl

DEADLINE = 15.0


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], what: str, within: float = DEADLINE
) -> None:
    """Poll `check` until it holds, failing with `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)


async def observed(get: Callable[[], Awaitable[object]], expected: object, within: float = 3.0) -> object:
    """Poll `get` until it returns `expected` or `within` seconds pass; return what it last returned."""
    deadline = time.monotonic() + within
    # Broker counters have no event to wait on: poll them.
    while (value := await get()) != expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    return value


@dataclass
class Recorder:
    """A handler that records what it was given, and can be told to fail or block."""

    fail_first: int = 0
    error: Callable[[], Exception] = lambda: RuntimeError("boom")
    seen: list[Delivery] = field(default_factory=list)
    at: list[float] = field(default_factory=list)

    async def __call__(self, delivery: Delivery) -> None:
        self.seen.append(delivery)
        self.at.append(time.monotonic())
        if len(self.seen) <= self.fail_first:
            raise self.error()

    @property
    def bodies(self) -> list[bytes]:
        return [d.body for d in self.seen]


async def settled(bus: Bus, queue: str) -> None:
    """Wait until nothing is ready in the queue (the dead-letter queue included)."""
    await eventually(lambda: _empty(bus, queue), f"{queue} to drain")


async def _empty(bus: Bus, queue: str) -> bool:
    return await bus.queue_size(queue) == 0


@contextlib.asynccontextmanager
async def consuming(bus: Bus, queue: str, handler: Callable[[Delivery], Awaitable[None]], **kw: int
                    ) -> AsyncIterator[None]:
    sub = await bus.consume(queue, handler, **kw)
    try:
        yield
    finally:
        await sub.cancel()


# --- Routing ---------------------------------------------------------------------------------------


async def test_topic_patterns_route_each_key_to_every_matching_queue(bus: Bus) -> None:
    # Prepare
    queues = {
        "exact": ["job.requested"],
        "star": ["job.*"],
        "hash": ["job.#"],
        "tail": ["#.failed"],
        "middle": ["worker.*.done"],
    }
    for name, patterns in queues.items():
        await bus.declare_queue(name, patterns)

    # Execute
    for key in ["job.requested", "job.round.failed", "worker.7.done", "job", "round.failed"]:
        await bus.publish(key, key.encode())

    # Assert
    expected = {"exact": 1, "star": 1, "hash": 3, "tail": 2, "middle": 1}

    async def sizes() -> dict[str, int]:
        return {name: await bus.queue_size(name) for name in queues}

    assert await observed(sizes, expected) == expected


async def test_publish_matching_no_queue_raises_unroutable(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("jobs", ["job.*"])

    # Execute / Assert
    with pytest.raises(Unroutable):
        await bus.publish("worker.done", b"lost")
    assert await bus.queue_size("jobs") == 0


@pytest.mark.queue_types
async def test_a_queue_that_expires_goes_once_it_has_had_no_consumer_that_long(bus: Bus) -> None:
    # Prepare: a process's own queue, consumed for longer than its expiry, then left.
    await bus.declare_queue("mine", ["worker.control"], expires=0.5)
    recorder = Recorder()
    async with consuming(bus, "mine", recorder):
        await asyncio.sleep(1.0)
        await bus.publish("worker.control", b"while consumed")
        await eventually(lambda: len(recorder.seen) == 1, "the message while consumed")

    # Execute: nobody consumes it any more.
    await bus.publish("worker.control", b"left behind")

    async def gone() -> bool:
        try:
            await bus.publish("worker.control", b"probe")
        except Unroutable:
            return True
        return False

    # Assert: it was kept while consumed; then it went, with what it held.
    await eventually(gone, "the unused queue to expire")
    assert recorder.bodies == [b"while consumed"]


@pytest.mark.queue_types
async def test_a_message_not_taken_in_time_is_rerouted_and_one_taken_is_not(bus: Bus) -> None:
    # Prepare: a worker's preferred queue that falls back to the pool, with nobody consuming it yet.
    fallback = Reroute(after=0.5, to="assign.pool")
    await bus.declare_queue("prefer.w1", ["assign.prefer.w1"], expires=60, reroute=fallback)
    await bus.declare_queue("pool", ["assign.pool"])
    pool, preferred = Recorder(), Recorder()

    # Execute: one message waits with no consumer; then one is sent while the queue is consumed.
    await bus.publish("assign.prefer.w1", b"left waiting", headers={"attempt": 1})
    async with consuming(bus, "pool", pool):
        await eventually(lambda: len(pool.seen) == 1, "the waiting message to reach the pool")
        async with consuming(bus, "prefer.w1", preferred):
            await bus.publish("assign.prefer.w1", b"taken")
            await eventually(lambda: len(preferred.seen) == 1, "the preferred consumer to take it")
        await asyncio.sleep(1.0)

    # Assert: the waiting one went to the pool under the pool's key, with its headers; the taken one
    # stayed where it was taken.
    assert pool.bodies == [b"left waiting"] and pool.seen[0].routing_key == "assign.pool"
    assert pool.seen[0].headers.get("attempt") == 1
    assert preferred.bodies == [b"taken"]


@pytest.mark.queue_types
async def test_a_message_passed_on_goes_where_its_queue_reroutes_at_once_as_a_fresh_delivery(bus: Bus) -> None:
    # Prepare: a preferred queue that falls back to the pool after a minute; its consumer declines the first
    # message once (a requeue, on quorum queues a copy of its own), then passes every message on.
    await bus.declare_queue("prefer.w1", ["assign.prefer.w1"], expires=60,
                            reroute=Reroute(after=60, to="assign.pool"))
    await bus.declare_queue("pool", ["assign.pool"])
    await bus.declare_queue("plain", ["plain"])
    pool, passed = Recorder(), Recorder()

    async def busy(delivery: Delivery) -> None:
        await passed(delivery)
        if len(passed.seen) == 1:
            raise Decline("not yet")
        raise PassOn("busy")

    # Execute
    async with consuming(bus, "pool", pool), consuming(bus, "prefer.w1", busy), consuming(bus, "plain", busy):
        await bus.publish("assign.prefer.w1", b"declined, then passed on", headers={"attempt": 1})
        await eventually(lambda: len(pool.seen) == 1, "the passed-on message in the pool")
        await bus.publish("assign.prefer.w1", b"passed on")
        await eventually(lambda: len(pool.seen) == 2, "the second in the pool")
        # A queue without a reroute has nowhere to pass a message on to: it is dead-lettered.
        await bus.publish("plain", b"nowhere to go")
        await eventually(lambda: bus.queue_size("dead"), "the message without a reroute dead-lettered")

    # Assert: in the pool long before the queue's TTL, under the pool's key, with its headers, as a fresh delivery
    # (its first failure there is retried); nothing else dead-lettered.
    assert pool.bodies == [b"declined, then passed on", b"passed on"]
    assert [(d.routing_key, d.redelivered) for d in pool.seen] == [("assign.pool", False)] * 2
    assert pool.seen[0].headers == {"attempt": 1}
    assert await observed(lambda: bus.queue_size("dead"), 1) == 1
    assert await bus.queue_size("prefer.w1") == 0


async def test_a_paused_subscription_takes_nothing_new_until_resumed(bus: Bus) -> None:
    # Prepare: a consumer in the middle of handling one message.
    await bus.declare_queue("jobs", ["job.*"])
    release = asyncio.Event()
    seen: list[bytes] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery.body)
        if delivery.body == b"first":
            await release.wait()

    subscription = await bus.consume("jobs", handler, prefetch=1)
    try:
        await bus.publish("job.a", b"first")
        await eventually(lambda: seen == [b"first"], "the first message to be handled")

        # Execute: paused, the handler finishes; a message sent meanwhile waits in the queue.
        await subscription.pause()
        release.set()
        await bus.publish("job.b", b"second")
        await asyncio.sleep(0.8)
        waiting = list(seen), await bus.queue_size("jobs")
        await subscription.resume()
        await eventually(lambda: seen == [b"first", b"second"], "the second message after resuming")
    finally:
        await subscription.cancel()

    # Assert
    assert waiting == ([b"first"], 1)
    assert await observed(lambda: bus.queue_size("jobs"), 0) == 0


@pytest.mark.queue_types
async def test_a_declined_message_goes_to_another_consumer_and_is_never_dead_lettered(bus: Bus) -> None:
    # Prepare: two consumers of one queue; the first pauses itself and declines what it gets.
    await bus.declare_queue("pool", ["assign.pool"])
    declined: list[bytes] = []
    taken = Recorder()
    first: list[Subscription] = []

    async def busy(delivery: Delivery) -> None:
        declined.append(delivery.body)
        await first[0].pause()
        raise Decline("busy")

    first.append(await bus.consume("pool", busy, prefetch=1))
    try:
        for body in (b"one", b"two"):
            await bus.publish("assign.pool", body)
        await eventually(lambda: len(declined) >= 1, "the first consumer to decline one")

        # Execute: a second consumer comes.
        async with consuming(bus, "pool", taken):
            await eventually(lambda: sorted(taken.bodies) == [b"one", b"two"], "both with the second consumer")
    finally:
        await first[0].cancel()

    # Assert: nothing reached the dead-letter queue.
    assert len(declined) == 1
    assert await bus.queue_size("dead") == 0


async def test_headers_and_properties_round_trip(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["round.start"])
    recorder = Recorder()
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "attempt": 2,
               "ratio": 0.5, "flag": True}

    # Execute
    async with consuming(bus, "q", recorder):
        await bus.publish("round.start", b'{"a": 1}', headers=headers, content_type="application/json",
                          message_id="m-1")
        await eventually(lambda: len(recorder.seen) == 1, "the delivery")

    # Assert
    (got,) = recorder.seen
    assert (got.routing_key, got.body, got.content_type, got.message_id, got.redelivered) == (
        "round.start", b'{"a": 1}', "application/json", "m-1", False)
    assert got.headers == headers


async def test_a_delivery_names_the_broker_user_that_published_it(bus: Bus) -> None:
    # Prepare: on RabbitMQ the connection's own user (the broker refuses any other); in memory, a user given
    publisher = bus.as_user("apiary-worker.w1") if isinstance(bus, MemoryBus) else bus
    expected = "apiary-worker.w1" if isinstance(bus, MemoryBus) else user_of(AMQP_URL)
    await bus.declare_queue("q", ["worker.done"])
    recorder = Recorder()

    # Execute
    async with consuming(bus, "q", recorder):
        await publisher.publish("worker.done", b"x")
        await eventually(lambda: len(recorder.seen) == 1, "the delivery")

    # Assert
    assert recorder.seen[0].user_id == expected


async def test_purge_drops_ready_messages_and_queue_size_counts_them(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["a.b"])
    for i in range(3):
        await bus.publish("a.b", bytes([i]))
    assert await observed(lambda: bus.queue_size("q"), 3) == 3

    # Execute
    purged = await bus.purge("q")

    # Assert
    assert purged == 3
    assert await bus.queue_size("q") == 0


async def test_consuming_an_undeclared_queue_is_refused(bus: Bus) -> None:
    with pytest.raises(ValueError, match="not declared"):
        await bus.consume("nowhere", Recorder())


# --- Acks, retries and dead letters ----------------------------------------------------------------


@pytest.mark.queue_types
async def test_a_handler_failing_once_gets_a_redelivery_that_is_acked(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["worker.done"])
    recorder = Recorder(fail_first=1)

    # Execute
    sub = await bus.consume("q", recorder)
    await bus.publish("worker.done", b"result")
    await eventually(lambda: len(recorder.seen) == 2, "the redelivery")
    await sub.cancel()  # anything left unacked would now return to the queue

    # Assert
    assert recorder.bodies == [b"result", b"result"]
    assert [d.redelivered for d in recorder.seen] == [False, True]
    assert await bus.queue_size("q") == 0
    assert await bus.queue_size("dead") == 0


@pytest.mark.queue_types
async def test_a_handler_failing_twice_sends_the_message_to_the_dead_letter_queue(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["worker.done"])
    failing = Recorder(fail_first=99, error=lambda: ValueError("bad weights"))
    dead = Recorder()

    # Execute
    async with consuming(bus, "q", failing), consuming(bus, "dead", dead):
        await bus.publish("worker.done", b"result", headers={"job_id": "j1"})
        await eventually(lambda: len(dead.seen) == 1, "the dead letter")

    # Assert
    assert len(failing.seen) == 2
    (letter,) = dead.seen
    assert letter.body == b"result"
    assert letter.routing_key == "worker.done"
    assert letter.headers[REASON_HEADER] == "handler failed twice: ValueError: bad weights"
    assert letter.headers[ORIGINAL_KEY_HEADER] == "worker.done"
    assert letter.headers["job_id"] == "j1"


@pytest.mark.queue_types
async def test_poison_is_dead_lettered_at_once(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["worker.done"])
    poisoned = Recorder(fail_first=99, error=lambda: Poison("contribution for an unknown job"))
    dead = Recorder()

    # Execute
    async with consuming(bus, "q", poisoned), consuming(bus, "dead", dead):
        await bus.publish("worker.done", b"x")
        await eventually(lambda: len(dead.seen) == 1, "the dead letter")

    # Assert
    assert len(poisoned.seen) == 1
    assert dead.seen[0].headers[REASON_HEADER] == "contribution for an unknown job"


@pytest.mark.queue_types
async def test_an_undecodable_event_is_dead_lettered_at_once(bus: Bus) -> None:
    # Prepare
    handled: list[object] = []

    async def on_job(event: object, delivery: Delivery) -> None:
        handled.append(event)

    dead = Recorder()
    sub = await subscribe(bus, "scheduler", {"job.requested": on_job})

    # Execute
    async with consuming(bus, "dead", dead):
        await bus.publish("job.requested", b"\xc1 is never valid msgpack")
        await eventually(lambda: len(dead.seen) == 1, "the dead letter")
    await sub.cancel()

    # Assert
    assert handled == []
    assert dead.seen[0].headers[ORIGINAL_KEY_HEADER] == "job.requested"
    assert dead.seen[0].headers[REASON_HEADER]
    assert await bus.queue_size("scheduler") == 0


@pytest.mark.queue_types
async def test_retryable_is_requeued_until_it_succeeds(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["worker.done"])
    recorder = Recorder(fail_first=2, error=lambda: Retryable("database is down"))

    # Execute
    sub = await bus.consume("q", recorder)
    await bus.publish("worker.done", b"result")
    await eventually(lambda: len(recorder.seen) == 3, "three attempts")
    await sub.cancel()

    # Assert
    assert recorder.bodies == [b"result"] * 3
    assert await bus.queue_size("q") == 0
    assert await bus.queue_size("dead") == 0


# --- Consumers -------------------------------------------------------------------------------------


@pytest.mark.queue_types
async def test_cancelling_a_subscription_returns_its_in_flight_message(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("assign.pool", ["assign.pool"])
    started = asyncio.Event()

    async def dies_mid_training(delivery: Delivery) -> None:
        started.set()
        await asyncio.Event().wait()

    first = await bus.consume("assign.pool", dies_mid_training)
    await bus.publish("assign.pool", b"shard-3")
    await asyncio.wait_for(started.wait(), DEADLINE)

    # Execute
    await first.cancel()
    second = Recorder()
    async with consuming(bus, "assign.pool", second):
        await eventually(lambda: len(second.seen) == 1, "the second consumer to get it")

    # Assert
    assert second.bodies == [b"shard-3"]
    assert second.seen[0].redelivered


@pytest.mark.queue_types
async def test_a_handler_failing_while_cancelled_leaves_its_message_for_the_next_consumer(bus: Bus) -> None:
    # Prepare: the message is already a redelivery, so a counted failure would dead-letter it.
    await bus.declare_queue("q", ["worker.done"])
    started = asyncio.Event()
    calls = 0

    async def fails_once_then_breaks_on_shutdown(delivery: Delivery) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first attempt fails")
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed during shutdown") from None

    first = await bus.consume("q", fails_once_then_breaks_on_shutdown)
    await bus.publish("worker.done", b"result")
    await asyncio.wait_for(started.wait(), DEADLINE)

    # Execute
    await first.cancel()
    second = Recorder()
    async with consuming(bus, "q", second):
        await eventually(lambda: len(second.seen) == 1, "the next consumer to get it")

    # Assert
    assert second.bodies == [b"result"]
    assert await bus.queue_size("dead") == 0


async def test_competing_consumers_share_a_queue_and_each_message_is_handled_once(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("assign.pool", ["assign.pool"])
    handled: dict[str, list[bytes]] = {"a": [], "b": []}
    both_busy = asyncio.Event()

    def worker(name: str) -> Callable[[Delivery], Awaitable[None]]:
        async def handle(delivery: Delivery) -> None:
            handled[name].append(delivery.body)
            if all(handled.values()):
                both_busy.set()
            # Each worker holds its first message until the other has one too.
            await asyncio.wait_for(both_busy.wait(), DEADLINE)

        return handle

    # Execute
    async with consuming(bus, "assign.pool", worker("a"), prefetch=1), \
            consuming(bus, "assign.pool", worker("b"), prefetch=1):
        for i in range(20):
            await bus.publish("assign.pool", f"shard-{i}".encode())
        await eventually(lambda: sum(map(len, handled.values())) == 20, "all 20 shards")

    # Assert
    everything = handled["a"] + handled["b"]
    assert sorted(everything) == sorted(f"shard-{i}".encode() for i in range(20))
    assert handled["a"] and handled["b"]


async def test_prefetch_bounds_how_many_handlers_run_at_once(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["task"])
    gate = asyncio.Event()
    running = 0
    most = 0
    done = 0

    async def slow(delivery: Delivery) -> None:
        nonlocal running, most, done
        running += 1
        most = max(most, running)
        await asyncio.wait_for(gate.wait(), DEADLINE)
        running -= 1
        done += 1

    # Execute
    async with consuming(bus, "q", slow, prefetch=3):
        for i in range(10):
            await bus.publish("task", bytes([i]))
        await eventually(lambda: running == 3, "three handlers to start")
        waiting = await bus.queue_size("q")
        gate.set()
        await eventually(lambda: done == 10, "all ten to finish")

    # Assert
    assert waiting == 7
    assert most == 3


# --- Delays ----------------------------------------------------------------------------------------


@pytest.mark.queue_types
async def test_delayed_publish_arrives_after_its_delay_and_a_short_one_is_not_held_back(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("aggregator", ["round.timeout"])
    recorder = Recorder()
    async with consuming(bus, "aggregator", recorder):
        # Execute
        sent_long = time.monotonic()
        await bus.publish("round.timeout", b"long", delay=2.0)
        sent_short = time.monotonic()
        await bus.publish("round.timeout", b"short", delay=0.5)
        early = await bus.queue_size("aggregator") + len(recorder.seen)
        await eventually(lambda: len(recorder.seen) == 2, "both timeouts")

    # Assert
    assert early == 0
    assert recorder.bodies == [b"short", b"long"]
    short_at, long_at = recorder.at
    assert short_at - sent_short >= 0.5 - 0.01
    assert short_at - sent_short < 1.8, "the short delay waited behind the long one"
    assert long_at - sent_long >= 2.0 - 0.01


@pytest.mark.queue_types
async def test_a_message_published_not_persistent_arrives_saying_so(bus: Bus) -> None:
    # Prepare
    await bus.declare_queue("q", ["worker.heartbeat", "worker.done"])
    recorder = Recorder()

    # Execute: a heartbeat kept in the broker's memory only, a report kept on its disk (the default).
    async with consuming(bus, "q", recorder):
        await bus.publish("worker.heartbeat", b"beat", persistent=False)
        await bus.publish("worker.done", b"done")
        await eventually(lambda: len(recorder.seen) == 2, "both deliveries")

    # Assert
    assert sorted((d.body, d.persistent) for d in recorder.seen) == [(b"beat", False), (b"done", True)]


# --- RabbitMQ only ---------------------------------------------------------------------------------


@contextlib.contextmanager
def broker_setting(name: str, value: int) -> Iterator[None]:
    """Set a `rabbit` application setting on the running broker, restoring it afterwards."""
    before = rabbitmqctl("eval", f"application:get_env(rabbit, {name}).").strip()
    rabbitmqctl("eval", f"application:set_env(rabbit, {name}, {value}).")
    try:
        yield
    finally:
        match = re.fullmatch(r"\{ok,(.+)\}", before)
        if match:
            rabbitmqctl("eval", f"application:set_env(rabbit, {name}, {match.group(1)}).")
        else:
            rabbitmqctl("eval", f"application:unset_env(rabbit, {name}).")


@contextlib.asynccontextmanager
async def rabbit(url: str, namespace: str, *, lease_renewal: float | None = 600.0) -> AsyncIterator[RabbitBus]:
    name = f"{namespace} {uuid.uuid4().hex[:6]}"
    bus = RabbitBus(url, exchange=namespace, connection_name=name, lease_renewal=lease_renewal)
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.close()


def unacked(namespace: str) -> dict[str, int]:
    """Unacked deliveries per queue of the namespace, as the broker counts them."""
    rows = rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged")
    counts = {}
    for line in rows.splitlines():
        name, _, count = line.strip().rpartition("\t")
        if name.startswith(f"{namespace}."):
            counts[name.removeprefix(f"{namespace}.")] = int(count)
    return counts


TIMEOUT_MS = 3000  # the broker's consumer_timeout during these tests
TRAINING_S = 8.0  # longer than the timeout plus several broker checks


@pytest.mark.slow
@pytest.mark.serial  # the broker-wide consumer_timeout it sets would reach other tests' consumers
@pytest.mark.queue_types
async def test_a_long_handler_outlives_the_consumer_timeout_without_loss_or_duplicate(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: the broker checks every 0.5 s and times out deliveries older than 3 s.
    seen: list[tuple[bytes, bool]] = []
    trained = asyncio.Event()

    async def train(delivery: Delivery) -> None:
        seen.append((delivery.body, delivery.redelivered))
        if delivery.body == b"round-1":
            await asyncio.sleep(TRAINING_S)  # the training itself
            trained.set()

    async with rabbit(rabbit_url, bus_namespace, lease_renewal=1.0) as bus:
        await bus.declare_queue("assign.pool", ["assign.pool"])
        with broker_setting("channel_tick_interval", 500):
            with broker_setting("consumer_timeout", TIMEOUT_MS):
                sub = await bus.consume("assign.pool", train, prefetch=1)  # the timeout is read here

            # Execute
            started = time.monotonic()
            await bus.publish("assign.pool", b"round-1")
            await asyncio.wait_for(trained.wait(), TRAINING_S + DEADLINE)
            elapsed = time.monotonic() - started
            await bus.publish("assign.pool", b"round-2")
            await eventually(lambda: len(seen) == 2, "the next assignment")
            await sub.cancel()

        # Assert
        assert elapsed > 2 * TIMEOUT_MS / 1000
        assert seen == [(b"round-1", False), (b"round-2", False)]
        assert await bus.queue_size("assign.pool") == 0
        assert await bus.queue_size("dead") == 0
        assert not [q for q in unacked(bus_namespace) if q.startswith("hold.")], "hold queue left behind"


@pytest.mark.slow
@pytest.mark.serial
async def test_without_re_holding_the_broker_closes_the_channel_and_the_consumer_recovers(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: the control for the test above, with re-holding switched off.
    seen: list[tuple[bytes, bool]] = []
    release = asyncio.Event()

    async def train(delivery: Delivery) -> None:
        seen.append((delivery.body, delivery.redelivered))
        if len(seen) == 1:
            await asyncio.wait_for(release.wait(), DEADLINE + TRAINING_S)

    async with rabbit(rabbit_url, bus_namespace, lease_renewal=None) as bus:
        await bus.declare_queue("assign.pool", ["assign.pool"])
        with broker_setting("channel_tick_interval", 500):
            with broker_setting("consumer_timeout", TIMEOUT_MS):
                sub = await bus.consume("assign.pool", train, prefetch=1)

            # Execute
            await bus.publish("assign.pool", b"round-1")
            await eventually(lambda: len(seen) == 2, "the broker to time out and redeliver")
            release.set()
            await bus.publish("assign.pool", b"round-2")
            await eventually(lambda: len(seen) == 3, "the recovered consumer to take more work")
            await sub.cancel()

        # Assert
        assert seen == [(b"round-1", False), (b"round-1", True), (b"round-2", False)]
        assert await bus.queue_size("assign.pool") == 0


@pytest.mark.slow
@pytest.mark.queue_types
async def test_a_held_message_of_a_consumer_that_dies_goes_back_to_the_pool(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a worker takes an assignment and holds it past a few re-holds.
    async def trains_forever(delivery: Delivery) -> None:
        await asyncio.Event().wait()

    async with rabbit(rabbit_url, bus_namespace, lease_renewal=0.5) as dying, \
            rabbit(rabbit_url, bus_namespace) as survivor:
        await dying.declare_queue("assign.pool", ["assign.pool"])
        await dying.consume("assign.pool", trains_forever, prefetch=1)
        await dying.publish("assign.pool", b"shard-1", headers={"job_id": "j1"})

        def re_held() -> bool:
            counts = unacked(bus_namespace)
            held = sum(n for q, n in counts.items() if q.startswith("hold."))
            return counts.get("assign.pool") == 0 and held == 1

        await eventually(re_held, "the delivery to be re-held")

        # Execute: the process dies (its connection goes, nothing is settled).
        assert dying._connection is not None
        await dying._connection.close()
        recorder = Recorder()
        async with consuming(survivor, "assign.pool", recorder):
            await eventually(lambda: len(recorder.seen) == 1, "the assignment to come back")

    # Assert
    (got,) = recorder.seen
    assert (got.body, got.routing_key, got.redelivered) == (b"shard-1", "assign.pool", True)
    assert got.headers == {"job_id": "j1"}


@dataclass
class Keeper:
    """A handler that keeps every delivery past its return (a worker's trained secure shard), recording what it kept."""

    kept: list[Kept] = field(default_factory=list)

    async def __call__(self, delivery: Delivery) -> None:
        self.kept.append(await delivery.keep())


async def test_a_delivery_kept_past_its_handler_frees_the_slot_and_once_released_never_comes_back(bus: Bus) -> None:
    # Prepare: one slot; the first assignment's handler keeps its delivery (a secure shard waiting for shares).
    await bus.declare_queue("assign.pool", ["assign.pool"])
    seen: list[bytes] = []
    kept: list[Kept] = []

    async def train(delivery: Delivery) -> None:
        seen.append(delivery.body)
        if delivery.body == b"shard-1":
            kept.append(await delivery.keep())

    # Execute
    async with consuming(bus, "assign.pool", train, prefetch=1):
        await bus.publish("assign.pool", b"shard-1")
        await bus.publish("assign.pool", b"shard-2")
        await eventually(lambda: len(seen) == 2, "the next assignment while the first is kept")
        await kept[0].release()
        await kept[0].release()  # twice is harmless
        await asyncio.sleep(0.5)

    # Assert: nothing came back or was left behind.
    assert seen == [b"shard-1", b"shard-2"]
    assert await bus.queue_size("assign.pool") == 0
    assert await bus.queue_size("dead") == 0
    if isinstance(bus, RabbitBus):
        assert not [q for q in unacked(bus.exchange) if q.startswith("hold.")], "hold queue left behind"


@pytest.mark.slow
@pytest.mark.queue_types
async def test_a_kept_delivery_re_held_many_times_and_then_released_never_comes_back(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: re-held every 0.2 s, so that releasing it meets a re-hold under way now and then.
    keeper = Keeper()
    async with rabbit(rabbit_url, bus_namespace, lease_renewal=0.2) as bus:
        await bus.declare_queue("assign.pool", ["assign.pool"])
        recorder = Recorder()
        async with consuming(bus, "assign.pool", keeper, prefetch=1):
            for shard in range(5):
                await bus.publish("assign.pool", f"shard-{shard}".encode())
            await eventually(lambda: len(keeper.kept) == 5, "every delivery to be kept")

            # Execute
            for index, one in enumerate(keeper.kept):
                await asyncio.sleep(0.13 * index)
                await one.release()
        async with consuming(bus, "assign.pool", recorder):
            await asyncio.sleep(12)  # past the kept copies' TTL (10 s)

    # Assert: nothing came back, and no hold queue or unsettled delivery was left.
    assert recorder.seen == []
    assert not [q for q, n in unacked(bus_namespace).items() if q.startswith("hold.") or n]


@pytest.mark.queue_types
async def test_a_delivery_kept_past_its_handler_goes_back_to_its_queue_when_its_consumer_dies(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare: a worker trains an assignment, keeps it past its handler (its slot free again) and then dies.
    keeper = Keeper()
    # Re-held every second (a copy goes back 10 s after it was made): it comes back within 10 s of the death. The
    # dying bus is never closed, as a dead process's is not (its consumers' cancels would wait for a connection).
    dying = RabbitBus(rabbit_url, exchange=bus_namespace, connection_name=f"{bus_namespace} dying", lease_renewal=1.0)
    await dying.connect()
    async with rabbit(rabbit_url, bus_namespace) as survivor:
        await dying.declare_queue("assign.pool", ["assign.pool"])
        await dying.consume("assign.pool", keeper, prefetch=1)
        await dying.publish("assign.pool", b"shard-1", headers={"job_id": "j1"})
        await eventually(lambda: len(keeper.kept) == 1, "the delivery to be kept")
        await eventually(lambda: unacked(bus_namespace).get("assign.pool") == 0, "the handler's delivery settled")
        await asyncio.sleep(2.5)  # past two re-holds of the kept copy

        # Execute: the process dies (its connection goes, the kept copy is never released).
        assert dying._connection is not None
        await dying._connection.close()
        recorder = Recorder()
        async with consuming(survivor, "assign.pool", recorder):
            await eventually(lambda: len(recorder.seen) == 1, "the kept assignment to come back", within=20)

    # Assert: it comes back once, as it was sent, marked redelivered and returned (its holder was lost).
    (got,) = recorder.seen
    assert (got.body, got.routing_key, got.redelivered, got.returned) == (b"shard-1", "assign.pool", True, True)
    assert got.headers == {"job_id": "j1"}


async def test_consumers_resume_after_the_broker_drops_the_connection(
    rabbit_url: str, bus_namespace: str
) -> None:
    # Prepare
    recorder = Recorder()
    async with rabbit(rabbit_url, bus_namespace) as bus:
        await bus.declare_queue("q", ["a.b"])
        async with consuming(bus, "q", recorder):
            await bus.publish("a.b", b"before")
            await eventually(lambda: len(recorder.seen) == 1, "the first message")
            # Its ack must reach the broker first: an ack lost with the connection redelivers it.
            await eventually(
                lambda: asyncio.to_thread(lambda: unacked(bus_namespace).get("q") == 0), "the first ack"
            )

            # Execute
            rows = rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid", "client_properties")
            pids = [line.split("\t")[0] for line in rows.splitlines() if bus.connection_name in line]
            assert len(pids) == 1, rows
            rabbitmqctl("close_connection", pids[0], "test: simulated broker restart")
            await bus.publish("a.b", b"after")
            await eventually(lambda: b"after" in recorder.bodies, "the restored consumer")

    # Assert
    assert recorder.bodies == [b"before", b"after"]


async def test_delete_namespace_removes_every_queue_and_the_exchange(rabbit_url: str, bus_namespace: str) -> None:
    # Prepare: plain, dead-letter and delay queues.
    async with rabbit(rabbit_url, bus_namespace) as bus:
        await bus.declare_queue("scheduler", ["job.*"])
        await bus.publish("job.requested", b"x", delay=60)
        before = set(unacked(bus_namespace))

        # Execute
        await bus.delete_namespace()

    # Assert
    assert before == {"scheduler", "dead", "delay.60000.job.requested"}
    assert unacked(bus_namespace) == {}
    exchanges = rabbitmqctl("list_exchanges", "-q", "--no-table-headers", "name").split()
    assert bus_namespace not in exchanges
