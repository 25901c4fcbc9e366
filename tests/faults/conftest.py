"""Fixtures of the fault suite: a deployment to break, toy datasets, and the outcome table that is
printed at the end of the run (case | expected | observed | contributions double-counted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.support import Faults
from tests.fixtures.cluster import Cluster
from tests.toyjobs.toy import make_dataset


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
