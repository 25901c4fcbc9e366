"""What the HTTP API bounds: ids and counts in the job request (and its schema), and each route's body limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from apiary import bundle
from apiary.contracts import JobRequested
from apiary.jobspec import INT64_MAX, field_errors
from apiary.settings import Settings
from services.tracker.api import body_limits
from services.tracker.body_limit import Limit, too_large

REQUEST = {"name": "n", "entrypoint": "examples.m:f"}


def _errors(request: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as info:
        JobRequested.model_validate(request)
    return {e.field: e.message for e in field_errors(info.value)}


@pytest.mark.parametrize("bad", [0, -1, INT64_MAX + 1, 2**70, str(2**70)])
def test_a_registry_id_outside_1_to_int64_is_one_line_naming_the_range(bad: int | str) -> None:
    errors = _errors({**REQUEST, "dataset_id": bad})

    assert errors == {"dataset_id": f"expected an id from 1 to {INT64_MAX}, got {int(bad)}"}


def test_ids_at_the_bounds_and_older_hex_ids_are_accepted() -> None:
    for good in (1, INT64_MAX, str(INT64_MAX), "a1b2c3"):
        assert JobRequested.model_validate({**REQUEST, "dataset_id": good, "model_id": good})


def test_the_schema_says_what_an_id_and_a_count_may_be() -> None:
    schema = JobRequested.model_json_schema()
    dataset_id = schema["properties"]["dataset_id"]["anyOf"]
    distributed = schema["$defs"]["DistributedConfig"]["properties"]

    assert {"type": "integer", "minimum": 1, "maximum": INT64_MAX} in dataset_id
    assert distributed["min_workers"]["maximum"] == 10_000
    assert distributed["steps_per_round"]["anyOf"][0]["maximum"] == INT64_MAX


def test_a_job_name_with_a_nul_is_refused_postgresql_cannot_store_it() -> None:
    assert _errors({**REQUEST, "dataset": "d", "name": "a\x00b"}) == {
        "name": "must not contain a NUL character (\\u0000)"}


def test_each_route_has_its_body_limit() -> None:
    limit_of = body_limits(Settings(http_body_limit=1000))

    def size(method: str, path: str) -> int | None:
        limit = limit_of(method, path)
        return limit.size if limit is not None else None

    assert size("POST", "/api/v1/training-jobs") == size("POST", "/api/v1/training-jobs/j/cancel") == 1000
    assert size("GET", "/api/v1/models") == 1000
    assert size("POST", "/api/v1/code") == bundle.MAX_BUNDLE_BYTES
    assert size("POST", "/api/v1/models") is None and size("POST", "/api/v1/datasets") is None


def test_the_413_says_how_big_the_body_is_and_the_limit() -> None:
    limit = Limit(1000, "send less")

    assert too_large(2000, limit, "POST", "/p") == ("request body is 2000 bytes, over the 1000-byte limit of "
                                                    "POST /p: send less")
    assert too_large(None, limit, "POST", "/p") == "request body is over the 1000-byte limit of POST /p: send less"


def test_the_body_limit_is_a_setting_within_64_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIARY_HTTP_BODY_LIMIT", "2048")

    assert Settings().http_body_limit == 2048
    with pytest.raises(ValidationError):
        Settings(http_body_limit=65 * 2**20)
