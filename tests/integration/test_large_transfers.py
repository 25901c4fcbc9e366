"""Large objects against a real S3 server (moto): multipart uploads by presigned part URLs that resume with only the
missing parts, parallel ranged downloads, and incomplete uploads aborted."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from apiary import transfer_parts
from apiary.storage.s3 import S3Storage
from apiary.transfer import TransferError

PART = 5 * 2**20  # S3's smallest part
SHARED = Path(__file__).resolve().parents[2] / "shared"
# A worker's upload that notes each part as it starts sending and is killed (SIGKILL) once `half` parts are stored.
KILLED_AT_HALF = """
import asyncio, logging, os, signal, sys
from pathlib import Path
from apiary import transfer_parts
from apiary.contracts import MultipartUpload

upload, source, started, half = MultipartUpload.model_validate_json(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], \
    int(sys.argv[4])
fd = os.open(started, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

class Started(logging.Handler):
    def emit(self, record):
        os.write(fd, f"{record.args[0]}\\n".encode())

logging.getLogger("apiary.transfer_parts").setLevel(logging.DEBUG)
logging.getLogger("apiary.transfer_parts").addHandler(Started())
stored = []

def sent(number):
    stored.append(number)
    if len(stored) >= half:
        os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(transfer_parts.upload(upload, source, sent=sent))
"""


class Interrupted(Exception):
    """The upload's process stops here (as a kill would, between parts)."""


@pytest.fixture
async def s3(s3_url: str, s3_server: str) -> S3Storage:
    storage = S3Storage(s3_url, endpoint_url=s3_server)
    await storage.ensure_bucket()
    return storage


def _file(tmp_path: Path, size: int) -> tuple[Path, str]:
    path = tmp_path / "result.safetensors"
    data = os.urandom(size)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


async def test_a_multipart_upload_stores_the_whole_file(s3: S3Storage, tmp_path: Path) -> None:
    source, digest = _file(tmp_path, 3 * PART + 1234)
    upload = await s3.start_multipart("jobs/j/rounds/0001/attempt-1/shard-0000.safetensors", 5, PART, 300)
    assert upload is not None

    sent = (await transfer_parts.upload(upload, source)).sent

    stored = await s3.get_bytes("jobs/j/rounds/0001/attempt-1/shard-0000.safetensors")
    assert sent == 4
    assert hashlib.sha256(stored).hexdigest() == digest


async def test_an_interrupted_upload_resumes_sending_only_the_missing_parts(s3: S3Storage, tmp_path: Path) -> None:
    source, digest = _file(tmp_path, 8 * PART)
    key = "jobs/j/rounds/0001/attempt-1/shard-0001.safetensors"
    upload = await s3.start_multipart(key, 9, PART, 300)
    assert upload is not None
    stored_before: list[int] = []

    def stop_at_half(number: int) -> None:
        stored_before.append(number)
        if len(stored_before) >= 4:
            raise Interrupted

    with pytest.raises(Interrupted):
        await transfer_parts.upload(upload, source, sent=stop_at_half)
    resent = (await transfer_parts.upload(upload, source)).sent

    data = await s3.get_bytes(key)
    assert hashlib.sha256(data).hexdigest() == digest
    # The parts in flight when it stopped (at most PARALLEL) were stored too; none queued behind them was sent, and
    # the resume sends the rest.
    assert 4 <= len(stored_before) <= 4 + transfer_parts.PARALLEL - 1
    assert resent == 8 - len(stored_before)


async def test_a_killed_upload_resumes_sending_only_the_parts_it_lacks(s3: S3Storage, tmp_path: Path) -> None:
    source, digest = _file(tmp_path, 12 * PART)
    key = "jobs/j/rounds/0001/attempt-1/shard-0006.safetensors"
    upload = await s3.start_multipart(key, 13, PART, 300)
    assert upload is not None
    started_log = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(SHARED)}
    killed = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", KILLED_AT_HALF, upload.model_dump_json(),
                                                      str(source), str(started_log), "6"], env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    listed = await asyncio.to_thread(s3._client.list_parts, Bucket=s3.bucket, Key=f"runs/{key}",
                                     UploadId=upload.upload_id)
    at_kill = {p["PartNumber"] for p in listed.get("Parts", [])}
    started = {int(n) for n in started_log.read_text().split()}
    resent: list[int] = []

    done = await transfer_parts.upload(upload, source, sent=resent.append)

    assert hashlib.sha256(await s3.get_bytes(key)).hexdigest() == digest
    assert len(at_kill) >= 6
    missing = set(range(1, 13)) - at_kill
    # No part stored before the kill goes again, and each part goes at most once.
    assert not at_kill & set(resent)
    assert done.sent == len(resent) == len(set(resent))
    # Every part never started goes; a missing part that did not go was in flight at the kill, its body already
    # with the store, which finished storing it after the listing above.
    assert missing - started <= set(resent) <= missing
    assert missing - set(resent) <= started
    # Of the parts sent before the kill, only those cut off in flight go again.
    assert len(started & set(resent)) <= transfer_parts.PARALLEL


