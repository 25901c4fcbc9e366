"""Encoded uploads folded straight from storage: decoded chunk by chunk, the same bits as decoding them whole."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from apiary import streamed_update, streamed_weights
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.streamed_update import StreamedUpdate
from apiary.streamed_weights import RangeSource, StreamedWeights
from apiary.weights import WeightsError, spec_of_tensors
from apiary.wire_codec import SCALES, decode_update, encode_update


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed_weights, "READ", 999)  # reads split blocks, values and tensors anywhere
    monkeypatch.setattr(streamed_update, "DECODED", 100)  # and a read's values are decoded in several slices


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(37, 29, generator=g), "h": torch.randn(1001, generator=g).half(),
            "b": torch.randn(1000, generator=g).bfloat16(), "d": torch.randn(7, generator=g).double(),
            "empty": torch.empty(0, 3), "n": torch.tensor(seed, dtype=torch.int64)}


def _stored(tmp_path: Path, name: str, data: bytes) -> StreamedWeights:
    path = tmp_path / name
    path.write_bytes(data)
    return StreamedWeights(RangeSource(path.as_uri()), len(data), hashlib.sha256(data).hexdigest(), window=4096)


ENCODINGS = [("int8_blockwise", True, 64), ("int8_blockwise", False, 256), ("bf16", True, 256),
             ("fp16", False, 256), ("fp32", True, 256)]


@pytest.mark.parametrize(("encoding", "delta", "block"), ENCODINGS)
def test_an_upload_decoded_chunk_by_chunk_has_the_bits_of_its_whole_decode(tmp_path: Path, encoding: str,
                                                                          delta: bool, block: int) -> None:
    base, trained = _model(0), _model(1)
    data = encode_update(trained, base if delta else None, encoding, block)
    whole = decode_update(data, base)

    streamed = StreamedUpdate(_stored(tmp_path, "u", data), base)
    pieces: dict[str, torch.Tensor] = {n: torch.empty(t.numel(), dtype=t.dtype) for n, t in whole.items()}
    for name, at, values in streamed.chunks():
        pieces[name][at : at + values.numel()] = values

    assert streamed.declared_spec == spec_of_tensors(whole)
    assert all(torch.equal(pieces[n].view(whole[n].shape), whole[n]) for n in whole)
    assert all(torch.equal(streamed[n], whole[n]) for n in whole)


@pytest.mark.parametrize("strategy", ["federated_averaging", "fedadam", "fedavgm"])
def test_a_round_of_streamed_int8_deltas_equals_the_round_of_whole_decodes(tmp_path: Path, strategy: str) -> None:
    base = _model(0)
    uploads = [encode_update(_model(seed), base, "int8_blockwise", 64) for seed in (1, 2, 3)]
    results = []
    for streamed in (False, True):
        s = create(strategy)
        s.begin(spec_of_tensors(base), UpdateFormat.FULL, base)
        for i, data in enumerate(uploads):
            weights = StreamedUpdate(_stored(tmp_path, f"{i}", data), base) if streamed else decode_update(data, base)
            s.accept(Contribution(weights, 3 + i))
        results.append(s.finish(base).weights)

    whole, chunked = results
    assert all(torch.equal(whole[n], chunked[n]) for n in whole)


def test_negative_block_scales_are_refused_before_their_codes_are_added(tmp_path: Path) -> None:
    base = _model(0)
    data = bytearray(encode_update(_model(1), base, "int8_blockwise", 64))
    stored = _stored(tmp_path, "ok", bytes(data))
    offset = stored._base + stored._entries["w" + SCALES]["data_offsets"][0]
    data[offset + 3] |= 0x80  # the sign bit of the first scale (little-endian float32)
    bad = _stored(tmp_path, "bad", bytes(data))
    s = create("federated_averaging")
    s.begin(spec_of_tensors(base), UpdateFormat.FULL, base)

    with pytest.raises(WeightsError, match="scales are negative"):
        s.accept(Contribution(StreamedUpdate(bad, base), 1))


def test_a_delta_without_the_global_weights_is_refused_in_one_line(tmp_path: Path) -> None:
    data = encode_update(_model(1), _model(0), "int8_blockwise", 64)

    with pytest.raises(WeightsError, match="no global weights"):
        StreamedUpdate(_stored(tmp_path, "u", data), None)


def test_scales_stored_after_their_codes_are_read_first(tmp_path: Path) -> None:
    base = _model(0)
    data = encode_update(_model(1), base, "int8_blockwise", 64)
    stored = _stored(tmp_path, "sorted", data)
    # The same tensors with every tensor's codes before its scales (safetensors itself writes wider dtypes first).
    order = sorted(stored._entries, key=lambda n: (n.endswith(SCALES), n))
    header: dict[str, object] = {"__metadata__": stored.metadata}
    body, at = b"", 0
    for name in order:
        entry = stored._entries[name]
        start, end = entry["data_offsets"]
        header[name] = {**entry, "data_offsets": [at, at + end - start]}
        body += data[stored._base + start : stored._base + end]
        at += end - start
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    reordered = len(text).to_bytes(8, "little") + text + body

    streamed = StreamedUpdate(_stored(tmp_path, "reordered", reordered), base)
    pieces = {n: torch.empty(t.numel(), dtype=t.dtype) for n, t in decode_update(data, base).items()}
    for name, at_, values in streamed.chunks():
        pieces[name][at_ : at_ + values.numel()] = values

    whole = decode_update(data, base)
    assert all(torch.equal(pieces[n].view(whole[n].shape), whole[n]) for n in whole)
