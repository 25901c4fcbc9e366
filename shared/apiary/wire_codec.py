"""Weights made smaller on the wire, and made whole again (`distributed.transfer`, docs/large-models.md).

- Download: the round's global weights with floating tensors in bf16 or fp16 (`halve`); the worker casts them back
  to the dtypes the header records (`load_downloaded`) before its trainer sees them.
- Upload: the trained weights, or their delta from the weights the worker started from, with floating tensors in
  fp32, bf16, fp16 or int8 with one absmax scale per block of `block_size` values (as bitsandbytes' blockwise 8-bit
  quantisation, on the CPU): `encode_update`. The aggregator decodes (`decode_update`) into full-precision weights
  in the round's dtypes before any strategy sees them, so every strategy sums in full precision.

An encoded object is ordinary safetensors whose `__metadata__` says how it was encoded (`apiary.update`): a result
without it is plain weights, read as today. Rounding bound of int8_blockwise: each value is off by at most
absmax(its block) / 254 (`int8_bound`), so a weighted mean of such values is off by at most the largest of them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save as _save

from apiary.safetensors_header import metadata
from apiary.weights import DTYPE_NAMES, DTYPES, MAX_HEADER, WeightsError, loads

UPDATE_KEY = "apiary.update"  # metadata of an encoded upload
DOWNLOAD_KEY = "apiary.download"  # metadata of global weights halved for download
SCALES = ".__absmax__"  # suffix of a quantised tensor's per-block scales
HALVES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LEVELS = 127  # int8 values -127..127 (symmetric: -128 is never used)


def _json_field(meta: Mapping[str, str], key: str) -> dict[str, Any] | None:
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise WeightsError(f"metadata {key!r} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise WeightsError(f"metadata {key!r} is not a map")
    return value


def _dtype(name: str, dtypes: Mapping[str, Any]) -> torch.dtype:
    label = dtypes.get(name)
    if not isinstance(label, str) or label not in DTYPES:
        raise WeightsError(f"tensor {name!r}: metadata names no known dtype ({label!r:.40})")
    return DTYPES[label]


# -- download ---------------------------------------------------------------------------------------------------

def halve(weights: Mapping[str, torch.Tensor], precision: str) -> bytes:
    """Global weights for download: floating tensors cast to `precision` (bf16 or fp16), the original dtypes
    recorded in the header so the worker casts them back."""
    target = HALVES[precision]
    tensors, dtypes = {}, {}
    for name, tensor in weights.items():
        dtypes[name] = DTYPE_NAMES[tensor.dtype]
        cast = tensor.is_floating_point() and tensor.element_size() > target.itemsize
        tensors[name] = (tensor.to(target) if cast else tensor).detach().contiguous()
    return _save(tensors, metadata={DOWNLOAD_KEY: json.dumps({"precision": precision, "dtypes": dtypes})})


def load_downloaded(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Weights as downloaded (`weights.loads(copy=False)` for plain ones), halved ones cast back to their dtypes."""
    described = _json_field(metadata(data), DOWNLOAD_KEY)
    tensors = loads(data, copy=False)
    if described is None:
        return tensors
    dtypes = described.get("dtypes") or {}
    return {name: t.to(_dtype(name, dtypes)) for name, t in tensors.items()}


# -- upload -----------------------------------------------------------------------------------------------------

