"""Our presigned URLs are byte-identical to botocore's client for the same instant (no request is sent)."""

from __future__ import annotations

import datetime
from unittest import mock
from urllib.parse import parse_qsl, urlsplit

import pytest
from botocore.credentials import ReadOnlyCredentials

from apiary.storage import presign
from apiary.storage.s3 import S3Storage

KEYS = [
    "jobs/j1/rounds/0003/shard-0001.safetensors",
    "datasets/ds 1/shard (2).zip",
    "jobs/é ü/ключ/+&=?#%.bin",
    "a~b/c!d*e'f(g)h",
]
NOW = datetime.datetime(2026, 11, 29, 23, 59, 58, tzinfo=datetime.UTC)


def _storage(monkeypatch: pytest.MonkeyPatch, url: str, endpoint: str | None, region: str,
             token: str | None) -> S3Storage:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    if token:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    else:
        monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return S3Storage(url, endpoint_url=endpoint, region=region)


def _parts(url: str) -> tuple[str, str, str, dict[str, str]]:
    p = urlsplit(url)
    return p.scheme, p.netloc, p.path, dict(parse_qsl(p.query, keep_blank_values=True))


def _at(when: datetime.datetime) -> mock._patch[mock.MagicMock]:
    return mock.patch("botocore.auth.get_current_datetime", return_value=when)


@pytest.mark.parametrize(("url", "endpoint", "region", "token"), [
    ("s3://bucket/runs", "http://127.0.0.1:9000", "us-east-1", None),
    ("s3://bucket", "https://minio.example.com", "eu-central-1", None),
    ("s3://my-bucket/prefix/deeper", None, "us-east-1", None),
    ("s3://my-bucket/prefix", None, "eu-west-1", "FQoGZXIvYXdzE//token+with/slashes=="),
])
@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_presigned_urls_match_botocore(monkeypatch: pytest.MonkeyPatch, url: str, endpoint: str | None,
                                       region: str, token: str | None, method: str) -> None:
    # Prepare
    storage = _storage(monkeypatch, url, endpoint, region, token)
    operation = "get_object" if method == "GET" else "put_object"
    with _at(NOW):
        for key in KEYS:
            # Execute
            ours = storage.presign_get(key, 3600) if method == "GET" else storage.presign_put(key, 3600)
            theirs = storage._client.generate_presigned_url(
                operation, Params={"Bucket": storage.bucket, "Key": storage._key(key)}, ExpiresIn=3600)

            # Assert
            assert _parts(ours) == _parts(theirs), key
            assert ours.endswith("&X-Amz-Signature=" + _parts(theirs)[3]["X-Amz-Signature"])


@pytest.mark.parametrize(("url", "endpoint", "region"), [
    ("s3://bucket/runs", "http://127.0.0.1:9000", "us-east-1"),
    ("s3://my-bucket/prefix", None, "eu-west-1"),
])
def test_a_put_with_signed_metadata_matches_botocore(monkeypatch: pytest.MonkeyPatch, url: str,
                                                      endpoint: str | None, region: str) -> None:
    # Prepare
    storage = _storage(monkeypatch, url, endpoint, region, None)
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    with _at(NOW):
        for key in KEYS:
            # Execute
            ours = storage._presign("PUT", key, 300, headers={"x-amz-meta-sha256": digest})
            params = {"Bucket": storage.bucket, "Key": storage._key(key), "Metadata": {"sha256": digest}}
            theirs = storage._client.generate_presigned_url("put_object", Params=params, ExpiresIn=300)

            # Assert
            assert _parts(ours) == _parts(theirs), key
            assert _parts(ours)[3]["X-Amz-SignedHeaders"] == "host;x-amz-meta-sha256"


def test_every_url_is_signed_with_the_credentials_of_the_moment() -> None:
    # Prepare: credentials that rotate, as refreshed temporary credentials do.
    endpoint = presign.Endpoint("http://h:1/b/", "us-east-1", "s3")
    creds = [ReadOnlyCredentials("A", "secret-1", None)]
    presigner = presign.Presigner(endpoint, lambda: creds[0])

    # Execute
    with _at(NOW):
        first = presigner.presign("GET", "k", 60)
        creds[0] = ReadOnlyCredentials("A", "secret-2", "session")
        rotated = presigner.presign("GET", "k", 60)

    # Assert
    assert _parts(rotated)[3]["X-Amz-Signature"] != _parts(first)[3]["X-Amz-Signature"]
    assert _parts(rotated)[3]["X-Amz-Security-Token"] == "session"
    assert _parts(first)[3]["X-Amz-Date"] == "20261129T235958Z"


def test_endpoint_is_read_from_a_url_botocore_presigned() -> None:
    # Execute
    endpoint = presign.Endpoint.from_presigned(
        "http://h:9/b/dir/a%20b?X-Amz-Credential=A%2F20260101%2Feu-west-1%2Fs3%2Faws4_request", "dir/a b")

    # Assert
    assert endpoint == presign.Endpoint("http://h:9/b/", "eu-west-1", "s3")


def test_endpoint_rejects_a_url_for_another_key() -> None:
    with pytest.raises(ValueError, match="does not end with the key"):
        presign.Endpoint.from_presigned("http://h/b/other?X-Amz-Credential=A/d/r/s3/aws4_request", "key")
