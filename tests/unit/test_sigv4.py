"""Our presigned URLs are byte-identical to botocore's for the same instant (pure logic: no request is sent)."""

from __future__ import annotations

import datetime
from pathlib import Path
from unittest import mock
from urllib.parse import parse_qsl, urlsplit

import pytest

from apiary.storage import sigv4
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


@pytest.mark.parametrize(("url", "endpoint", "region", "token"), [
    ("s3://bucket/runs", "http://127.0.0.1:9000", "us-east-1", None),
    ("s3://bucket", "https://minio.example.com", "eu-central-1", None),
    ("s3://my-bucket/prefix/deeper", None, "us-east-1", None),
    ("s3://my-bucket/prefix", None, "eu-west-1", "FQoGZXIvYXdzE//token+with/slashes=="),
])
@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_presigned_urls_match_botocore(monkeypatch: pytest.MonkeyPatch, url: str, endpoint: str | None,
                                       region: str, token: str | None, method: str) -> None:
    storage = _storage(monkeypatch, url, endpoint, region, token)
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW):
        storage._presign(method, "probe", 600)  # the first URL comes from botocore and sets the endpoint
        for key in KEYS:
            theirs = storage._botocore_presign(method, storage._key(key), 3600)
            assert storage._presigner is not None
            ours = storage._presigner.presign(method, storage._key(key), 3600, now=NOW.timestamp())
            assert _parts(ours) == _parts(theirs), key
            assert _parts(ours)[3]["X-Amz-Signature"] == _parts(theirs)[3]["X-Amz-Signature"]


@pytest.mark.parametrize(("url", "endpoint", "region"), [
    ("s3://bucket/runs", "http://127.0.0.1:9000", "us-east-1"),
    ("s3://my-bucket/prefix", None, "eu-west-1"),
])
def test_a_put_with_signed_metadata_matches_botocore(monkeypatch: pytest.MonkeyPatch, url: str,
                                                      endpoint: str | None, region: str) -> None:
    storage = _storage(monkeypatch, url, endpoint, region, None)
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW):
        storage._presign("GET", "probe", 600)
        for key in KEYS:
            params = {"Bucket": storage.bucket, "Key": storage._key(key), "Metadata": {"sha256": digest}}
            theirs = storage._client.generate_presigned_url("put_object", Params=params, ExpiresIn=300)
            assert storage._presigner is not None
            ours = storage._presigner.presign("PUT", storage._key(key), 300, now=NOW.timestamp(),
                                              headers={"x-amz-meta-sha256": digest})
            assert _parts(ours) == _parts(theirs), key
            assert _parts(ours)[3]["X-Amz-SignedHeaders"] == "host;x-amz-meta-sha256"


def test_signing_key_follows_the_date_and_the_secret() -> None:
    endpoint = sigv4.Endpoint("http", "h:1", "/b/", "us-east-1", "s3")
    creds = [sigv4.Credentials("A", "secret-1")]
    presigner = sigv4.Presigner(endpoint, lambda: creds[0])
    day1 = presigner.presign("GET", "k", 60, now=NOW.timestamp())
    day2 = presigner.presign("GET", "k", 60, now=NOW.timestamp() + 5)  # past midnight UTC
    assert "X-Amz-Date=20261129T235958Z" in day1 and "X-Amz-Date=20261130T000003Z" in day2
    creds[0] = sigv4.Credentials("A", "secret-2")  # rotated (refreshed temporary credentials)
    rotated = presigner.presign("GET", "k", 60, now=NOW.timestamp() + 5)
    assert _parts(rotated)[3]["X-Amz-Signature"] != _parts(day2)[3]["X-Amz-Signature"]


def test_endpoint_rejects_a_url_for_another_key() -> None:
    with pytest.raises(ValueError, match="does not end with the key"):
        sigv4.Endpoint.from_presigned("http://h/b/other?X-Amz-Credential=A/d/r/s3/aws4_request", "key")


def test_the_adapter_trusts_aws_ca_bundle_like_boto3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Prepare: a private CA, as a MinIO behind an internal certificate authority would have.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Apiary test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))

    # Execute
    storage = _storage(monkeypatch, "s3://bucket/runs", "https://minio.internal:9000", "us-east-1", None)

    # Assert
    subjects = [dict(part[0] for part in c["subject"]) for c in storage._tls.get_ca_certs()]
    assert {"commonName": "Apiary test CA"} in subjects
