"""The round's global weights halved for download (`distributed.transfer.download: bf16 | fp16`): made once per
weights and precision, stored beside the job's rounds, and named by the assignments instead of the fp32 weights."""

from __future__ import annotations

import asyncio
import collections

from apiary import keys
from apiary.contracts import ObjectRef
from apiary.storage import Storage

HELD = 64  # copies remembered (a restarted scheduler makes the copy again: the same bytes)


class HalvedWeights:
    """Stores and remembers halved copies of global weights."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._made: collections.OrderedDict[tuple[str, str, str], ObjectRef] = collections.OrderedDict()

    async def copy(self, job_id: str, weights: ObjectRef, precision: str) -> ObjectRef:
        """The halved copy of `weights` (checked against their claim), stored if it is not yet."""
        known = (weights.key, weights.sha256, precision)
        ref = self._made.get(known)
        if ref is None:
            data = await self._storage.verified_bytes(weights)
            halved = await asyncio.to_thread(_halved, data, precision)
            ref = await self._storage.put_bytes(keys.halved_weights(job_id, weights.sha256, precision), halved)
            self._made[known] = ref
            while len(self._made) > HELD:
                self._made.popitem(last=False)
        return ref


def _halved(data: bytes, precision: str) -> bytes:
    """The weights in `data` at half precision, as safetensors bytes."""
    # torch is imported here, not with the module: the scheduler loads it only for a job that halves its downloads
    # (it never holds tensors otherwise, and each of its processes starts a second or more sooner without it).
    from apiary.weights import loads
    from apiary.wire_codec import halve

    return halve(loads(data, copy=False), precision)
