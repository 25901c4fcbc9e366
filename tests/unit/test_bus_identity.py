"""Broker user names: one per service role and per worker, and the worker a user id names."""

from __future__ import annotations

import pytest

from apiary.bus.identity import service_user, worker_of, worker_user


def test_a_worker_user_names_its_worker_and_a_service_user_names_none() -> None:
    assert worker_of(worker_user("gpu-a")) == "gpu-a"
    assert worker_of(worker_user("w.1", prefix="t-"), prefix="t-") == "w.1"
    assert worker_of(service_user("aggregator")) is None
    assert worker_of(None) is None
    assert worker_of("apiary-worker.") is None
    assert worker_of("guest") is None


def test_unknown_roles_and_empty_worker_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown service role 'cook'"):
        service_user("cook")
    with pytest.raises(ValueError, match="worker id is empty"):
        worker_user("")
