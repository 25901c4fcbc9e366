"""Fixtures of the fault suite: a deployment to break, toy datasets, and the outcome table that is
printed at the end of the run (case | expected | observed | contributions double-counted).

The cases whose outcome rests on what RabbitMQ's queues do (ON_BOTH_QUEUE_TYPES: an unacknowledged message
given back when its consumer dies, a worker's own queue holding its shard while it is away, dead-lettering,
competing replicas) run twice, on classic and on quorum queues (`APIARY_QUEUE_TYPE`); the others, whose
outcome the queue type cannot change (validation, identity, the services' own state), on classic queues.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.support import Faults
from tests.fixtures.cluster import Cluster
from tests.ports.test_bus_quorum import queue_types
from tests.toyjobs.toy import make_dataset

QUEUE_TYPES = ("classic", "quorum")
ON_BOTH_QUEUE_TYPES = {
    # redelivery of an assignment whose worker was killed, to another worker of the pool
    "test_crashes.py::test_pool_assignment_of_a_killed_worker_is_trained_by_another",
    # a pinned shard's assignment waits in its killed worker's own queue until it is back
    "test_crashes.py::test_pinned_shard_waits_for_its_killed_worker_to_come_back",
    # the reports a killed aggregator had not acknowledged, redelivered to the restarted one
    "test_crashes.py::test_aggregator_killed_after_contributions_were_recorded_resumes_without_double_counting",
    # the scheduler's messages redelivered after a kill -9 between rounds and mid-round
    "test_crashes.py::test_scheduler_killed_between_rounds_and_mid_round_resumes_the_job",
    # undecodable and malformed messages dead-lettered with their reason
    "test_bad_input.py::test_poison_messages_are_dead_lettered_with_their_reason_and_services_keep_running",
    # two replicas of each service on the same queues; one of two killed mid-round
    "test_replicas.py::test_two_replicas_of_each_service_run_two_jobs_exactly_once",
    "test_replicas.py::test_one_replica_killed_mid_round_while_the_other_goes_on",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each case of ON_BOTH_QUEUE_TYPES on both queue types (its deployment's `queue_type`)."""
    case = metafunc.definition.nodeid.rpartition("/")[2]
    if case in ON_BOTH_QUEUE_TYPES and "queue_type" in metafunc.fixturenames:
        metafunc.parametrize("queue_type", QUEUE_TYPES)


@pytest.fixture(autouse=True)
def _quorum_means_every_queue(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a case on quorum queues, while its deployment still runs: every queue it declared was one."""
    if "cluster" not in request.fixturenames or request.getfixturevalue("queue_type") != "quorum":
        yield
        return
    cluster: Cluster = request.getfixturevalue("cluster")  # set up first, so stopped after this check
    yield
    types = queue_types(cluster.exchange)
    assert "aggregator" in types and "assign.pool" in types, types
    assert {name: kind for name, kind in types.items() if kind != "quorum"} == {}


@dataclass
class Outcome:
    """One row of the fault table."""

    case: str
    expected: str
    observed: str
    double_counted: int


_OUTCOMES: list[Outcome] = []


@pytest.fixture
def faults(cluster: Cluster) -> Faults:
    """The deployment (not started yet: call `faults.cluster.start(...)`)."""
    return Faults(cluster)


@pytest.fixture
def toy_data(tmp_path: Path) -> Callable[[int], Path]:
    """A toy dataset of n samples: `toy_data(12)`."""

    def make(n: int) -> Path:
        return make_dataset(tmp_path / f"toy-{n}", n)

    return make


@pytest.fixture
def outcome() -> Callable[[str, str, str, int], None]:
    """Record a case's row for the table printed after the run (call it after the asserts)."""

    def record(case: str, expected: str, observed: str, double_counted: int) -> None:
        _OUTCOMES.append(Outcome(case, expected, observed, double_counted))

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault table for the cases that ran to the end."""
    if not _OUTCOMES:
        return
    terminalreporter.section("fault cases")
    terminalreporter.write_line("case | expected | observed | contributions double-counted")
    for o in _OUTCOMES:
        terminalreporter.write_line(f"{o.case} | {o.expected} | {o.observed} | {o.double_counted}")
