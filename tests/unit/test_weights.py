"""Safetensors bytes: round trip, zero-copy reads, and strict refusal of malformed input."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from apiary.weights import WeightsError, dumps, loads, read_header, spec_of


def _raw(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def test_round_trip_keeps_names_dtypes_shapes_and_values() -> None:
    weights = {"w": torch.randn(3, 4), "n": torch.tensor(7), "h": torch.ones(2, dtype=torch.float16)}

    back = loads(dumps(weights))

    assert back.keys() == weights.keys()
    for name in weights:
        assert torch.equal(back[name], weights[name])


def test_zero_copy_views_share_the_buffer() -> None:
    data = bytearray(dumps({"w": torch.zeros(4)}))

    view = loads(data, copy=False)["w"]
    data[-4:] = struct.pack("<f", 2.5)

    assert view[-1].item() == 2.5


def test_spec_reads_only_the_header() -> None:
    spec = spec_of(dumps({"w": torch.zeros(2, 5)}))

    assert spec["w"].describe() == "float32[2, 5]"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (struct.pack("<Q", 10**12) + b"{}", "out of bounds"),
        (struct.pack("<Q", 3) + b"{x}", "not JSON"),
        (_raw({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "dtype"),
        (_raw({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "do not fit"),
        (_raw({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 4), "do not fit"),
        (_raw({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "bad shape"),
        (
            _raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
            "overlap",
        ),
    ],
)
def test_malformed_bytes_are_refused_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(WeightsError, match=message):
        read_header(data)


def test_pickle_is_not_accepted() -> None:
    import io
    import pickle

    buffer = io.BytesIO()
    pickle.dump({"w": [1.0]}, buffer)

    with pytest.raises(WeightsError):
        loads(buffer.getvalue())