def quantise(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (padded to whole blocks) and float32 absmax scales, one per block of `block_size` values."""
    flat = values.reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32)
    padded[: flat.numel()] = flat
    view = padded.view(blocks, block_size)
    absmax = view.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / LEVELS, torch.ones_like(absmax))
    codes = view.div_(scale.unsqueeze(1)).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes.view(-1), absmax


def int8_bound(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The most each value may be off after int8_blockwise (absmax of its block / 254), in `values`' shape."""
    flat = values.reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // block_size)
    padded = torch.zeros(blocks * block_size)
    padded[: flat.numel()] = flat.abs()
    per_block = padded.view(blocks, block_size).amax(dim=1) / (2 * LEVELS)
    return per_block.repeat_interleave(block_size)[: flat.numel()].view(values.shape)


def encode_update(trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None, encoding: str,
                  block_size: int = 256) -> bytes:
    """The trained weights (minus `base`, the weights training started from, where given) with their floating
    tensors in `encoding`; other tensors as they are. ValueError if a tensor does not match `base`."""
    tensors: dict[str, torch.Tensor] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in trained.items():
        tensor = tensor.detach().to("cpu")
        dtypes[name], shapes[name] = DTYPE_NAMES[tensor.dtype], list(tensor.shape)
        if name.endswith(SCALES):
            raise ValueError(f"tensor name {name!r} ends with the reserved suffix {SCALES!r}")
        if not tensor.is_floating_point():
            tensors[name] = tensor.contiguous()
            continue
        value = tensor
        if base is not None:
            reference = base.get(name)
            if reference is None or reference.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} is not in the round's global weights with shape "
                                 f"{list(tensor.shape)}")
            value = tensor.to(torch.float32) - reference.to(torch.float32)
        if encoding == "int8_blockwise":
            tensors[name], tensors[name + SCALES] = quantise(value, block_size)
        else:
            tensors[name] = value.to(HALVES[encoding]).contiguous()
    described = {"v": 1, "delta": base is not None, "encoding": encoding, "block_size": block_size,
                 "dtypes": dtypes, "shapes": shapes}
    return _save(tensors, metadata={UPDATE_KEY: json.dumps(described)})


def is_encoded(data: bytes | bytearray | memoryview) -> bool:
    """Whether safetensors bytes are an encoded upload (else plain weights)."""
    view = memoryview(data)
    if len(view) >= 8:
        (length,) = struct.unpack("<Q", view[:8])
        if length <= MAX_HEADER and b'"' + UPDATE_KEY.encode() + b'"' not in bytes(view[8 : 8 + length]):
            return False  # no metadata of ours: the header is not parsed twice
    return UPDATE_KEY in metadata(data)


def file_is_encoded(path: str | Path) -> bool:
    """Whether a safetensors file is an encoded upload, from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        (length,) = struct.unpack("<Q", head)
        return length <= MAX_HEADER and is_encoded(head + f.read(length))


def needs_base(data: bytes | bytearray | memoryview | Mapping[str, str]) -> bool:
    """Whether decoding these bytes (or an object with this metadata) needs the round's global weights (a delta)."""
    described = _json_field(data if isinstance(data, Mapping) else metadata(data), UPDATE_KEY)
    return bool(described and described.get("delta"))


