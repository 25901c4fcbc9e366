"""The deployed storage: an S3 bucket (AWS, MinIO or any S3-compatible endpoint) through boto3.

Every call runs in a worker thread. Objects carry their sha256 as user metadata
(`x-amz-meta-sha256`), set on put and checked on get when present: objects uploaded through a
presigned PUT have none, and their readers check the claim's sha256 instead (`verified_bytes`).
Files go through boto3's managed transfer, which switches to multipart above `MULTIPART_THRESHOLD`;
whole objects read or written in memory (`get_bytes`, `put_bytes` up to that size) go by presigned URL
through an HTTP session set up as the client's (`apiary.storage.s3_direct`), at half the CPU of a client call.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.session
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.credentials import ReadOnlyCredentials
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from apiary.backoff import Backoff
from apiary.contracts import MultipartUpload, ObjectRef
from apiary.storage.base import ObjectNotFound, Storage, StorageUnavailable, check_key, sha256_file
from apiary.storage.presign import Endpoint, Presigner
from apiary.storage.s3_direct import DirectRequests

T = TypeVar("T")

MULTIPART_THRESHOLD = 8 * 1024 * 1024
# Attempts per request, the client's (botocore's standard mode) and the direct ones' alike; the direct
# ones wait as that mode does (a random 0-1 s, then 0-2 s).
ATTEMPTS = 3
DIRECT_RETRY = Backoff(attempts=ATTEMPTS, base=1.0, cap=20.0)
OWN_URL_SECONDS = 300  # the lifetime of the URLs this adapter signs for its own requests
SHA256_METADATA = "sha256"
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
# Answers that say "not now" rather than "never": throttling and server-side timeouts (S3 sends some as 4xx).
_BUSY = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
         "ServiceUnavailable", "InternalError"}
# Failures to reach the server or read its answer (connect, read timeout, a connection cut mid-body),
# and a managed download that ran out of s3transfer's own retries.
_UNREACHABLE = (BotoConnectionError, HTTPClientError, IncompleteReadError, NoCredentialsError, RetriesExceededError)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def transient(e: BaseException) -> bool:
    """Whether a boto3 failure (left after botocore's own retries) may pass if the call is made again later."""
    if isinstance(e, S3UploadFailedError):
        # boto3's managed upload rewraps the client error in a message; the original is its context.
        cause = e.__cause__ or e.__context__
        return cause is not None and transient(cause)
    if isinstance(e, ClientError):
        return _status(e) >= 500 or _status(e) == 429 or _code(e) in _BUSY
    return isinstance(e, _UNREACHABLE)


class S3Storage(Storage):
    """Objects under `s3://bucket/prefix/`."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str = "us-east-1") -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"storage URL {url!r} is invalid: expected s3://bucket/prefix")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.endpoint_url = endpoint_url
        self.region = region
        config = Config(
            signature_version="s3v4",
            region_name=region,
            connect_timeout=5,
            read_timeout=60,
            # botocore retries connection errors, throttling and 5xx with capped exponential backoff.
            retries={"max_attempts": ATTEMPTS, "mode": "standard"},
            # S3-compatible servers (MinIO, moto) are addressed by path, AWS by virtual host.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
        )
        core = botocore.session.get_session()
        self._session = boto3.session.Session(botocore_session=core)
        self._presigner: Presigner | None = None
        # The CA bundle botocore would pick (AWS_CA_BUNDLE or the profile's), given to both HTTP sessions.
        verify = core.get_config_variable("ca_bundle")
        self._client: Any = self._session.client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config, verify=verify
        )
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_THRESHOLD,
            max_concurrency=4,
        )
        self._direct = DirectRequests(self._client, verify, transient, DIRECT_RETRY)
        self._bucket_ready = False
        self._bucket_lock = asyncio.Lock()

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self) -> str:
        return self.endpoint_url or f"S3 ({self.region})"

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking boto3 call in a thread; transient failures become StorageUnavailable."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as e:
            if not transient(e):
                raise
            where = f"S3 bucket {self.bucket!r} at {self._where()}"
            if isinstance(e, ClientError | S3UploadFailedError):
                message = f"{self._where()} failed for bucket {self.bucket!r}: {e}"
            else:
                message = (f"cannot reach bucket {self.bucket!r} at {self._where()}: {e};"
                           " check APIARY_STORAGE_URL, APIARY_S3_ENDPOINT_URL and the credentials")
            raise StorageUnavailable(message, dependency=where, reason=str(e)) from e

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist yet."""
        if self._bucket_ready:
            return
        async with self._bucket_lock:
            if self._bucket_ready:
                return
            try:
                await self._call(self._client.head_bucket, Bucket=self.bucket)
            except ClientError as e:
                if _code(e) not in _NOT_FOUND | _NO_BUCKET:
                    raise
                kwargs: dict[str, Any] = {"Bucket": self.bucket}
                if self.region != "us-east-1":
                    kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
                try:
                    await self._call(self._client.create_bucket, **kwargs)
                except ClientError as e2:
                    if _code(e2) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                        raise
            self._bucket_ready = True

    async def put_bytes(self, key: str, data: bytes) -> ObjectRef:
        full = self._key(key)
        await self.ensure_bucket()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) <= MULTIPART_THRESHOLD:
            meta = {f"x-amz-meta-{SHA256_METADATA}": digest}  # signed with the URL
            await self._call(lambda: self._direct.put(self._presign("PUT", key, OWN_URL_SECONDS, meta), data, meta))
        else:
            await self._call(self._client.put_object, Bucket=self.bucket, Key=full, Body=data,
                             Metadata={SHA256_METADATA: digest})
        return ObjectRef(key=key, size=len(data), sha256=digest)

    async def put_file(self, key: str, path: Path) -> ObjectRef:
        full = self._key(key)
        await self.ensure_bucket()
        source = Path(path)
        size, digest = await asyncio.to_thread(lambda: (source.stat().st_size, sha256_file(source)))
        await self._call(
            self._client.upload_file,
            str(source),
            self.bucket,
            full,
            ExtraArgs={"Metadata": {SHA256_METADATA: digest}},
            Config=self.transfer,
        )
        return ObjectRef(key=key, size=size, sha256=digest)

    @staticmethod
    def _missing(e: ClientError) -> bool:
        return _code(e) in _NOT_FOUND | _NO_BUCKET or _status(e) == 404

    async def get_bytes(self, key: str) -> bytes:
        try:
            data, headers = await self._call(lambda: self._direct.get(self._presign("GET", key, OWN_URL_SECONDS)))
        except ClientError as e:
            if self._missing(e):
                raise ObjectNotFound(key) from None
            raise
        expected = headers.get(f"x-amz-meta-{SHA256_METADATA}")
        if expected is not None:
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise self._mismatch(key, expected, actual)
        return data

    def _mismatch(self, key: str, expected: str, actual: str) -> ValueError:
        return ValueError(f"{self.uri(key)}: sha256 mismatch (stored {expected[:12]}…, got {actual[:12]}…)")

    async def get_file(self, key: str, path: Path) -> None:
        full = self._key(key)
        target = Path(path)
        try:
            head = await self._call(self._client.head_object, Bucket=self.bucket, Key=full)
        except ClientError as e:
            if self._missing(e):
                raise ObjectNotFound(key) from None
            raise
        expected = head.get("Metadata", {}).get(SHA256_METADATA)

        def download() -> str | None:
            """Download beside the target and rename, so a reader never sees half a file."""
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            os.close(fd)
            tmp = Path(name)
            try:
                self._client.download_file(self.bucket, full, str(tmp), Config=self.transfer)
                actual = sha256_file(tmp) if expected is not None else None
                if actual == expected:
                    tmp.replace(target)
                return actual
            finally:
                tmp.unlink(missing_ok=True)

        try:
            actual = await self._call(download)
        except ClientError as e:
            if self._missing(e):
                raise ObjectNotFound(key) from None
            raise
        if expected is not None and actual != expected:
            raise self._mismatch(key, expected, actual or "")

    async def exists(self, key: str) -> bool:
        full = self._key(key)
        try:
            await self._call(self._client.head_object, Bucket=self.bucket, Key=full)
        except ClientError as e:
            if self._missing(e):
                return False
            raise
        return True

    async def list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""

        def walk() -> list[str]:
            keys: list[str] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                keys.extend(item["Key"][len(base):] for item in page.get("Contents", []))
            return sorted(keys)

        try:
            return await self._call(walk)
        except ClientError as e:
            if _code(e) in _NO_BUCKET:
                return []
            raise

    async def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            await self._call(self._client.delete_object, Bucket=self.bucket, Key=full)
        except ClientError as e:
            if not self._missing(e):
                raise

    async def delete_many(self, keys: Sequence[str]) -> None:
        """One DeleteObjects request per 1,000 keys (S3's most), not a request per key."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(key)} for key in keys[start:start + 1000]]
            answer = await self._call(self._client.delete_objects, Bucket=self.bucket,
                                      Delete={"Objects": batch, "Quiet": True})
            errors = answer.get("Errors") or []
            if errors:
                first = errors[0]
                raise OSError(f"{len(errors)} of {len(batch)} objects not deleted, e.g. {first.get('Key')}: "
                              f"{first.get('Code')} {first.get('Message')}")

    def _botocore_presign(self, method: str, full_key: str, expires: int) -> str:
        operation = "get_object" if method == "GET" else "put_object"
        url: str = self._client.generate_presigned_url(
            operation, Params={"Bucket": self.bucket, "Key": full_key}, ExpiresIn=expires)
        return url

    def _frozen_credentials(self) -> ReadOnlyCredentials:
        creds = self._session.get_credentials()
        if creds is None:
            raise NoCredentialsError()
        frozen = creds.get_frozen_credentials()  # refreshes temporary credentials when they are due
        if not frozen.access_key or not frozen.secret_key:
            raise NoCredentialsError()
        return frozen

    def _presign(self, method: str, key: str, expires: int, headers: dict[str, str] | None = None) -> str:
        full = self._key(key)
        if self._presigner is None:
            # botocore decides the addressing and the credential scope once, from a URL it signs;
            # every URL is then signed by its SigV4 query signer alone (see apiary.storage.presign).
            endpoint = Endpoint.from_presigned(self._botocore_presign("GET", full, expires), full)
            self._presigner = Presigner(endpoint, self._frozen_credentials)
        return self._presigner.presign(method, full, expires, headers=headers)

    def presign_get(self, key: str, expires: int) -> str:
        return self._presign("GET", key, expires)

    def presign_put(self, key: str, expires: int) -> str:
        return self._presign("PUT", key, expires)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    async def start_multipart(self, key: str, parts: int, part_size: int, expires: int) -> MultipartUpload | None:
        full = self._key(key)
        await self.ensure_bucket()
        created = await self._call(self._client.create_multipart_upload, Bucket=self.bucket, Key=full,
                                   ContentType="application/octet-stream")
        upload_id = str(created["UploadId"])
        target = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id}

        def sign(operation: str, **extra: Any) -> str:
            url: str = self._client.generate_presigned_url(operation, Params={**target, **extra}, ExpiresIn=expires)
            return url

        return MultipartUpload(upload_id=upload_id, part_size=part_size,
                               part_urls=[sign("upload_part", PartNumber=n) for n in range(1, parts + 1)],
                               complete_url=sign("complete_multipart_upload"), list_url=sign("list_parts"))

    async def abort_multipart(self, prefix: str) -> int:
        base = f"{self.prefix}/" if self.prefix else ""

        def abort() -> int:
            aborted = 0
            paginator = self._client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for upload in page.get("Uploads", []):
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                        UploadId=upload["UploadId"])
                    aborted += 1
            return aborted

        try:
            return await self._call(abort)
        except ClientError as e:
            if _code(e) in _NO_BUCKET:
                return 0
            raise

    async def delete_bucket(self) -> None:
        """Delete every object under the bucket and the bucket itself (for tests)."""

        def wipe() -> None:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket):
                objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if objects:
                    self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
            self._client.delete_bucket(Bucket=self.bucket)

        try:
            await self._call(wipe)
        except ClientError as e:
            if _code(e) not in _NO_BUCKET:
                raise
        self._bucket_ready = False
