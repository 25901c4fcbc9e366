"""Fixtures of the fault suite: a deployment to break, toy datasets, and the outcome table that is
printed at the end of the run (case | expected | observed | contributions double-counted).

The cases whose outcome rests on what RabbitMQ's queues do (marked `queue_types`: an unacknowledged message
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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each case marked `queue_types` on both queue types (its deployment's `queue_type`)."""
    if metafunc.definition.get_closest_marker("queue_types") and "queue_type" in metafunc.fixturenames:
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
