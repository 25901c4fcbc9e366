"""Bus messages, job requests: whatever bytes arrive, decoding ends in the documented error, never a crash."""

from __future__ import annotations

import json
from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from apiary.contracts import EVENT_TYPES, JSON, MSGPACK, DecodeError, JobRequested, decode
from apiary.jobspec import JobSpec, field_errors, policy_errors
from apiary.policy import Policy
from tests.fuzz.profile import FUZZ

ROUTING_KEYS = [*sorted(EVENT_TYPES), "assign.pool", "assign.worker.w1", "no.such.key"]
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.floats()
           | st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
# Field names every message type uses, so many inputs get past the first missing field.
FIELDS = ["v", "job_id", "round", "attempt", "shard", "worker_id", "result", "samples", "secret", "weights",
          "shards", "min_workers", "deadline", "name", "entrypoint", "dataset", "model", "config", "distributed",
          "code", "error", "reason", "metrics", "env", "strategy", "strategy_params", "secret_digests"]
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=10)


def _decodes_or_refuses(key: str, body: bytes, content_type: str) -> None:
    try:
        decode(key, body, content_type)
    except DecodeError:
        pass


@FUZZ
@given(key=st.sampled_from(ROUTING_KEYS), body=st.binary(max_size=512),
       content_type=st.sampled_from([MSGPACK, JSON, None]))
def test_any_bytes_under_any_routing_key_decode_or_raise_decode_error(key: str, body: bytes,
                                                                      content_type: str) -> None:
    _decodes_or_refuses(key, body, content_type)


@FUZZ
@given(key=st.sampled_from(ROUTING_KEYS), body=bodies)
def test_any_map_of_plausible_fields_decodes_or_raises_decode_error(key: str, body: dict[str, Any]) -> None:
    _decodes_or_refuses(key, msgpack.packb(body, use_bin_type=True), MSGPACK)
    _decodes_or_refuses(key, json.dumps(body).encode(), JSON)


@FUZZ
@given(request=bodies)
def test_job_validation_names_fields_or_accepts_and_the_policy_judges_what_it_accepts(
        request: dict[str, Any]) -> None:
    try:
        parsed = JobRequested.model_validate(request)
    except ValidationError as e:
        errors = field_errors(e, request)
        assert errors and all(isinstance(error.message, str) for error in errors)
        return
    spec = JobSpec.model_validate(parsed.model_dump(exclude={"job_id", "v"}))
    for error in policy_errors(spec, Policy()):
        assert error.field in ("entrypoint", "dataset", "model")
