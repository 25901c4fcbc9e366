"""The shard states that contributions report (apiary.shard_state): each one checked before its contribution is
taken in (where its worker's upload went, its size, its names and shapes against the shard's previous state), its
reference kept (never its tensors), and an aggregated round's accepted ones announced with it.

A contribution whose state fails a check is refused as a whole, with the reason: the shard keeps its previous state.
A state that passes is copied under its sha256 (keys.kept_shard_state) and that copy is the one referenced: the
upload key is the assignment's, and an assignment trained twice (redelivered from a worker taken as gone) uploads
there twice, after the first report was judged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

from apiary import keys
from apiary.contracts import ObjectRef, WorkerDone
from apiary.db import Executor
from apiary.shard_state import state_error, state_limit
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import ObjectNotFound, Storage
from apiary.strategies.base import Contribution
from apiary.strategies.scaffold import control_deltas
from apiary.strategies.validation import InvalidContribution
from apiary.streamed_weights import StreamedWeights
from apiary.weights import WeightsError, loads, spec_of
from services.aggregator.round_state import RoundKey

COMPONENT = "aggregator_shard_states"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS contribution_states (
      job_id TEXT NOT NULL, round BIGINT NOT NULL, attempt BIGINT NOT NULL, shard BIGINT NOT NULL,
      state_key TEXT NOT NULL, size BIGINT NOT NULL, sha256 TEXT NOT NULL,
      PRIMARY KEY (job_id, round, attempt, shard));
    """,
]

# The shard's state after its latest aggregated round in which it was accepted with one.
_PREVIOUS = (
    "SELECT s.state_key, s.size, s.sha256 FROM contribution_states s"
    " JOIN contributions c ON c.job_id = s.job_id AND c.round = s.round AND c.attempt = s.attempt"
    " AND c.shard = s.shard AND c.status = $4"
    " JOIN aggregations a ON a.job_id = s.job_id AND a.round = s.round AND a.attempt = s.attempt AND a.status = $5"
    " WHERE s.job_id = $1 AND s.shard = $2 AND s.round < $3 ORDER BY s.round DESC, s.attempt DESC LIMIT 1"
)


async def check(storage: Storage, db: Executor, event: WorkerDone, weights_size: int) -> bytes | None:
    """The report's state (its verified bytes; None if it reports none), or InvalidContribution (one line) unless it
    can become its shard's: the object its assignment's URL wrote, within the bound, with the names, shapes and
    dtypes of the shard's previous state."""
    ref = event.state
    if ref is None:
        return None
    expected = keys.shard_state(event.job_id, event.shard, event.round, event.attempt)
    if ref.key != expected:
        raise InvalidContribution(f"shard state {ref.key!r} is not this assignment's upload ({expected!r})")
    limit = state_limit(weights_size)
    if ref.size > limit:
        raise InvalidContribution(state_error({}, None, ref.size, limit) or "shard state is too large")
    try:
        data = await storage.verified_bytes(ref)
        new = spec_of(data)
        previous = await db.fetchrow(_PREVIOUS, event.job_id, event.shard, event.round,
                                     str(ContributionStatus.ACCEPTED), str(RoundStatus.AGGREGATED))
        old = None if previous is None else spec_of(await storage.get_bytes(previous["state_key"]))
    except ObjectNotFound as e:
        raise InvalidContribution(f"shard state object is missing: {e}") from None
    except (WeightsError, ValueError) as e:
        raise InvalidContribution(f"shard state is not a usable safetensors file: {e}") from None
    why = state_error(new, old, ref.size, limit)
    if why is not None:
        raise InvalidContribution(why)
    return data


async def remember(storage: Storage, db: Executor, event: WorkerDone, data: bytes | None) -> None:
    """Copy a checked state (`data`, as `check` returned it) under its sha256 and keep that copy's reference (again,
    for a redelivered report: the same copy)."""
    if event.state is None or data is None:
        return
    ref = await storage.put_bytes(keys.kept_shard_state(event.job_id, event.shard, event.state.sha256), data)
    await db.execute(
        "INSERT INTO contribution_states (job_id, round, attempt, shard, state_key, size, sha256)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (job_id, round, attempt, shard)"
        " DO UPDATE SET state_key = $5, size = $6, sha256 = $7",
        event.job_id, event.round, event.attempt, event.shard, ref.key, ref.size, ref.sha256)


async def with_control_deltas(storage: Storage, db: Executor, key: RoundKey, shard: int, contribution: Contribution,
                              new_state: bytes | None = None) -> Contribution:
    """A SCAFFOLD contribution with its control-variate change beside its weights (`control_delta.<name>`), derived
    from the shard's new state (`new_state`, else the copy its row names) and the state it trained from: the
    worker uploads only its weights and its new state. Unchanged where the shard reported no state."""
    job_id, round_index, _ = key
    if new_state is None:
        row = await db.fetchrow("SELECT state_key FROM contribution_states WHERE job_id = $1 AND round = $2"
                                " AND attempt = $3 AND shard = $4", *key, shard)
        if row is None:
            return contribution
        new_state = await storage.get_bytes(row["state_key"])
    previous = await db.fetchrow(_PREVIOUS, job_id, shard, round_index, str(ContributionStatus.ACCEPTED),
                                 str(RoundStatus.AGGREGATED))
    try:
        old = {} if previous is None else loads(await storage.get_bytes(previous["state_key"]))
    except ObjectNotFound as e:
        raise InvalidContribution(f"the shard's previous state is missing: {e}") from None
    deltas = control_deltas(loads(new_state), old)
    if not deltas:
        return contribution
    weights = contribution.weights
    # A large contribution streams from storage: read in a thread, as its fold would be.
    merged = (await asyncio.to_thread(dict, weights) if isinstance(weights, StreamedWeights) else dict(weights))
    merged.update(deltas)
    return dataclasses.replace(contribution, weights=merged)


async def of_round(db: Executor, key: RoundKey, accepted: Iterable[int]) -> dict[int, ObjectRef]:
    """The states of a round's accepted shards that reported one."""
    shards = set(accepted)
    rows = await db.fetch("SELECT shard, state_key, size, sha256 FROM contribution_states"
                          " WHERE job_id = $1 AND round = $2 AND attempt = $3", *key)
    return {int(r["shard"]): ObjectRef(key=r["state_key"], size=int(r["size"]), sha256=r["sha256"])
            for r in rows if int(r["shard"]) in shards}
