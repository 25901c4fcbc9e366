"""The safetensors header, read and checked strictly without torch: what a service that never holds tensors (the
scheduler checking initial weights, say) needs of a weights file. apiary.weights reads the tensors behind it."""

from __future__ import annotations

import itertools
import json
import struct
from typing import Any

from apiary.policy import LIMITS

MAX_HEADER = LIMITS.safetensors_header_bytes
# The dtypes a weights file may hold (apiary.weights.DTYPES maps them to torch's), and each one's bytes per value.
ITEMSIZES: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                             "BOOL": 1}


class WeightsError(ValueError):
    """Bytes that are not a well-formed safetensors file."""


def _parsed(view: memoryview) -> tuple[dict[str, Any], int]:
    """The header's JSON map and its length in bytes, its bounds checked (WeightsError if it has none)."""
    if len(view) < 8:
        raise WeightsError("weights file is too short to be safetensors")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER or 8 + header_len > len(view):
        raise WeightsError(f"safetensors header length {header_len} is out of bounds")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightsError(f"safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WeightsError("safetensors header is not a map")
    return header, header_len


def metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes (empty if none)."""
    found = _parsed(memoryview(data))[0].get("__metadata__") or {}
    if not isinstance(found, dict):
        raise WeightsError("safetensors __metadata__ is not a map")
    return found


def read_header(data: bytes | bytearray | memoryview, total: int | None = None) -> tuple[dict[str, dict], int]:
    """Parse and check a safetensors header; return (entries, offset of the data section). `total`: the whole
    object's size where `data` is only its start (the header read first, the tensors streamed after)."""
    view = memoryview(data)
    header, header_len = _parsed(view)
    header.pop("__metadata__", None)
    if len(header) > LIMITS.tensors:
        raise WeightsError(f"safetensors header lists {len(header)} tensors, over the limit of {LIMITS.tensors}")
    base = 8 + header_len
    size = (len(view) if total is None else total) - base
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in ITEMSIZES:
            raise WeightsError(f"tensor {name!r}: unsupported or missing dtype {entry!r:.80}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise WeightsError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise WeightsError(f"tensor {name!r}: bad data_offsets {offsets!r}")
        start, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        itemsize = ITEMSIZES[entry["dtype"]]
        if not 0 <= start <= end <= size or end - start != numel * itemsize:
            raise WeightsError(f"tensor {name!r}: data_offsets {offsets} do not fit its shape or the file")
        spans.append((start, end, name))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise WeightsError(f"tensors {a!r} and {b!r} overlap")
    return header, base


def tensor_names(data: bytes | bytearray | memoryview) -> list[str]:
    """The names of the tensors in safetensors bytes (the header checked), without reading the tensors."""
    header, _ = read_header(data)
    return list(header)