class Encoding(NamedTuple):
    """How an upload was encoded, from its metadata, checked."""

    encoding: str
    block: int
    delta: bool
    dtypes: dict[str, torch.dtype]  # each tensor's dtype in the round
    shapes: dict[str, list[int]]

    def stored_names(self) -> set[str]:
        """The tensors an upload so encoded holds: one per tensor, and the scales of each quantised one."""
        return set(self.dtypes) | {n + SCALES for n, d in self.dtypes.items()
                                   if self.encoding == "int8_blockwise" and d.is_floating_point}

    def check_stored(self, name: str, stored: tuple[torch.dtype, int], scales: tuple[torch.dtype, int] | None) -> int:
        """Check tensor `name` as stored (dtype, element count; its scales' likewise); the count of its values."""
        numel = math.prod(self.shapes[name])
        dtype = self.dtypes[name]
        if not dtype.is_floating_point:
            if stored != (dtype, numel):
                raise WeightsError(f"tensor {name!r}: stored as {stored[0]} with {stored[1]} values, metadata says "
                                   f"{dtype}{self.shapes[name]}")
        elif self.encoding == "int8_blockwise":
            blocks = -(-numel // self.block)
            if stored != (torch.int8, blocks * self.block) or scales != (torch.float32, blocks):
                raise WeightsError(f"tensor {name!r}: int8 codes or scales do not fit {numel} values in blocks "
                                   f"of {self.block}")
        elif stored != (HALVES[self.encoding], numel):
            raise WeightsError(f"tensor {name!r}: stored as {stored[0]} with {stored[1]} values, metadata says "
                               f"{self.encoding}{self.shapes[name]}")
        return numel


def encoding_of(meta: Mapping[str, str]) -> Encoding | None:
    """How an upload with this metadata was encoded; None for plain weights; WeightsError if malformed."""
    described = _json_field(meta, UPDATE_KEY)
    if described is None:
        return None
    encoding, block = described.get("encoding"), described.get("block_size")
    dtypes, shapes = described.get("dtypes"), described.get("shapes")
    if encoding not in ("fp32", "bf16", "fp16", "int8_blockwise") or not isinstance(dtypes, dict) \
            or not isinstance(shapes, dict) or not isinstance(block, int) or not 1 <= block <= 1 << 20:
        raise WeightsError(f"upload encoding metadata is malformed: {json.dumps(described)[:120]}")
    for name in dtypes:
        shape = shapes.get(name)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise WeightsError(f"tensor {name!r}: metadata shape {shape!r} is malformed")
    return Encoding(encoding, block, bool(described.get("delta")), {n: _dtype(n, dtypes) for n in dtypes},
                    {n: shapes[n] for n in dtypes})


def check_scales(name: str, scales: torch.Tensor) -> None:
    """Refuse block scales no encoder writes (negative or not finite)."""
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WeightsError(f"tensor {name!r}: its block scales are negative or not finite")


def reference_of(name: str, shape: list[int], base: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The global weights' tensor a delta's tensor `name` is added to."""
    reference = base.get(name)
    if reference is None or list(reference.shape) != shape:
        raise WeightsError(f"tensor {name!r} of the delta is not in the round's global weights with shape {shape}")
    return reference


def decode_values(coded: Encoding, name: str, stored: torch.Tensor, scales: torch.Tensor | None, offset: int,
                  count: int, reference: torch.Tensor | None) -> torch.Tensor:
    """Values `offset`..`offset + count` (flat) of floating tensor `name` as the round holds them, from its stored
    values from `offset` on (int8 codes with the tensor's block `scales`, or halves) and, for a delta, the global
    weights' tensor: the same bits for any split of a tensor into ranges (elementwise float32 operations)."""
    if coded.encoding == "int8_blockwise":
        assert scales is not None
        value = dequantise_range(stored[:count], scales, offset, coded.block)
    else:
        value = stored[:count].to(torch.float32)
    if reference is not None:
        added = reference.reshape(-1)[offset : offset + count].to(torch.float32)
        value = value.add_(added) if value.data_ptr() != stored.data_ptr() else added + value
    return value.to(coded.dtypes[name])


def dequantise_range(codes: torch.Tensor, absmax: torch.Tensor, offset: int, block: int) -> torch.Tensor:
    """The float32 values of int8 codes that start at value `offset` of their tensor (flat), `quantise` undone: each
    code times its block's absmax / LEVELS."""
    scale = absmax / LEVELS
    out = codes.to(torch.float32)
    at, first = 0, offset // block
    head = min(len(out), (-offset) % block)
    if head:
        out[:head].mul_(scale[first])
        at, first = head, first + 1
    whole = (len(out) - at) // block
    if whole:
        out[at : at + whole * block].view(whole, block).mul_(scale[first : first + whole].unsqueeze(1))
        at, first = at + whole * block, first + whole
    if at < len(out):
        out[at:].mul_(scale[first])
    return out


def decode_update(data: bytes | bytearray | memoryview,
                  base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights an upload stands for, in their own dtypes: plain weights as they are (zero-copy), an encoded
    upload dequantised and, for a delta, added to `base` (the round's global weights) in float32.
    WeightsError (one line) for anything malformed."""
    coded = encoding_of(metadata(data))
    tensors = loads(data, copy=False)
    if coded is None:
        return tensors
    if coded.delta and base is None:
        raise WeightsError("the upload is a delta but no global weights were given to add it to")
    expected = coded.stored_names()
    if set(tensors) != expected:
        raise WeightsError(f"upload tensors differ from its metadata: extra {sorted(set(tensors) - expected)[:3]}, "
                           f"missing {sorted(expected - set(tensors))[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name, dtype in coded.dtypes.items():
        stored, scales = tensors[name], tensors.get(name + SCALES)
        numel = coded.check_stored(name, (stored.dtype, stored.numel()),
                                   None if scales is None else (scales.dtype, scales.numel()))
        if not dtype.is_floating_point:
            out[name] = stored
            continue
        if scales is not None:
            check_scales(name, scales)
        reference = reference_of(name, coded.shapes[name], base) if base is not None and coded.delta else None
        out[name] = decode_values(coded, name, stored.reshape(-1), scales, 0, numel, reference).view(
            coded.shapes[name])
    return out
