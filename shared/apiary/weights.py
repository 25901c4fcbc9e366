"""Weights on the wire: safetensors, read zero-copy and checked strictly (no pickle anywhere)."""

from __future__ import annotations

import itertools
import json
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import save as _save

from apiary.policy import LIMITS

MAX_HEADER = LIMITS.safetensors_header_bytes

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WeightsError(ValueError):
    """Bytes that are not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype and shape: what a contribution must match."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        """`float32[3, 4]`."""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


WeightSpec = dict[str, TensorSpec]


def dumps(weights: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise a name -> tensor map to safetensors bytes (contiguous CPU copies)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
    return _save(tensors)


def read_header(data: bytes | bytearray | memoryview, total: int | None = None) -> tuple[dict[str, dict], int]:
    """Parse and check a safetensors header; return (entries, offset of the data section). `total`: the whole
    object's size where `data` is only its start (the header read first, the tensors streamed after)."""
    view = memoryview(data)
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
    header.pop("__metadata__", None)
    if len(header) > LIMITS.tensors:
        raise WeightsError(f"safetensors header lists {len(header)} tensors, over the limit of {LIMITS.tensors}")
    base = 8 + header_len
    size = (len(view) if total is None else total) - base
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
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
        itemsize = torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
        if not 0 <= start <= end <= size or end - start != numel * itemsize:
            raise WeightsError(f"tensor {name!r}: data_offsets {offsets} do not fit its shape or the file")
        spans.append((start, end, name))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise WeightsError(f"tensors {a!r} and {b!r} overlap")
    return header, base


def spec_of(data: bytes | bytearray | memoryview) -> WeightSpec:
    """The names, dtypes and shapes in safetensors bytes, without reading the tensors."""
    header, _ = read_header(data)
    return {n: TensorSpec(DTYPES[e["dtype"]], tuple(e["shape"])) for n, e in header.items()}


def spec_of_tensors(weights: Mapping[str, torch.Tensor]) -> WeightSpec:
    """The names, dtypes and shapes of a tensor map."""
    return {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in weights.items()}


def loads(data: bytes | bytearray | memoryview, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes into tensors; with copy=False the tensors view the buffer (zero-copy)."""
    header, base = read_header(data)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers; the views are only read, never written.
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.items():
            dtype = DTYPES[entry["dtype"]]
            start, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if end == start:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                flat = torch.frombuffer(data, dtype=torch.uint8, count=end - start, offset=base + start)
                tensor = flat.view(dtype).reshape(shape)
            out[name] = tensor.clone() if copy else tensor
    return out
