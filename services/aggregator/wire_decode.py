"""Contributions as strategies see them: plain uploads as they are (zero-copy), encoded ones (`distributed.transfer`:
a delta, half precision, int8 blockwise) decoded into full-precision weights in the round's dtypes first, so every
strategy sums in full precision whatever travelled."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping

import torch

from apiary.contracts import ObjectRef
from apiary.storage import Storage
from apiary.strategies.base import Contribution
from apiary.streamed_update import StreamedUpdate
from apiary.streamed_weights import RangeSource, StreamedWeights
from apiary.weights import loads as load_weights
from apiary.wire_codec import UPDATE_KEY, decode_update, is_encoded, needs_base
from services.aggregator.round_state import RoundState

# A plain contribution larger than this is folded straight from storage (apiary.streamed_weights), never held whole.
STREAM_MIN_BYTES = 32 * 2**20
URL_SECONDS = 3600  # the lifetime of the URL a streamed contribution is read through
BASES_HELD = 2  # global weights kept for delta decoding: the latest rounds' (a job's retry, two jobs at once)


class UpdateDecoder:
    """Decodes uploads, keeping the global weights that deltas are added to for the rounds decoded lately."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._bases: collections.OrderedDict[tuple[str, str], Mapping[str, torch.Tensor]] = collections.OrderedDict()
        self._lock = asyncio.Lock()

    async def contribution(self, data: bytes, weights: ObjectRef, samples: int,
                           metrics: Mapping[str, float]) -> Contribution:
        """The contribution `data` stands for in a round that started from `weights`; WeightsError (a ValueError)
        if it is malformed."""
        if not is_encoded(data):
            return Contribution(load_weights(data, copy=False), samples, metrics)
        base = await self._base(weights) if needs_base(data) else None
        decoded = await asyncio.to_thread(decode_update, data, base)
        return Contribution(decoded, samples, metrics)

    async def stored(self, ref: ObjectRef, weights: ObjectRef, samples: int,
                     metrics: Mapping[str, float]) -> Contribution:
        """The contribution stored as `ref` in a round that started from `weights`: a large one streamed from
        storage as it is folded (checked against `ref`'s sha256 before its last tensor; an encoded one decoded chunk
        by chunk), any other fetched whole (checked) and decoded."""
        if streams(ref.size):
            source = RangeSource(self._storage.presign_get(ref.key, URL_SECONDS), ref.etag)
            streamed = await asyncio.to_thread(StreamedWeights, source, ref.size, ref.sha256)
            if UPDATE_KEY not in streamed.metadata:
                return Contribution(streamed, samples, metrics)
            base = await self._base(weights) if needs_base(streamed.metadata) else None
            return Contribution(StreamedUpdate(streamed, base), samples, metrics)
        return await self.contribution(await self._storage.verified_bytes(ref), weights, samples, metrics)

    async def _base(self, weights: ObjectRef) -> Mapping[str, torch.Tensor]:
        key = (weights.key, weights.sha256)
        async with self._lock:
            base = self._bases.get(key)
            if base is None:
                base = load_weights(await self._storage.verified_bytes(weights), copy=False)
                self._bases[key] = base
                while len(self._bases) > BASES_HELD:
                    self._bases.popitem(last=False)
            self._bases.move_to_end(key)
            return base


def streams(size: int) -> bool:
    """Whether a contribution of `size` bytes is folded straight from storage rather than fetched whole."""
    return size > STREAM_MIN_BYTES


async def take_in(state: RoundState, shard: int, contribution: Contribution) -> None:
    """Fold a contribution into the round's state: one streamed from storage in a thread (its reads and the
    strategy's `add_` overlap there, the event loop free), any other here."""
    if not isinstance(contribution.weights, StreamedWeights | StreamedUpdate):
        state.take_in(shard, contribution)
        return
    fold = asyncio.ensure_future(asyncio.to_thread(state.take_in, shard, contribution))
    try:
        await asyncio.shield(fold)
    except asyncio.CancelledError:
        # The thread folds on; its contribution's row will not be recorded: once it ends, the state is marked
        # stale, so the round is recovered from its rows (exactly once) when next used.
        await asyncio.gather(fold, return_exceptions=True)
        state.stale = True
        raise
