"""The embedded store records the sha256 of what it writes, so its readers need not hash the bytes again, and stops
vouching for a file replaced or written to outside it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from apiary import streamed_weights, transfer
from apiary.storage.local import LocalStorage
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.streamed_weights import RangeSource, StreamedWeights
from apiary.weights import WeightsError, dumps, spec_of_tensors

WEIGHTS = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7)}


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed_weights, "READ", 999)


def _fold(store: LocalStorage, key: str, size: int, sha256: str) -> dict[str, torch.Tensor]:
    s = create("federated_averaging")
    s.begin(spec_of_tensors(WEIGHTS), UpdateFormat.FULL)
    s.accept(Contribution(StreamedWeights(RangeSource(store.presign_get(key, 60)), size, sha256, window=4096), 1))
    return s.finish().weights


async def test_an_object_written_through_the_store_is_vouched_for_and_folds_to_its_tensors(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")

    ref = await store.put_bytes("c/0", dumps(WEIGHTS))

    assert RangeSource(store.presign_get("c/0", 60)).vouched(ref.sha256)
    assert not RangeSource(store.presign_get("c/0", 60)).vouched("0" * 64)
    folded = _fold(store, "c/0", ref.size, ref.sha256)
    assert all(torch.equal(folded[n], WEIGHTS[n]) for n in WEIGHTS)
    assert await store.list("c/") == ["c/0"]


async def test_a_file_written_to_outside_the_store_is_hashed_and_refused(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    ref = await store.put_bytes("c/0", dumps(WEIGHTS))
    path = tmp_path / "store" / "c" / "0"
    fd = os.open(path, os.O_WRONLY)  # same size, other bytes in the last tensor
    os.pwrite(fd, b"\x00\x00\x80\x7f", ref.size - 4)
    os.close(fd)

    assert not RangeSource(path.as_uri()).vouched(ref.sha256)
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        _fold(store, "c/0", ref.size, ref.sha256)


async def test_a_file_replaced_by_another_is_not_vouched_for_even_with_the_same_bytes(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    data = dumps(WEIGHTS)
    ref = await store.put_bytes("c/0", data)
    other = tmp_path / "other"
    other.write_bytes(data)

    os.replace(other, tmp_path / "store" / "c" / "0")

    assert not RangeSource(store.presign_get("c/0", 60)).vouched(ref.sha256)
    assert torch.equal(_fold(store, "c/0", ref.size, ref.sha256)["w"], WEIGHTS["w"])  # hashed, and it matches


async def test_a_file_written_to_while_it_is_read_fails_the_fold(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    ref = await store.put_bytes("c/0", dumps(WEIGHTS))
    stored = StreamedWeights(RangeSource(store.presign_get("c/0", 60)), ref.size, ref.sha256, window=4096)
    path = tmp_path / "store" / "c" / "0"
    os.utime(path, ns=(0, 0))  # written to after the reader trusted it (its mtime and ctime change)

    with pytest.raises(WeightsError, match="replaced or written to"):
        list(stored.chunks())


async def test_a_deleted_object_takes_its_digest_with_it(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    ref = await store.put_bytes("c/0", dumps(WEIGHTS))

    await store.delete("c/0")
    (tmp_path / "store" / "c" / "0").write_bytes(dumps(WEIGHTS))

    assert not RangeSource(store.presign_get("c/0", 60)).vouched(ref.sha256)
    assert os.listdir(tmp_path / "store" / "c") == ["0"]


async def test_a_worker_upload_into_the_store_records_the_digest_it_computed(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    result = tmp_path / "result.safetensors"
    result.write_bytes(dumps(WEIGHTS))
    sha256 = hashlib.sha256(result.read_bytes()).hexdigest()

    await transfer.upload(store.presign_put("c/1", 60), result, sha256=sha256)
    await transfer.upload(store.presign_put("c/2", 60), result)

    assert RangeSource(store.presign_get("c/1", 60)).vouched(sha256)
    assert not RangeSource(store.presign_get("c/2", 60)).vouched(sha256)
    # A download from the store trusts the recorded digest, and still refuses one that is not the expected one.
    await transfer.download(store.presign_get("c/1", 60), tmp_path / "back", sha256)
    assert (tmp_path / "back").read_bytes() == result.read_bytes()
    with pytest.raises(transfer.TransferError, match="sha256 mismatch"):
        await transfer.download(store.presign_get("c/1", 60), tmp_path / "again", "0" * 64)
