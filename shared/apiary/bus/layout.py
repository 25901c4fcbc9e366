"""The durable topology every Apiary process declares before it publishes or consumes: each service's queue
with all its bindings, and the pool of assignments. A message published before its consumer first started
then waits in its queue instead of being lost (with nothing bound, a job request used to reach the
tracker alone). Each service binds the same patterns again when it subscribes: this table must name them
all (tests/unit/test_bus_layout.py checks it against the services' handlers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

POOL = "assign.pool"  # apiary.assignments.POOL (imported from there, it would import the bus package)
SERVICE_QUEUES: Mapping[str, Sequence[str]] = {
    "scheduler": ("job.requested", "job.sharded", "round.aggregated", "round.failed", "worker.initialized",
                  "worker.evaluated", "worker.merged", "task.timeout", "job.cancel", "worker.online",
                  "worker.heartbeat", "worker.offline", "worker.done.async", "worker.failed.async"),
    "sharder": ("shard.requested",),
    "aggregator": ("round.start", "worker.done", "worker.failed", "worker.done.async", "worker.failed.async",
                   "round.timeout", "job.failed", "job.completed", "worker.secagg.keys", "worker.secagg.shares",
                   "worker.secagg.check", "worker.secagg.reveal", "round.assigned"),
    "tracker": ("#",),
    POOL: (POOL,),
}
# Where an unroutable message goes (RabbitMQ: the exchange's alternate exchange, into the dead-letter queue).
UNROUTABLE = "unroutable"
