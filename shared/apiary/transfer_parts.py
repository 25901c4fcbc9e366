"""Large objects by URL, in parts: multipart uploads through presigned part URLs (several parts in flight, each with
its Content-MD5, which the store verifies; a resumed upload lists the parts already stored and sends only those that
are missing or differ), and downloads by parallel ranged GETs into their place in the file. Small objects, and
`file:` URLs, go whole through `apiary.transfer`."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import logging
import os
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from apiary import metrics
from apiary.contracts import MultipartUpload
from apiary.storage.base import sha256_file
from apiary.transfer import OCTET_STREAM, TransferError, _check, _http, _Transient, _with_retries

PARALLEL = 4  # parts in flight at once, each a part's size in memory
RANGE_PART = 64 * 2**20  # bytes per ranged GET of a parallel download
_S3 = "{http://s3.amazonaws.com/doc/2006-03-01/}"

log = logging.getLogger("apiary.transfer_parts")


def part_count(size: int, part_size: int) -> int:
    """How many parts an object of `size` bytes takes (an empty one takes one)."""
    return max(1, -(-size // part_size))


def planned_parts(expected_size: int, part_size: int) -> int:
    """Parts presigned for a result expected near `expected_size` bytes: room for 10% more, and one part."""
    return part_count(expected_size + expected_size // 10, part_size) + 1


def _stored_parts(url: str) -> dict[int, str]:
    """The parts an upload holds so far: part number -> ETag (quoted MD5 of the part)."""
    def attempt() -> dict[int, str]:
        response = _http().get(url)
        _check(response, "listing parts at", url)
        root = ET.fromstring(response.content)
        found = {}
        for part in root.iter(f"{_S3}Part"):
            number, etag = part.findtext(f"{_S3}PartNumber"), part.findtext(f"{_S3}ETag")
            if number is not None and etag is not None:
                found[int(number)] = etag
        return found

    return _with_retries("listing parts at", url, attempt)


class Uploaded(NamedTuple):
    """A multipart upload completed: how many parts went this time, and the object's ETag (the MD5 of the parts'
    MD5s and their count, as S3 computes it from the parts it verified)."""

    sent: int
    etag: str


def _upload_parts(upload: MultipartUpload, source: Path, deadline: float | None,
                  sent: Callable[[int], None] | None) -> Uploaded:
    size = source.stat().st_size
    count = part_count(size, upload.part_size)
    if count > len(upload.part_urls):
        raise TransferError(f"{source.name} needs {count} parts of {upload.part_size} bytes; "
                            f"{len(upload.part_urls)} were presigned")
    stored = _stored_parts(upload.list_url)
    lock = threading.Lock()
    resent = 0
    failed = threading.Event()

    def one(number: int) -> str:
        if failed.is_set():  # a part failed: the upload ends with the parts in flight, the rest wait for the resume
            raise TransferError(f"upload of {source.name} stopped before part {number}")
        try:
            return send(number)
        except BaseException:
            failed.set()
            raise

    def send(number: int) -> str:
        nonlocal resent
        offset = (number - 1) * upload.part_size
        with open(source, "rb") as f:
            data = os.pread(f.fileno(), min(upload.part_size, size - offset), offset)
        digest = hashlib.md5(data, usedforsecurity=False).digest()  # the store checks each part against it
        etag = f'"{digest.hex()}"'
        if stored.get(number) == etag:
            return etag  # stored by an earlier attempt, byte for byte
        url = upload.part_urls[number - 1]
        log.debug("sending part %d of %s", number, source.name)
        headers = {"Content-MD5": base64.b64encode(digest).decode(), "Content-Type": OCTET_STREAM}

        def attempt() -> str:
            response = _http().put(url, content=data, headers=headers)
            if response.status_code == 400 and b"BadDigest" in response.content:  # S3 checked the Content-MD5
                raise _Transient(f"part {number} arrived with other bytes than were sent")
            _check(response, "upload of a part to", url)
            stored_as = response.headers.get("etag", etag)
            if stored_as.strip('"') != digest.hex():  # the store's MD5 of what it received (S3, MinIO, moto)
                raise _Transient(f"part {number} was stored with MD5 {stored_as}, sent {etag}")
            return stored_as

        got = _with_retries("upload of a part to", url, attempt, deadline)
        with lock:
            resent += 1
        if sent is not None:
            sent(number)
        return got

    with concurrent.futures.ThreadPoolExecutor(PARALLEL, thread_name_prefix="apiary-part") as pool:
        etags = list(pool.map(one, range(1, count + 1)))
    body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(etags, 1))
    document = f'<CompleteMultipartUpload xmlns="{_S3[1:-1]}">{body}</CompleteMultipartUpload>'.encode()

    def complete() -> None:
        response = _http().post(upload.complete_url, content=document, headers={"Content-Type": "application/xml"})
        _check(response, "completing the upload at", upload.complete_url)
        if b"<Error>" in response.content:  # S3 may answer 200 and report a failure in the body
            raise _Transient(response.content[:200].decode(errors="replace"))

    _with_retries("completing the upload at", upload.complete_url, complete, deadline)
    composite = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in etags), usedforsecurity=False)
    return Uploaded(resent, f'"{composite.hexdigest()}-{len(etags)}"')


async def upload(upload: MultipartUpload, source: Path, *, deadline: float | None = None,
                 sent: Callable[[int], None] | None = None) -> Uploaded:
    """Upload a file in parts (those already stored, byte for byte, are not sent again) and complete the object;
    how many parts were sent, and its ETag. `sent(part_number)` is called after each part stored."""
    done = await asyncio.to_thread(_upload_parts, upload, source, deadline, sent)
    metrics.transferred("upload", source.stat().st_size)
    return done


def _download_ranges(url: str, target: Path, size: int, deadline: float | None) -> str:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    try:
        with open(tmp, "wb") as out:
            out.truncate(size)
            fd = out.fileno()

            def one(offset: int) -> None:
                end = min(offset + RANGE_PART, size) - 1

                def attempt() -> None:
                    at = offset
                    with _http().stream("GET", url, headers={"Range": f"bytes={offset}-{end}"}) as response:
                        _check(response, "download from", url)
                        if response.status_code != 206:
                            raise _Transient(f"HTTP {response.status_code} for a ranged GET")
                        for chunk in response.iter_bytes(1 << 20):
                            os.pwrite(fd, chunk, at)
                            at += len(chunk)
                    if at != end + 1:
                        raise _Transient(f"range {offset}-{end} ended at byte {at}")

                _with_retries("download from", url, attempt, deadline)

            with concurrent.futures.ThreadPoolExecutor(PARALLEL, thread_name_prefix="apiary-range") as pool:
                list(pool.map(one, range(0, size, RANGE_PART)))
        digest = sha256_file(tmp)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return digest


async def download(url: str, target: Path, sha256: str | None, size: int, *, deadline: float | None = None) -> None:
    """Fetch a URL to a file: an object of `size` bytes over RANGE_PART by parallel ranged GETs, anything else
    (and `file:` URLs) whole through `apiary.transfer`; checked against its sha256."""
    from apiary import transfer

    if url.startswith("file:") or size <= RANGE_PART:
        await transfer.download(url, target, sha256, deadline=deadline)
        return
    digest = await asyncio.to_thread(_download_ranges, url, target, size, deadline)
    if sha256 is not None and digest != sha256:
        target.unlink(missing_ok=True)
        raise TransferError(f"sha256 mismatch for {target.name}: expected {sha256[:12]}…, got {digest[:12]}…")
    metrics.transferred("download", size)