async def test_a_part_corrupted_on_the_way_is_refused_and_sent_again(s3: S3Storage, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    source, digest = _file(tmp_path, 2 * PART)
    key = "jobs/j/rounds/0001/attempt-1/shard-0007.safetensors"
    upload = await s3.start_multipart(key, 3, PART, 300)
    assert upload is not None
    real = transfer_parts._http()
    corrupted: list[str] = []

    class FlipsOneByteOfPartTwo:
        """The network between worker and store: flips a byte of part 2's body, once."""

        def put(self, url: str, *, content: bytes, headers: dict[str, str]) -> httpx.Response:
            if "partNumber=2" in url and not corrupted:
                corrupted.append(url)
                content = bytes([content[0] ^ 1]) + content[1:]
            return real.put(url, content=content, headers=headers)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    monkeypatch.setattr(transfer_parts, "_http", FlipsOneByteOfPartTwo)

    done = await transfer_parts.upload(upload, source)

    # The store's MD5 of what it received (its ETag; S3 itself refuses the part against its Content-MD5) did not
    # match what was sent: the part went again, and the object holds the file's bytes.
    assert len(corrupted) == 1
    assert done.sent == 2
    assert hashlib.sha256(await s3.get_bytes(key)).hexdigest() == digest


async def test_a_part_whose_bytes_changed_is_sent_again(s3: S3Storage, tmp_path: Path) -> None:
    source, _ = _file(tmp_path, 2 * PART)
    key = "jobs/j/rounds/0001/attempt-1/shard-0002.safetensors"
    upload = await s3.start_multipart(key, 3, PART, 300)
    assert upload is not None
    with pytest.raises(Interrupted):
        await transfer_parts.upload(upload, source, sent=lambda n: (_ for _ in ()).throw(Interrupted()))
    data = bytearray(source.read_bytes())
    data[:10] = b"0123456789"  # a result trained again differs
    source.write_bytes(bytes(data))

    await transfer_parts.upload(upload, source)

    assert await s3.get_bytes(key) == bytes(data)


async def test_a_result_larger_than_its_presigned_parts_is_refused_in_one_line(s3: S3Storage, tmp_path: Path) -> None:
    source, _ = _file(tmp_path, 2 * PART + 1)
    upload = await s3.start_multipart("jobs/j/rounds/0001/attempt-1/shard-0003.safetensors", 2, PART, 300)
    assert upload is not None

    with pytest.raises(TransferError, match="needs 3 parts"):
        await transfer_parts.upload(upload, source)


async def test_incomplete_uploads_of_a_round_are_aborted(s3: S3Storage, tmp_path: Path) -> None:
    await s3.start_multipart("jobs/j/rounds/0002/attempt-1/shard-0000.safetensors", 2, PART, 300)
    await s3.start_multipart("jobs/j/rounds/0003/attempt-1/shard-0000.safetensors", 2, PART, 300)

    aborted = await s3.abort_multipart("jobs/j/rounds/0002/")

    assert aborted == 1
    assert await s3.abort_multipart("jobs/j/rounds/0002/") == 0
    assert await s3.abort_multipart("jobs/j/rounds/0003/") == 1


async def test_a_large_object_downloads_by_parallel_ranges(s3: S3Storage, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_parts, "RANGE_PART", 1 << 20)
    source, digest = _file(tmp_path, 5 * (1 << 20) + 77)
    ref = await s3.put_file("jobs/j/rounds/0001/global.safetensors", source)
    url = s3.presign_get(ref.key, 300)
    target = tmp_path / "fetched" / "global.safetensors"

    await transfer_parts.download(url, target, digest, ref.size)

    assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
    with pytest.raises(TransferError, match="sha256 mismatch"):
        await transfer_parts.download(url, tmp_path / "other", "0" * 64, ref.size)



async def test_a_multipart_result_is_read_back_by_its_etag_without_hashing(s3: S3Storage, tmp_path: Path) -> None:
    import torch

    from apiary.streamed_weights import RangeSource, StreamedWeights
    from apiary.weights import WeightsError, dumps, loads

    weights = {"w": torch.randn(3 * 2**20), "b": torch.randn(5)}
    source = tmp_path / "result.safetensors"
    source.write_bytes(dumps(weights))
    key = "jobs/j/rounds/0001/attempt-1/shard-0005.safetensors"
    upload = await s3.start_multipart(key, 4, PART, 300)
    assert upload is not None

    done = await transfer_parts.upload(upload, source)

    head = s3._client.head_object(Bucket=s3.bucket, Key=f"runs/{key}")
    assert head["ETag"] == done.etag
    # A wrong sha256 is not even looked at: the store's ETag vouches for the bytes.
    streamed = StreamedWeights(RangeSource(s3.presign_get(key, 300), done.etag), source.stat().st_size, "0" * 64)
    assert all(torch.equal(t, weights[n]) for n, t in streamed.items())
    await s3.put_bytes(key, dumps({"w": torch.zeros(3 * 2**20), "b": torch.zeros(5)}))  # replaced since
    with pytest.raises(WeightsError, match="no longer the one uploaded"):
        StreamedWeights(RangeSource(s3.presign_get(key, 300), done.etag), source.stat().st_size, "0" * 64)
    assert loads(await s3.get_bytes(key))["b"].sum() == 0
