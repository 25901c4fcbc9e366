"""An assignment's presigned URLs outlive its deadline by APIARY_PRESIGN_TTL (15 minutes by default), however
long the round, also when the URL comes from the presigner's memo of an earlier second's signature."""

from __future__ import annotations

import datetime
from unittest import mock
from urllib.parse import parse_qsl, urlsplit

import pytest

from apiary.contracts import ShardInfo
from apiary.jobspec import JobSpec
from apiary.settings import Settings
from apiary.storage import presign
from apiary.storage.s3 import S3Storage
from services.scheduler.round_plan import plan_round, url_lifetime

T0 = datetime.datetime(2026, 12, 1, 7, 0, 0, tzinfo=datetime.UTC)


def _expiry(url: str) -> float:
    """When a SigV4 presigned URL stops working (its date plus its lifetime), in seconds since the epoch."""
    query = dict(parse_qsl(urlsplit(url).query))
    signed = datetime.datetime.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
    return signed.timestamp() + int(query["X-Amz-Expires"])


def test_the_default_margin_past_a_deadline_is_short() -> None:
    assert Settings().presign_ttl == 15 * 60


@pytest.mark.parametrize("timeout", [60.0, 6 * 3600.0, 3 * 24 * 3600.0])
def test_a_rounds_urls_outlive_its_deadline_by_the_margin_and_no_more(monkeypatch: pytest.MonkeyPatch,
                                                                       timeout: float) -> None:
    # Prepare: S3 storage, a round of `timeout` seconds planned 0.7 s into a second in which the same URL was
    # already signed (the presigner's memo hands that one out again).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    storage = S3Storage("s3://bucket/runs", endpoint_url="http://127.0.0.1:9000", region="us-east-1")
    ttl = Settings().presign_ttl
    spec = JobSpec.model_validate({"name": "t", "entrypoint": "pkg.train", "dataset": "d",
                                   "distributed": {"num_rounds": 1, "aggregation_timeout": timeout}})
    shard = ShardInfo(key="s", size=1, sha256="0" * 64, index=0, num_samples=1)
    start = T0.timestamp() + 0.7
    with mock.patch("botocore.auth.get_current_datetime", return_value=T0), \
            mock.patch.object(presign.time, "time", return_value=T0.timestamp()):
        storage.presign_put("jobs/j/upload", int(timeout + ttl))
    plan = plan_round(spec, [shard], start)

    # Execute
    with mock.patch("botocore.auth.get_current_datetime", return_value=T0), \
            mock.patch.object(presign.time, "time", return_value=start):
        url = storage.presign_put("jobs/j/upload", url_lifetime(plan, ttl))

    # Assert: valid through the deadline plus almost all the margin (a signature dates to the second), not longer
    assert plan.deadline + ttl - 1 <= _expiry(url) <= plan.deadline + ttl
