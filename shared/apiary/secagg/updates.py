"""An update as the protocol's flat vector, on the worker (numpy only: the worker process never loads torch).

The vector is every tensor of the contribution, in sorted name order, less the round's global weights, flattened
in float64. A worker masks it (protocol.Participant.masked_input) and uploads the result as one uint64 tensor,
MASKED, in a safetensors file where a plain contribution would be: storage and the aggregator hold that alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from apiary.safetensors_header import read_header

MASKED = "secagg.masked"  # the one tensor of a masked contribution
# safetensors dtypes as numpy reads them (little-endian, as the format stores them); BF16 has no numpy dtype and is
# widened to float32 by `read_tensors`, exactly (a bfloat16 is the top half of a float32).
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1",
          "BOOL": "?"}


def read_tensors(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The tensors of safetensors bytes as numpy arrays, bfloat16 ones widened exactly to float32 (safetensors'
    own numpy reader refuses them); WeightsError (one line) for bytes that are not a well-formed file."""
    view = memoryview(data)
    header, base = read_header(view)
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        raw = view[base + start:base + end]
        if entry["dtype"] == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:  # read_header admits no dtype that is neither
            values = np.frombuffer(raw, dtype=_NUMPY[entry["dtype"]])
        tensors[name] = values.reshape(entry["shape"])
    return tensors


def update_vector(weights: Mapping[str, np.ndarray], global_weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """`weights - global_weights` over every tensor, sorted by name, flattened in float64; ValueError (one line)
    where the two disagree in names or shapes."""
    if weights.keys() != global_weights.keys():
        missing, extra = sorted(global_weights.keys() - weights.keys()), sorted(weights.keys() - global_weights.keys())
        raise ValueError(f"the trained weights' tensors differ from the round's (missing {missing[:3]}, extra "
                         f"{extra[:3]})")
    parts = []
    for name in sorted(weights):
        tensor, base = weights[name], global_weights[name]
        if tensor.shape != base.shape:
            raise ValueError(f"tensor {name!r} is {tuple(tensor.shape)}, the round's is {tuple(base.shape)}")
        update = tensor.astype(np.float64) - base.astype(np.float64)
        if not np.isfinite(update).all():
            raise ValueError(f"tensor {name!r} has NaN or infinite values")
        parts.append(update.ravel())
    return np.concatenate(parts) if parts else np.zeros(0)


def vector_length(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The length of the update vector of tensors of these shapes."""
    return int(sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values()))


def to_wire(masked: np.ndarray) -> np.ndarray:
    """A masked vector as it is uploaded: its uint32 bits as int32 (every ring value is below modulus_range <=
    2**32; safetensors as Apiary reads it has no unsigned 32-bit dtype), so a masked float32 model weighs what the
    plain one does, plus one value."""
    if masked.size and int(masked.max()) >= 2**32:
        raise ValueError("a masked vector has values above 2**32: not of a ring secure_aggregation allows")
    return masked.astype(np.uint32).view(np.int32)


def from_wire(uploaded: np.ndarray) -> np.ndarray:
    """An uploaded masked vector back as the collector sums it (uint64); ValueError for any other form."""
    if uploaded.dtype != np.int32 or uploaded.ndim != 1:
        raise ValueError(f"a masked contribution is one int32 vector, got {uploaded.dtype} {tuple(uploaded.shape)}")
    return uploaded.view(np.uint32).astype(np.uint64)
