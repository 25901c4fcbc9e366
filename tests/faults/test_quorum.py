"""A representative set of the fault suite again, on RabbitMQ quorum queues (`APIARY_QUEUE_TYPE=quorum`):
a worker killed mid-training (its assignment back to the pool), and one replica of the scheduler and of the
aggregator killed mid-round while the others go on. Each test checks that its deployment's queues were all
quorum queues."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.test_crashes import test_pool_assignment_of_a_killed_worker_is_trained_by_another
from tests.faults.test_replicas import test_one_replica_killed_mid_round_while_the_other_goes_on
from tests.fixtures.cluster import Cluster
from tests.ports.test_bus_quorum import queue_types

__all__ = [
    "test_one_replica_killed_mid_round_while_the_other_goes_on",
    "test_pool_assignment_of_a_killed_worker_is_trained_by_another",
]


@pytest.fixture
def queue_type() -> str:
    """Every process of these deployments declares quorum queues."""
    return "quorum"


@pytest.fixture(autouse=True)
def _all_quorum(cluster: Cluster) -> Iterator[None]:
    """After the test, while its deployment still runs: every queue it declared is a quorum queue."""
    yield
    types = queue_types(cluster.exchange)
    assert "aggregator" in types and "assign.pool" in types, types
    assert {name: kind for name, kind in types.items() if kind != "quorum"} == {}
