"""Middleware around a subscription's handlers: run outermost first, may stop a message, and the
consumer span opens around the handler with the messaging attributes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apiary import telemetry
from apiary.bus import Delivery, publish_event
from apiary.bus.memory import MemoryBus
from apiary.bus.typed import Middleware, Next, consumer_span, subscribe
from apiary.contracts import JobCancelRequested


def _recording(name: str, seen: list[str]) -> Middleware:
    async def middleware(event: Any, delivery: Delivery, call_next: Next) -> None:
        seen.append(f"{name} in")
        await call_next()
        seen.append(f"{name} out")

    return middleware


async def _stop_job_a(event: Any, delivery: Delivery, call_next: Next) -> None:
    if event.job_id != "a":
        await call_next()


async def test_middleware_runs_around_the_handler_first_outermost() -> None:
    # Prepare
    bus, seen, done = MemoryBus(), [], asyncio.Event()

    async def handler(event: JobCancelRequested, delivery: Delivery) -> None:
        seen.append("handler")
        done.set()

    sub = await subscribe(bus, "q", {"job.cancel": handler},
                          middleware=[_recording("outer", seen), _recording("inner", seen)])

    # Execute
    await publish_event(bus, JobCancelRequested(job_id="j"))
    await asyncio.wait_for(done.wait(), 10)
    await sub.cancel()

    # Assert
    assert seen == ["outer in", "inner in", "handler", "inner out", "outer out"]


async def test_a_middleware_that_does_not_go_on_stops_the_message() -> None:
    # Prepare
    bus, handled, done = MemoryBus(), [], asyncio.Event()

    async def handler(event: JobCancelRequested, delivery: Delivery) -> None:
        handled.append(event.job_id)
        done.set()

    sub = await subscribe(bus, "q", {"job.cancel": handler}, prefetch=1, middleware=[_stop_job_a])

    # Execute: a is stopped; b, published after it, is handled
    await publish_event(bus, JobCancelRequested(job_id="a"))
    await publish_event(bus, JobCancelRequested(job_id="b"))
    await asyncio.wait_for(done.wait(), 10)
    await sub.cancel()

    # Assert
    assert handled == ["b"]
    assert await bus.queue_size("q") == 0


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    telemetry.setup("apiary-test", exporter=exporter)
    yield exporter
    telemetry.shutdown()


async def test_the_consumer_span_is_current_while_the_handler_runs(exporter: InMemorySpanExporter) -> None:
    # Prepare
    bus, current, done = MemoryBus(), [], asyncio.Event()

    async def handler(event: JobCancelRequested, delivery: Delivery) -> None:
        current.append(trace.get_current_span().get_span_context().span_id)
        done.set()

    middleware = [consumer_span("apiary", lambda event: {"apiary.job_id": event.job_id})]
    sub = await subscribe(bus, "q", {"job.cancel": handler}, middleware=middleware)

    # Execute
    await publish_event(bus, JobCancelRequested(job_id="j"))
    await asyncio.wait_for(done.wait(), 10)
    await sub.cancel()

    # Assert
    [span] = exporter.get_finished_spans()
    assert span.name == "job.cancel process" and span.kind == trace.SpanKind.CONSUMER
    context = span.get_span_context()
    assert context is not None and context.span_id == current[0]
    attributes = dict(span.attributes or {})
    assert attributes["messaging.rabbitmq.destination.routing_key"] == "job.cancel"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["apiary.job_id"] == "j"
