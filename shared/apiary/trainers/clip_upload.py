"""A trained result clipped on the worker before upload (differential privacy with `clip_on: worker`): the
aggregator never holds an unclipped update, and refuses one that measures over the norm."""

from __future__ import annotations

import hashlib
from pathlib import Path

from apiary import weights as w
from apiary.strategies.clipping import clip_for_upload


def clip_result(result_path: str | Path, weights_path: str | Path, norm_bound: float) -> tuple[int, str]:
    """Rewrite the result at `result_path` with its update (against the round's global weights at `weights_path`)
    clipped to `norm_bound`; its new size and sha256. ValueError (one line) if the two do not match."""
    result = w.loads(Path(result_path).read_bytes())
    base = w.loads(Path(weights_path).read_bytes())
    for name, tensor in result.items():
        reference = base.get(name)
        if reference is None:
            raise ValueError(f"tensor {name!r} is not in the round's global weights")
        if reference.shape != tensor.shape or reference.dtype != tensor.dtype:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the global weights' "
                             f"{reference.dtype} {tuple(reference.shape)}")
    clipped, _ = clip_for_upload(result, base, norm_bound)
    data = w.dumps(clipped)
    part = Path(f"{result_path}.part")
    part.write_bytes(data)
    part.replace(result_path)
    return len(data), hashlib.sha256(data).hexdigest()
