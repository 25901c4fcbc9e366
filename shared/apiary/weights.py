"""Weights on the wire: safetensors, read zero-copy and checked strictly (no pickle anywhere)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import save as _save

from apiary.safetensors_header import MAX_HEADER, WeightsError, read_header

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

__all__ = ["DTYPES", "DTYPE_NAMES", "MAX_HEADER", "TensorSpec", "WeightSpec", "WeightsError", "dumps", "loads",
           "read_header", "spec_of", "spec_of_tensors"]


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
