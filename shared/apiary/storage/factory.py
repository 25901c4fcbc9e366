"""Choose a storage adapter from a URL."""

from __future__ import annotations

from apiary.storage.base import Storage


def make_storage(url: str, *, endpoint_url: str | None = None, region: str = "us-east-1") -> Storage:
    """`file:///folder` for a local folder, `s3://bucket/prefix` for S3 or MinIO."""
    if url.startswith("file:"):
        from apiary.storage.local import LocalStorage

        return LocalStorage(url.removeprefix("file:").removeprefix("//"))
    if url.startswith("s3://"):
        from apiary.storage.s3 import S3Storage

        return S3Storage(url, endpoint_url=endpoint_url, region=region)
    raise ValueError(f"APIARY_STORAGE_URL {url!r} is not supported: use file:///folder or s3://bucket/prefix")
