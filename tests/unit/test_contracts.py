"""Bus messages: msgpack round trip, schema version, and malformed bodies."""

from __future__ import annotations

import json

import msgpack
import pytest

from apiary.contracts import (
    EVENT_TYPES,
    JSON,
    Assignment,
    DecodeError,
    ObjectRef,
    WorkerDone,
    decode,
    encode,
    model_for,
)


def test_every_routing_key_has_one_model() -> None:
    assert {"job.requested", "job.accepted", "job.rejected", "shard.requested", "job.sharded", "round.start",
            "worker.progress", "worker.done", "worker.failed", "round.timeout", "round.aggregated",
            "round.failed", "job.completed", "job.failed", "worker.online", "worker.heartbeat"} <= set(EVENT_TYPES)
    assert model_for("assign.pool") is Assignment and model_for("assign.worker.w1") is Assignment


def test_msgpack_round_trip() -> None:
    event = WorkerDone(job_id="j", round=2, attempt=1, worker_id="w", shard=0,
                       result=ObjectRef(key="k", size=3, sha256="ab"), samples=10, metrics={"loss": 0.5})

    assert decode("worker.done", encode(event)) == event


def test_json_bodies_are_accepted_when_labelled() -> None:
    body = json.dumps({"job_id": "j", "round": 1, "attempt": 1}).encode()

    assert decode("round.timeout", body, JSON).job_id == "j"


@pytest.mark.parametrize(
    ("key", "body", "message"),
    [
        ("worker.done", b"\xc1\xc1garbage", "not valid"),
        ("worker.done", msgpack.packb([1, 2]), "must be a map"),
        ("worker.done", msgpack.packb({"v": 99, "job_id": "j"}), "schema version 99"),
        ("worker.done", msgpack.packb({"job_id": "j", "round": 1}), "malformed"),
        ("no.such.key", msgpack.packb({}), "no message type"),
    ],
)
def test_malformed_messages_raise_decode_error(key: str, body: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(key, body)
