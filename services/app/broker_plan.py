"""What each broker user may do: one user per service role and one per worker, with RabbitMQ permissions
(configure, write, read: regular expressions over exchange and queue names) and topic permissions (over the
routing keys published to, and bound from, the `apiary` exchange). Pure: `broker_setup` applies it.

A worker may declare, bind and read only its own queues (`assign.worker.<id>`, `assign.prefer.<id>`,
`control.worker.<id>`), the pool (`assign.pool`) and its private hold queues, and publish only the routing
keys in `WORKER_PUBLISHES`. Services are trusted with their exchange's whole namespace, each publishing only
its own events.

The definitions also hold one policy: the exchange's classic queues use RabbitMQ's second classic-queue storage
(`queue-version` 2, the default from RabbitMQ 3.13, in place on a running queue). The first, 3.12 and older's
default, pays a write of its index for a queue that goes idle holding acknowledged persistent messages: each
worker's preferred queue, once a round; measured, that made the broker's CPU per contribution more than twice
as high with 1,000 workers as with 100 (docs/benchmarks/scale.md).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apiary.bus.identity import DEFAULT_PREFIX, SERVICE_ROLES, SHARED_WORKERS, service_user, worker_user

# What a worker publishes: its own events, the reports of the tasks it runs (worker.initialized,
# worker.evaluated) among them. A preferred assignment it cannot take reaches the pool by being rejected (the
# broker dead-letters it there), not published.
WORKER_PUBLISHES = (r"worker\..+",)
# What each service publishes on the exchange (delayed events go through the default exchange, and the
# broker, not the service, dead-letters them into the exchange, so topic permissions do not apply there).
SERVICE_PUBLISHES: dict[str, tuple[str, ...]] = {
    "scheduler": (r"job\..+", r"shard\..+", r"round\..+", r"assign\..+", r"task\..+", r"report\..+", r"presence\.pace",
                  r"presence\.pace\.[\w.@\-]+"),
    "sharder": (r"job\.sharded",),
    "aggregator": (r"round\..+", r"job\..+", r"secagg\.worker\.[\w.@\-]+"),
    "tracker": (r"job\.requested", r"job\.cancel"),
}
HASHING = "rabbit_password_hashing_sha256"
CLASSIC_QUEUE_VERSION = 2


@dataclass(frozen=True)
class BrokerUser:
    """One broker user and what it may do in the vhost."""

    name: str
    role: str  # a service role, or "worker"
    configure: str
    write: str
    read: str
    topic_write: str
    topic_read: str
    worker_id: str | None = None


def _any(patterns: Sequence[str]) -> str:
    return f"^({'|'.join(patterns)})$"


def service(role: str, exchange: str, prefix: str = DEFAULT_PREFIX) -> BrokerUser:
    """A service's user: its exchange's namespace for queues, only its own events to publish."""
    e = re.escape(exchange)
    namespace = _any([e, rf"{e}\..+", r"amq\.default"])
    return BrokerUser(service_user(role, prefix), role, configure=_any([e, rf"{e}\..+"]), write=namespace,
                      read=_any([e, rf"{e}\..+"]), topic_write=_any(SERVICE_PUBLISHES[role]), topic_read=".*")


def worker(worker_id: str | None, exchange: str, prefix: str = DEFAULT_PREFIX) -> BrokerUser:
    """A worker's user: its own queues and the pool to read, only `WORKER_PUBLISHES` to publish. With no id, the
    account interchangeable workers share (`{prefix}workers`): any worker's queues, and no identity."""
    if worker_id is not None and not re.fullmatch(r"[\w.@\-]{1,100}", worker_id):
        raise ValueError(f"worker id {worker_id!r} is invalid: expected 1 to 100 letters, digits, '.', '_', '@', '-'")
    e, w = re.escape(exchange), re.escape(worker_id) if worker_id is not None else r"[\w.@\-]+"
    own = [rf"assign\.worker\.{w}", rf"assign\.prefer\.{w}", rf"control\.worker\.{w}"]
    paced = [r"presence\.pace", rf"presence\.pace\.{w}"]  # the fleet's pace, and the pace told to it alone
    secure = [rf"secagg\.worker\.{w}"]  # the aggregator's secure-aggregation stages for it alone
    names = "|".join([*own, r"assign\.pool", r"hold\.[0-9a-f]+"])
    queues = [rf"{e}\.({names})"]
    # The exchange and the dead-letter queue are declared by every process as it connects (configure).
    configure = _any([e, rf"{e}\.dead", *queues])
    name = worker_user(worker_id, prefix) if worker_id is not None else f"{prefix}{SHARED_WORKERS}"
    return BrokerUser(name, "worker", configure=configure,
                      write=_any([e, r"amq\.default", *queues]), read=_any([e, *queues]),
                      topic_write=_any(WORKER_PUBLISHES),
                      topic_read=_any([*own, r"assign\.pool", r"job\.failed", r"job\.completed",
                                       r"job\.training_ended", *paced, *secure]),
                      worker_id=worker_id)


def plan(exchange: str, workers: Sequence[str], prefix: str = DEFAULT_PREFIX, *, shared_workers: bool = False
         ) -> list[BrokerUser]:
    """Every user of a deployment: one per service role, then one per worker id (and, with `shared_workers`,
    the account of interchangeable workers)."""
    return [*(service(role, exchange, prefix) for role in SERVICE_ROLES),
            *(worker(worker_id, exchange, prefix) for worker_id in workers),
            *([worker(None, exchange, prefix)] if shared_workers else [])]


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's stored form of a password (rabbit_password_hashing_sha256: base64 of salt + sha256)."""
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def queue_policy(exchange: str, vhost: str) -> dict[str, Any]:
    """The policy that gives the exchange's classic queues the storage that scales with their number (quorum
    queues ignore it)."""
    return {"vhost": vhost, "name": f"{exchange}-queues", "pattern": rf"^{re.escape(exchange)}\.",
            "apply-to": "queues", "priority": 0, "definition": {"queue-version": CLASSIC_QUEUE_VERSION}}


def definitions(users: Sequence[BrokerUser], vhost: str, exchange: str, passwords: Mapping[str, str]
                ) -> dict[str, Any]:
    """RabbitMQ definitions (as `rabbitmqctl import_definitions` and `load_definitions` read them): the vhost,
    the users that have a password in `passwords` (others are left as they are), every user's permissions and
    topic permissions, and the exchange's queue policy."""
    return {
        "vhosts": [{"name": vhost}],
        "users": [{"name": u.name, "password_hash": password_hash(passwords[u.name]), "hashing_algorithm": HASHING,
                   "tags": []} for u in users if u.name in passwords],
        "permissions": [{"user": u.name, "vhost": vhost, "configure": u.configure, "write": u.write,
                         "read": u.read} for u in users],
        "topic_permissions": [{"user": u.name, "vhost": vhost, "exchange": exchange, "write": u.topic_write,
                               "read": u.topic_read} for u in users],
        "policies": [queue_policy(exchange, vhost)],
    }


__all__ = ["SERVICE_PUBLISHES", "WORKER_PUBLISHES", "BrokerUser", "definitions", "password_hash", "plan",
           "queue_policy", "service", "worker"]
