"""A stored safetensors object read as a name -> tensor map without holding it whole: its header first, then its
tensors in file order, several ranged reads in flight (at most `window` bytes), each tensor handed over as soon as
its bytes are in, while the next ones arrive (a fold's `add_` overlaps the network). The object's sha256 is computed
on the way and checked before its last tensor is handed over, so a changed object never completes a fold, unless the
store vouches for the bytes (`RangeSource.vouched`: read by S3's ETag, or a file whose sha256 the embedded store
recorded when it wrote it).

`declared_spec` (the header's names, dtypes and shapes) lets validation check the object without reading a tensor.
Reads go by presigned URL: ranged GETs over HTTP (S3), `pread` for `file:` URLs (the embedded store)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import struct
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from apiary.safetensors_header import metadata
from apiary.storage.local import recorded_sha256
from apiary.transfer import _check, _http, _Transient, _with_retries
from apiary.weights import DTYPES, TensorSpec, WeightsError, WeightSpec, read_header

READ = 32 * 2**20  # bytes per ranged read
WINDOW = 256 * 2**20  # bytes read ahead of the tensor being handed over, at most
READERS = 4  # ranged reads in flight
HASH_BACKLOG = 2  # reads waiting for the hashing thread, at most: the fold waits for it rather than hold more


class RangeSource:
    """Byte ranges of one object at a URL (HTTP ranged GETs, retried; or a local file)."""

    def __init__(self, url: str, etag: str | None = None) -> None:
        self.url, self.etag = url, etag
        self._path = unquote(urlparse(url).path) if url.startswith("file:") else None
        self._recorded: tuple[str, str] | None = None
        if self._path is not None:
            self.etag = None  # a local file has no ETag: see `vouched`

    def vouched(self, sha256: str) -> bool:
        """Whether the store vouches that the object's bytes are those of `sha256`, so a reader need not hash them:
        read by the ETag S3 computed from the parts it verified (If-Match), or a file of the embedded store whose
        sha256 the store recorded when it was written and which is still that file."""
        if self.etag is not None:
            return True
        if self._path is None:
            return False
        self._recorded = recorded_sha256(Path(self._path))
        return self._recorded is not None and self._recorded[0] == sha256

    def unchanged(self) -> bool:
        """Whether a vouched local file is still the file it was when vouched for (not replaced nor written to)."""
        return self._path is None or (self._recorded is not None
                                      and recorded_sha256(Path(self._path)) == self._recorded)

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (WeightsError if the object is shorter)."""
        if length <= 0:
            return b""
        if self._path is not None:
            with open(self._path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        else:
            def attempt() -> bytes:
                headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
                if self.etag is not None:
                    headers["If-Match"] = self.etag  # the object the store verified, or 412
                response = _http().get(self.url, headers=headers)
                if response.status_code == 412:
                    raise WeightsError(f"the stored object is no longer the one uploaded (ETag {self.etag})")
                _check(response, "ranged read of", self.url)
                if response.status_code != 206 and not (offset == 0 and len(response.content) == length):
                    raise _Transient(f"HTTP {response.status_code} for a ranged read")
                return response.content

            data = _with_retries("ranged read of", self.url, attempt)
        if len(data) != length:
            raise WeightsError(f"object ended after {len(data)} of {length} bytes read at {offset}")
        return data


class StreamedWeights(Mapping[str, torch.Tensor]):
    """A safetensors object of `size` bytes and `sha256` at `source`, read tensor by tensor; its bytes hashed unless
    the store vouches for them (`RangeSource.vouched`)."""

    def __init__(self, source: RangeSource, size: int, sha256: str, *, window: int = WINDOW) -> None:
        self._source, self.size, self.sha256, self._window = source, size, sha256, max(window, READ)
        self._vouched = source.vouched(sha256)
        head = source.read(0, min(size, 1 << 20))
        if len(head) < 8:
            raise WeightsError("weights file is too short to be safetensors")
        (length,) = struct.unpack("<Q", head[:8])
        if 8 + length > len(head):
            head += source.read(len(head), min(size, 8 + length) - len(head))
        self._head = head[: 8 + length]
        entries, base = read_header(self._head, total=size)
        self.metadata = metadata(self._head)
        self._base = base
        self._spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in entries.items())
        self._entries = entries
        self.declared_spec: WeightSpec = {n: TensorSpec(DTYPES[e["dtype"]], tuple(e["shape"]))
                                          for n, e in entries.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        """One tensor, read on its own (strategies that fold stream through `items` instead)."""
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        return self._tensor(name, bytearray(self._source.read(self._base + start, end - start)))

    def __iter__(self) -> Iterator[str]:
        return (name for _, _, name in self._spans)

    def __len__(self) -> int:
        return len(self._spans)

    def _tensor(self, name: str, data: bytes | bytearray | memoryview) -> torch.Tensor:
        entry = self._entries[name]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        if not len(data):
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)

    def _pieces(self) -> Iterator[tuple[str, int, memoryview]]:
        """(tensor name, byte offset in the tensor, bytes) in file order, each within one read, read ahead in
        parallel; every empty tensor first. The object's sha256 is checked before the last read's bytes are handed
        over (WeightsError if it does not match)."""
        digest = hashlib.sha256(self._head)
        spans = [(self._base + start, self._base + end, name) for start, end, name in self._spans]
        reads = collections.deque((offset, min(READ, self.size - offset))
                                  for offset in range(self._base, self.size, READ))
        if not reads:
            self._verify(digest)
        for first, last, name in spans:
            if first == last:
                yield name, 0, memoryview(b"")
        spans = [span for span in spans if span[0] < span[1]]
        pending: collections.deque[tuple[int, concurrent.futures.Future[bytes]]] = collections.deque()
        hashed: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        hashing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apiary-hash")
        with hashing, concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="apiary-stream") as pool:
            queued = 0

            def fill() -> None:
                nonlocal queued
                while reads and (not pending or queued + reads[0][1] <= self._window):
                    offset, length = reads.popleft()
                    pending.append((offset, pool.submit(self._source.read, offset, length)))
                    queued += length

            try:
                index = 0
                while pending or reads:
                    fill()
                    offset, future = pending.popleft()
                    chunk = future.result()
                    queued -= len(chunk)
                    if not self._vouched:
                        hashed.append(hashing.submit(digest.update, chunk))  # in order, beside the fold
                        while len(hashed) > HASH_BACKLOG:  # the reads it holds count against memory too
                            hashed.popleft().result()
                    fill()
                    if not pending and not reads:  # the last read: every byte is in
                        hashing.submit(lambda: None).result()
                        self._verify(digest)
                    view, end = memoryview(chunk), offset + len(chunk)
                    while index < len(spans) and spans[index][0] < end:
                        first, last, name = spans[index]
                        lo, hi = max(first, offset), min(last, end)
                        if lo < hi:
                            yield name, lo - first, view[lo - offset : hi - offset]
                        if last > end:
                            break
                        index += 1
            finally:
                for _, future in pending:
                    future.cancel()

    def _verify(self, digest: Any) -> None:
        if self._vouched:
            if not self._source.unchanged():
                raise WeightsError("the stored file was replaced or written to while it was read")
            return
        if digest.hexdigest() != self.sha256:
            raise WeightsError(f"sha256 mismatch: the stored object hashes to {digest.hexdigest()[:12]}…, "
                               f"announced {self.sha256[:12]}…")

    def chunks(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(tensor name, element offset, flat values) in file order, at most a read's worth each: a fold adds each
        chunk into its place, so no tensor is ever held whole (`WeightedSum.fold` takes these)."""
        carry = b""  # an element split between two reads
        for name, at, piece in self._pieces():
            dtype = self.declared_spec[name].dtype
            size = torch.empty((), dtype=dtype).element_size()
            if carry:
                need = size - len(carry)
                carry += bytes(piece[:need])
                if len(carry) < size:
                    continue
                yield name, (at + need) // size - 1, self._flat(carry, dtype)
                piece, at, carry = piece[need:], at + need, b""
            whole = len(piece) - len(piece) % size
            if whole or not len(piece):
                yield name, at // size, self._flat(piece[:whole], dtype)
            carry = bytes(piece[whole:])

    @staticmethod
    def _flat(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
        if not len(data):
            return torch.empty(0, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: the fold only reads them
            return torch.frombuffer(data, dtype=torch.uint8).view(dtype)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """Every tensor whole, in file order (one spanning reads joined once); see `chunks` for folds."""
        parts: list[memoryview] = []
        for name, at, piece in self._pieces():
            entry = self._entries[name]
            length = entry["data_offsets"][1] - entry["data_offsets"][0]
            if at + len(piece) < length:
                parts.append(piece)
                continue
            data: bytes | bytearray | memoryview = piece
            if parts:
                data = bytearray(b"".join([*parts, piece]))
                parts = []
            yield name, self._tensor(name, data)
