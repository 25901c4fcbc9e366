"""The storage port: objects by key, with sha256, presigned URLs and streaming file transfers."""

from apiary.storage.base import ObjectNotFound, Storage, StorageUnavailable, sha256_file
from apiary.storage.factory import make_storage

__all__ = ["ObjectNotFound", "Storage", "StorageUnavailable", "make_storage", "sha256_file"]
