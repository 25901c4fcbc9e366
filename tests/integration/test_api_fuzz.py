"""The tracker's HTTP API fuzzed from its own OpenAPI document (Schemathesis), with its tables on SQLite and on
PostgreSQL: every route and method, as an admin, a submitter, a viewer and with no token, inputs that fit the
schema and inputs that do not. No answer may be a 5xx, and every answer must be one the document declares,
with its content type and body schema.

A bounded, seeded run is part of the suite (APIARY_API_FUZZ_EXAMPLES inputs per operation and mode as the admin, a
quarter of that with each other token; APIARY_API_FUZZ_SEED); scripts/fuzz_api.py runs it with many more.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup

from apiary.settings import Settings
from services.app.runtime import Embedded
from services.tracker import token_store

EXAMPLES = int(os.environ.get("APIARY_API_FUZZ_EXAMPLES", "20"))
SEED = int(os.environ.get("APIARY_API_FUZZ_SEED", "44"))
ROLES = ("admin", "submitter", "viewer")
CHECKS: list[CheckFunction] = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
                               schemathesis.checks.content_type_conformance,
                               schemathesis.checks.response_schema_conformance]
# A code bundle's body is bytes like a registered file's (its checks answer 422, which is what is fuzzed).
schemathesis.serializer.alias("application/zip", "application/octet-stream")
# A live stream never ends by itself: its answer is read up to its first event, which each stream sends at once.
# The first event, like any other answer, may take long on a loaded machine (a 0.3 s limit on a stream's answer
# failed CI when a 404 took longer).
STREAM_EVENTS = 1
TIMEOUT = 30.0


@dataclass
class Served:
    """A running stack's tracker over HTTP, and a token per role (None: no token)."""

    url: str
    tokens: dict[str, str | None]


@pytest.fixture(params=["sqlite", "postgres"])
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    database_url = (f"sqlite:///{tmp_path / 'apiary.db'}" if request.param == "sqlite"
                    else request.getfixturevalue("postgres_url"))
    settings = Settings(home=tmp_path / ".apiary", database_url=database_url, http_port=0,
                        heartbeat_interval=0.5, progress_interval=0.0, data_roots=[tmp_path])
    async with Embedded(settings, workers=0) as stack:
        url = await stack.tracker.start_http()
        db = stack.ports.db
        await token_store.migrate(db)
        tokens: dict[str, str | None] = {role: await token_store.create(db, f"{role}-1", role) for role in ROLES}
        yield Served(url, {**tokens, "none": None})


@dataclass
class Fuzzed:
    """What a run sent and what it found."""

    cases: int = 0
    failures: list[str] = field(default_factory=list)


def fuzz(url: str, tokens: dict[str, str | None], examples: int, seed: int) -> Fuzzed:
    """Every operation of the API's document, fuzzed for each token and generation mode."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json",
                                           config=SchemathesisConfig.from_dict({"max-stream-events": STREAM_EVENTS}))
    fuzzed = Fuzzed()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for who, token in tokens.items():
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                # The admin reaches every handler with every input; the other roles mostly meet the token check
                # (a 401 or 403 whatever the input), which a quarter of the inputs covers.
                cases = examples if who == "admin" else max(1, examples // 4)
                try:
                    _cases(operation, mode, url, headers, cases, seed, fuzzed)()
                except (AssertionError, FailureGroup) as e:  # each failure is reported, the run goes on
                    fuzzed.failures.append(f"{operation.label} [{mode.value}, {who}]: {e}")
    return fuzzed


def _cases(operation: schemathesis.APIOperation, mode: GenerationMode, url: str, headers: dict[str, str],
           examples: int, seed: int, fuzzed: Fuzzed) -> Callable[[], None]:
    """A hypothesis test that sends `examples` cases of one operation and checks each answer."""
    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def send(case: schemathesis.Case) -> None:
        fuzzed.cases += 1
        case.call_and_validate(base_url=url, headers=headers, checks=CHECKS, timeout=TIMEOUT)

    return send  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_no_input_makes_the_api_fail_or_answer_outside_its_document(served: Served) -> None:
    fuzzed = await asyncio.to_thread(fuzz, served.url, served.tokens, EXAMPLES, SEED)

    print(f"{fuzzed.cases} cases sent, {len(fuzzed.failures)} failed")
    assert fuzzed.cases > 0
    assert not fuzzed.failures, "\n\n".join(fuzzed.failures)


# What the fuzzer (or the issue) found, each answered as it is now: (case, method, path, keyword arguments of
# the request, the status, a piece of its detail).
BIG = 2**70
FOUND = [
    ("a model id past int64 (the issue: 500 from the registry lookup)", "POST", "/training-jobs",
     {"json": {"name": "neg", "dataset_id": -1, "model_id": 1180591620717411303424}}, 422, "expected an id from 1"),
    ("a registered model's id past int64 (500: SQLite OverflowError, asyncpg DataError)", "GET", f"/models/{BIG}",
     {}, 422, "item_id"),
    ("a registered dataset's id past int64 (500, as models)", "GET", f"/datasets/{BIG}", {}, 422, "item_id"),
    ("a metrics cursor past int64", "GET", f"/training-jobs/j/metrics?after={BIG}", {}, 422, "after"),
    ("a job id no request can have", "GET", "/training-jobs/a%00b", {}, 422, "job_id"),
    ("a metric name with a NUL", "GET", "/training-jobs/j/metrics?name=a%00b", {}, 404, "no job"),
    ("a job name with a NUL", "POST", "/training-jobs",
     {"json": {"name": "a\x00b", "entrypoint": "examples.x:f", "dataset": "s3://bucket/data"}}, 422, "name"),
    ("a body that is no UTF-8 (undocumented 400, saying only that it could not be parsed)", "POST",
     "/training-jobs", {"content": b"\xff\x119", "headers": {"content-type": "application/json"}}, 400,
     "UnicodeDecodeError"),
    ("no token (undocumented 401)", "GET", "/workers", {"headers": {"Authorization": ""}}, 401, "missing token"),
    ("a body past the limit, its length declared", "POST", "/training-jobs",
     {"content": b" " * (2**20 + 1), "headers": {"content-type": "application/json"}}, 413, "1048576-byte limit"),
    ("a body past the limit, sent in chunks", "POST", "/training-jobs",
     {"content": [b" " * 2**16] * 17, "headers": {"content-type": "application/json"}}, 413,
     "over the 1048576-byte limit"),
]


@pytest.mark.parametrize("case", FOUND, ids=[case[0] for case in FOUND])
async def test_what_the_fuzzer_found_is_answered_with_a_4xx_that_says_why(
        served: Served, case: tuple[str, str, str, dict[str, Any], int, str]) -> None:
    _, method, path, given, status, why = case
    kwargs = {**given, "headers": {"Authorization": f"Bearer {served.tokens['admin']}", **given.get("headers", {})}}
    if isinstance(given.get("content"), list):
        kwargs["content"] = _chunks(given["content"])  # no Content-Length: sent chunked

    async with httpx.AsyncClient(base_url=f"{served.url}/api/v1", timeout=30) as http:
        response = await http.request(method, path, **kwargs)

    assert response.status_code == status, response.text
    assert why in response.text


async def _chunks(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
