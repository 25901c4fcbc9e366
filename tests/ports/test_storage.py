"""One behaviour suite for the storage port, run against a local folder and S3 (moto server)."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from apiary import transfer
from apiary.contracts import ObjectRef
from apiary.storage.base import ObjectNotFound, Storage, StorageUnavailable
from apiary.storage.s3 import MULTIPART_THRESHOLD, S3Storage
from apiary.transfer import Backoff, TransferError, download, probe, upload
from tests.ports.flaky import FlakyFront, flaky_front


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def front(monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyFront]:
    """A server in front of presigned URLs that fails on cue; transfers retry without waiting long."""
    monkeypatch.setattr(transfer, "RETRY", Backoff(attempts=3, base=0.01))
    with flaky_front() as f:
        yield f


async def test_bytes_round_trip_with_their_size_and_sha256(storage: Storage) -> None:
    # Prepare
    data = b"weights" * 1000

    # Execute
    ref = await storage.put_bytes("jobs/j1/round-1/global.safetensors", data)
    back = await storage.get_bytes("jobs/j1/round-1/global.safetensors")

    # Assert
    assert ref == ObjectRef(key="jobs/j1/round-1/global.safetensors", size=len(data), sha256=sha256(data))
    assert back == data
    assert await storage.verified_bytes(ref) == data


async def test_files_round_trip_without_changing_a_byte(storage: Storage, tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "shard.zip"
    data = os.urandom(300_000)
    source.write_bytes(data)
    target = tmp_path / "downloads" / "shard.zip"

    # Execute
    ref = await storage.put_file("datasets/d1/shard-0.zip", source)
    await storage.get_file("datasets/d1/shard-0.zip", target)

    # Assert
    assert (ref.size, ref.sha256) == (len(data), sha256(data))
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["shard.zip"], "a temporary file was left behind"


async def test_a_large_file_round_trips(storage: Storage, tmp_path: Path) -> None:
    # Prepare: above the multipart threshold on S3.
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(20 * 1024 * 1024))
    target = tmp_path / "back.safetensors"

    # Execute
    ref = await storage.put_file("jobs/j1/final/model.safetensors", source)
    await storage.get_file("jobs/j1/final/model.safetensors", target)

    # Assert
    assert ref.size == 20 * 1024 * 1024
    assert ref.sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    assert hashlib.sha256(target.read_bytes()).hexdigest() == ref.sha256


async def test_a_missing_key_raises_object_not_found(storage: Storage, tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(ObjectNotFound):
        await storage.get_bytes("jobs/none/model")
    with pytest.raises(ObjectNotFound):
        await storage.get_file("jobs/none/model", tmp_path / "model")
    assert not await storage.exists("jobs/none/model")
    assert not (tmp_path / "model").exists()


async def test_list_returns_the_keys_under_a_prefix_sorted(storage: Storage) -> None:
    # Prepare
    for key in ["jobs/j2/a", "jobs/j1/round-2/w", "jobs/j1/round-1/w", "datasets/d1/manifest.json"]:
        await storage.put_bytes(key, key.encode())

    # Execute
    j1 = await storage.list("jobs/j1/")
    jobs = await storage.list("jobs/")
    none = await storage.list("nothing/")

    # Assert
    assert j1 == ["jobs/j1/round-1/w", "jobs/j1/round-2/w"]
    assert jobs == ["jobs/j1/round-1/w", "jobs/j1/round-2/w", "jobs/j2/a"]
    assert none == []


async def test_delete_removes_an_object_and_ignores_a_missing_one(storage: Storage) -> None:
    # Prepare
    await storage.put_bytes("jobs/j1/tmp", b"x")

    # Execute
    await storage.delete("jobs/j1/tmp")
    await storage.delete("jobs/j1/never-there")

    # Assert
    assert not await storage.exists("jobs/j1/tmp")
    assert await storage.list("jobs/") == []


async def test_delete_many_removes_every_object_named_and_ignores_a_missing_one(storage: Storage) -> None:
    # Prepare
    for name in ("a", "b", "c", "keep"):
        await storage.put_bytes(f"jobs/j1/{name}", name.encode())

    # Execute
    await storage.delete_many(["jobs/j1/a", "jobs/j1/b", "jobs/j1/never-there", "jobs/j1/c"])
    await storage.delete_many([])

    # Assert
    assert await storage.list("jobs/") == ["jobs/j1/keep"]


async def test_an_overwrite_replaces_the_object(storage: Storage) -> None:
    # Execute
    await storage.put_bytes("jobs/j1/status", b"running")
    ref = await storage.put_bytes("jobs/j1/status", b"done")

    # Assert
    assert await storage.get_bytes("jobs/j1/status") == b"done"
    assert ref.sha256 == sha256(b"done")


@pytest.mark.parametrize("key", ["", "/etc/passwd", "jobs/../../escape", "jobs//double", "jobs/./here"])
async def test_keys_that_could_escape_the_store_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError, match="invalid storage key"):
        await storage.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="invalid storage key"):
        await storage.get_bytes(key)


async def test_a_presigned_get_downloads_by_url_with_its_sha256_checked(
    storage: Storage, tmp_path: Path
) -> None:
    # Prepare
    data = os.urandom(50_000)
    ref = await storage.put_bytes("jobs/j1/round-1/global", data)
    url = storage.presign_get(ref.key, expires=300)

    # Execute
    await download(url, tmp_path / "global", sha256=ref.sha256)

    # Assert
    assert (tmp_path / "global").read_bytes() == data
    with pytest.raises(TransferError, match="sha256 mismatch"):
        await download(url, tmp_path / "tampered", sha256=sha256(b"something else"))
    assert not (tmp_path / "tampered").exists()


async def test_a_presigned_put_uploads_by_url(storage: Storage, tmp_path: Path) -> None:
    # Prepare: a worker holds only the URL, not the storage credentials.
    data = os.urandom(70_000)
    source = tmp_path / "update.safetensors"
    source.write_bytes(data)
    url = storage.presign_put("jobs/j1/round-1/workers/w1", expires=300)

    # Execute
    await upload(url, source)

    # Assert
    ref = ObjectRef(key="jobs/j1/round-1/workers/w1", size=len(data), sha256=sha256(data))
    assert await storage.verified_bytes(ref) == data


async def test_a_probe_by_presigned_url_reads_a_small_object_or_finds_none(storage: Storage) -> None:
    await storage.put_bytes("jobs/j1/ended.json", b'{"reason": "cancelled by user"}')

    present = await probe(storage.presign_get("jobs/j1/ended.json", expires=300))
    missing = await probe(storage.presign_get("jobs/j2/ended.json", expires=300))
    unreachable = await probe("http://127.0.0.1:9/jobs/j1/ended.json")

    assert present == b'{"reason": "cancelled by user"}'
    assert missing is None and unreachable is None


async def test_a_transfer_by_url_is_retried_after_a_transient_503(
    storage: Storage, front: FlakyFront, tmp_path: Path
) -> None:
    # Prepare
    data = os.urandom(100_000)
    ref = await storage.put_bytes("jobs/j1/round-1/global", data)
    source = tmp_path / "update"
    source.write_bytes(data[::-1])

    # Execute: one 503 before each
    front.failures = ["503"]
    await download(front.url(storage.presign_get(ref.key, expires=300)), tmp_path / "global", sha256=ref.sha256)
    front.failures = ["503"]
    await upload(front.url(storage.presign_put("jobs/j1/round-1/workers/w1", expires=300)), source)

    # Assert
    assert (tmp_path / "global").read_bytes() == data
    assert await storage.get_bytes("jobs/j1/round-1/workers/w1") == data[::-1]
    assert front.requests == [("GET", None), ("GET", None), ("PUT", None), ("PUT", None)]


async def test_a_download_cut_off_midway_resumes_from_where_it_stopped(
    storage: Storage, front: FlakyFront, tmp_path: Path
) -> None:
    # Prepare
    data = os.urandom(1_000_000)
    ref = await storage.put_bytes("jobs/j1/final/model", data)
    front.failures = ["drop"]
    target = tmp_path / "downloads" / "model"

    # Execute
    await download(front.url(storage.presign_get(ref.key, expires=300)), target, sha256=ref.sha256)

    # Assert
    assert target.read_bytes() == data
    assert front.requests == [("GET", None), ("GET", f"bytes={len(data) // 2}-")]
    assert [p.name for p in target.parent.iterdir()] == ["model"], "a partial file was left behind"


async def test_a_resumed_download_is_still_checked_against_its_sha256(
    storage: Storage, front: FlakyFront, tmp_path: Path
) -> None:
    # Prepare: the first half arrives intact, the resumed rest corrupted.
    data = os.urandom(200_000)
    ref = await storage.put_bytes("jobs/j1/final/model", data)
    front.failures = ["drop", "corrupt"]
    target = tmp_path / "downloads" / "model"

    # Execute / Assert
    with pytest.raises(TransferError, match="sha256 mismatch"):
        await download(front.url(storage.presign_get(ref.key, expires=300)), target, sha256=ref.sha256)
    assert list(target.parent.iterdir()) == []


async def test_a_transfer_gives_up_after_its_attempts(storage: Storage, front: FlakyFront, tmp_path: Path) -> None:
    # Prepare
    ref = await storage.put_bytes("jobs/j1/round-1/global", b"weights")
    front.failures = ["503"] * 3

    # Execute / Assert
    with pytest.raises(TransferError, match="failed after 3 attempts: HTTP 503"):
        await download(front.url(storage.presign_get(ref.key, expires=300)), tmp_path / "global")
    assert len(front.requests) == 3
    assert not (tmp_path / "global").exists()


async def test_uri_names_the_object_for_people(storage: Storage) -> None:
    # Execute
    uri = storage.uri("jobs/j1/final/model")

    # Assert
    assert uri.startswith(("file:///", "s3://"))
    assert uri.endswith("jobs/j1/final/model")


# --- S3 only ---------------------------------------------------------------------------------------


def _client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


async def test_s3_stores_the_sha256_as_metadata_and_sends_large_files_in_parts(
    s3_url: str, s3_server: str, tmp_path: Path
) -> None:
    # Prepare
    storage = S3Storage(s3_url, endpoint_url=s3_server)
    source = tmp_path / "big"
    source.write_bytes(os.urandom(2 * MULTIPART_THRESHOLD + 1024))

    # Execute
    small = await storage.put_bytes("small", b"tiny")
    big = await storage.put_file("big", source)

    # Assert
    client = _client(s3_server)
    head_small = client.head_object(Bucket=storage.bucket, Key="runs/small")
    head_big = client.head_object(Bucket=storage.bucket, Key="runs/big")
    assert head_small["Metadata"] == {"sha256": small.sha256}
    assert head_big["Metadata"] == {"sha256": big.sha256}
    assert head_big["ETag"].strip('"').endswith("-3"), "expected a three-part multipart upload"
    assert storage.uri("big") == f"s3://{storage.bucket}/runs/big"


async def test_s3_refuses_an_object_whose_bytes_do_not_match_its_sha256(
    s3_url: str, s3_server: str, tmp_path: Path
) -> None:
    # Prepare: the bytes change behind the adapter's back, the metadata does not.
    storage = S3Storage(s3_url, endpoint_url=s3_server)
    ref = await storage.put_bytes("model", b"the real weights")
    _client(s3_server).put_object(
        Bucket=storage.bucket, Key="runs/model", Body=b"corrupted!", Metadata={"sha256": ref.sha256}
    )

    # Execute / Assert
    with pytest.raises(ValueError, match="sha256 mismatch"):
        await storage.get_bytes("model")
    with pytest.raises(ValueError, match="sha256 mismatch"):
        await storage.get_file("model", tmp_path / "model")
    assert not (tmp_path / "model").exists()


async def test_s3_creates_its_bucket_on_first_use(s3_url: str, s3_server: str) -> None:
    # Prepare
    storage = S3Storage(s3_url, endpoint_url=s3_server)

    # Execute
    await storage.put_bytes("first", b"1")

    # Assert
    assert storage.bucket in [b["Name"] for b in _client(s3_server).list_buckets()["Buckets"]]


async def test_an_unreachable_s3_raises_storage_unavailable() -> None:
    # Prepare: a port nothing listens on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = S3Storage("s3://nowhere/p", endpoint_url=f"http://127.0.0.1:{port}")

    # Execute / Assert
    with pytest.raises(StorageUnavailable, match=f"127.0.0.1:{port}"):
        await storage.put_bytes("k", b"x")
    with pytest.raises(StorageUnavailable, match=f"127.0.0.1:{port}"):
        await storage.get_bytes("k")
