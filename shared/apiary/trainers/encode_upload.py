"""A trained result rewritten in the job's upload encoding before it leaves the worker (`distributed.transfer`):
the delta from the weights training started from and / or its floating tensors in half precision or int8 blockwise
(apiary.wire_codec). The aggregator decodes it before any strategy sees it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from apiary import weights as w
from apiary.wire_codec import encode_update, load_downloaded


def encode_result(result_path: str | Path, weights_path: str | Path, transfer: Mapping[str, Any]) -> tuple[int, str]:
    """Rewrite the result at `result_path` as `transfer` asks (its delta from the weights at `weights_path`, the
    round's global weights as downloaded, where `delta`); its new size and sha256. ValueError (one line) if the
    result does not match the global weights."""
    result = w.loads(Path(result_path).read_bytes())
    base = load_downloaded(Path(weights_path).read_bytes()) if transfer.get("delta") else None
    data = encode_update(result, base, str(transfer.get("upload", "fp32")), int(transfer.get("block_size", 256)))
    part = Path(f"{result_path}.part")
    part.write_bytes(data)
    part.replace(result_path)
    return len(data), hashlib.sha256(data).hexdigest()
