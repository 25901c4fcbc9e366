"""What each broker user may do (pure): a worker's permissions name only its own queues, the pool and its
events; services publish only their own events; passwords are hashed as RabbitMQ does."""

from __future__ import annotations

import base64
import re

import pytest

from services.app.broker_plan import definitions, password_hash, plan, queue_policy, service, worker


def test_a_worker_may_read_only_its_own_queues_and_the_pool() -> None:
    # Prepare
    w1 = worker("w1", "apiary")

    # Assert
    for queue in ("apiary.assign.worker.w1", "apiary.assign.prefer.w1", "apiary.control.worker.w1",
                  "apiary.assign.pool", "apiary.hold.0123abcd"):
        assert re.match(w1.read, queue), queue
    for queue in ("apiary.assign.worker.w10", "apiary.assign.worker.w2", "apiary.aggregator", "apiary.tracker",
                  "apiary.scheduler", "apiary.dead", "other.assign.worker.w1", "apiary.control.worker.w1x"):
        assert not re.match(w1.read, queue), queue
        assert not re.match(w1.configure, queue) or queue == "apiary.dead", queue


def test_a_worker_publishes_only_worker_events_and_binds_only_its_own_keys() -> None:
    # Prepare
    w1 = worker("w1", "apiary")

    # Assert
    assert all(re.match(w1.topic_write, key) for key in
               ("worker.done", "worker.heartbeat", "worker.initialized", "worker.evaluated"))
    assert not any(re.match(w1.topic_write, key) for key in
                   ("round.aggregated", "job.requested", "job.cancel", "assign.worker.w2", "worker", "xworker.done",
                    "assign.pool", "job.initialized", "round.evaluated", "report.forged"))
    assert re.match(w1.topic_read, "assign.worker.w1") and re.match(w1.topic_read, "job.failed")
    assert not any(re.match(w1.topic_read, key) for key in ("#", "worker.done", "assign.worker.w2", "job.#"))


def test_services_publish_their_own_events_only() -> None:
    # Assert
    assert re.match(service("tracker", "apiary").topic_write, "job.requested")
    assert not re.match(service("tracker", "apiary").topic_write, "worker.done")
    assert not re.match(service("sharder", "apiary").topic_write, "round.aggregated")
    assert not re.match(service("scheduler", "apiary").topic_write, "worker.done")
    assert all(re.match(service("scheduler", "apiary").topic_write, key) for key in
               ("round.evaluated", "report.forged", "assign.pool"))


def test_an_exchange_name_with_regex_characters_is_matched_literally() -> None:
    # Prepare
    w1 = worker("w1", "a.b+c")

    # Assert
    assert re.match(w1.read, "a.b+c.assign.pool")
    assert not re.match(w1.read, "aXbbc.assign.pool")


def test_a_password_is_hashed_as_rabbitmq_stores_it() -> None:
    # Prepare: guest/guest as a RabbitMQ 3.10 broker exported it
    stored = "CkNybbBcC7KTSY1SGqR77cC6OfZpq/ngOKJ2/6RAv6eR0zAY"

    # Execute
    again = password_hash("guest", salt=base64.b64decode(stored)[:4])

    # Assert
    assert again == stored
    assert password_hash("guest") != password_hash("guest")  # a fresh salt each time


def test_definitions_hold_users_with_a_password_and_every_users_permissions() -> None:
    # Prepare
    users = plan("apiary", ["w1"])

    # Execute
    made = definitions(users, "/", "apiary", {"apiary-worker.w1": "secret"})

    # Assert
    assert [u["name"] for u in made["users"]] == ["apiary-worker.w1"]
    assert "secret" not in str(made)
    assert {p["user"] for p in made["permissions"]} == {u.name for u in users} == \
        {p["user"] for p in made["topic_permissions"]}
    assert [u.name for u in users][:4] == ["apiary-scheduler", "apiary-sharder", "apiary-aggregator", "apiary-tracker"]


def test_the_queue_policy_gives_the_exchanges_classic_queues_the_second_storage_and_no_others() -> None:
    # Execute
    made = definitions(plan("apiary", []), "/", "apiary", {})
    policy = queue_policy("apiary", "/")

    # Assert
    assert made["policies"] == [policy]
    assert (policy["apply-to"], policy["definition"]) == ("queues", {"queue-version": 2})
    pattern = re.compile(policy["pattern"])
    assert all(pattern.match(q) for q in ("apiary.aggregator", "apiary.assign.prefer.w1", "apiary.dead"))
    assert not any(pattern.match(q) for q in ("apiaryx.aggregator", "other.apiary.aggregator", "apiary"))


def test_a_worker_id_that_could_widen_its_permissions_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("worker id 'w1|.*' is invalid")):
        worker("w1|.*", "apiary")
