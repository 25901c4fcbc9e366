#!/usr/bin/env python
"""The local RabbitMQ's CPU per persistent message as the number of queues grows (what a round's preferred
assignments are: one persistent message into each of K workers' own durable queues).

N durable classic queues, each with one consumer (prefetch 1) on a channel of its own, 100 channels a connection;
a round publishes one persistent message to each queue (with publisher confirms) and waits until every one is
consumed and acked; `--gap` seconds between rounds let the queues and channels go idle, as they do between the
rounds of a real job. Prints the broker's CPU (its beam.smp process, user + system) per message for each N and gap,
and the broker's open-file limit, which decides whether every queue's index file keeps a handle (RabbitMQ 3.x).
The queues and the exchange are deleted at the end.

Usage: python scripts/bench_broker.py [--queues 100 1000] [--gaps 0 1.5] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import aio_pika

from bench_record import add_json_argument, record

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_round import _cpu_by_command  # noqa: E402
from bench_scale import broker_open_files  # noqa: E402

AMQP = os.environ.get("APIARY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
PER_CONNECTION = 100
BODY = b"x" * 600  # about an assignment's size


def broker_cpu() -> float:
    """CPU seconds the local broker (beam.smp) has used."""
    return sum(_cpu_by_command(("beam.smp",))["beam.smp"].values())


async def measure(n: int, rounds: int, gap: float) -> float:
    """Broker CPU milliseconds per persistent message with N queues."""
    name = f"bench-broker-{uuid.uuid4().hex[:8]}"
    publisher = await aio_pika.connect(AMQP)
    consumers = [await aio_pika.connect(AMQP) for _ in range((n + PER_CONNECTION - 1) // PER_CONNECTION)]
    queues: list[aio_pika.abc.AbstractQueue] = []
    try:
        channel = await publisher.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        got: asyncio.Queue[None] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            got.put_nowait(None)

        for i in range(n):
            consumer = await consumers[i // PER_CONNECTION].channel()
            await consumer.set_qos(prefetch_count=1)
            queue = await consumer.declare_queue(f"{name}.{i}", durable=True)
            await queue.bind(exchange, f"q.{i}")
            await queue.consume(on_message)
            queues.append(queue)
        await asyncio.sleep(2)  # the declarations settle
        before = broker_cpu()
        for _ in range(rounds):
            await asyncio.gather(*(exchange.publish(
                aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), f"q.{i}") for i in range(n)))
            for _ in range(n):
                await asyncio.wait_for(got.get(), 60)
            await asyncio.sleep(gap)
        return (broker_cpu() - before) * 1000 / (n * rounds)
    finally:
        for connection in consumers:  # the consumers go first: deleting their queues under them would be logged
            await connection.close()
        cleanup = await publisher.channel()
        for queue in queues:
            await cleanup.queue_delete(queue.name)
        await cleanup.exchange_delete(name)
        await publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 1.5])
    parser.add_argument("--rounds", type=int, default=8)
    add_json_argument(parser, "broker")
    args = parser.parse_args()
    figures: dict[str, float] = {}
    for gap in args.gaps:
        for n in args.queues:
            start = time.time()
            figures[f"queues={n} gap={gap}"] = ms = round(asyncio.run(measure(n, args.rounds, gap)), 3)
            print(f"{n} queues, {gap} s between rounds: {ms:.3f} ms of broker CPU a persistent message "
                  f"({time.time() - start:.0f} s)", flush=True)
    result = {"broker_open_files": broker_open_files(), "ms_per_message": figures, "rounds": args.rounds}
    print(json.dumps(result))
    record("broker", args.json, result,
           reference="the same persistent messages over 100 queues against 1,000, and back to back against paced")


if __name__ == "__main__":
    main()
