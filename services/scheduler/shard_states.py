"""Where each shard's latest state and the strategy's shared server state are (references only: the tensors stay in
storage), so the next round's assignments hand them to whichever worker trains each shard, and the final model
keeps them (apiary.shard_state).

Only an aggregated round changes them, and only for its accepted shards that returned a state: a shard that failed,
was refused or missed the round keeps the state it had, and a failed round (retried from the last global weights)
changes none.
"""

from __future__ import annotations

import logging
from typing import Any

from apiary import keys
from apiary.contracts import Assignment, ObjectRef, RoundAggregated
from apiary.db import Executor
from apiary.errors import DependencyUnavailable
from apiary.jobspec import JobSpec
from apiary.safetensors_header import tensor_names
from apiary.shard_state import personal_layers_error
from apiary.storage import ObjectNotFound, Storage

log = logging.getLogger("apiary.scheduler")

COMPONENT = "scheduler_shard_states"
# Append only, as every component's migrations.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS shard_states (
      job_id TEXT NOT NULL, shard BIGINT NOT NULL, round BIGINT NOT NULL, state_key TEXT NOT NULL,
      size BIGINT NOT NULL, sha256 TEXT NOT NULL, PRIMARY KEY (job_id, shard));
    CREATE TABLE IF NOT EXISTS server_states (
      job_id TEXT NOT NULL PRIMARY KEY, round BIGINT NOT NULL, state_key TEXT NOT NULL,
      size BIGINT NOT NULL, sha256 TEXT NOT NULL);
    -- Each shard's state as each aggregated round left it: the final model keeps the states of the round whose
    -- weights it keeps (early_stopping.keep_best), and pruning knows which objects a round may still need.
    CREATE TABLE IF NOT EXISTS shard_state_history (
      job_id TEXT NOT NULL, shard BIGINT NOT NULL, round BIGINT NOT NULL, state_key TEXT NOT NULL,
      size BIGINT NOT NULL, sha256 TEXT NOT NULL, PRIMARY KEY (job_id, shard, round));
    """,
]


async def record(tx: Executor, event: RoundAggregated) -> None:
    """A round aggregated: its accepted shards' new states, and the strategy's shared server state, are current."""
    for shard, ref in sorted(event.shard_states.items()):
        await tx.execute(
            "INSERT INTO shard_states (job_id, shard, round, state_key, size, sha256) VALUES ($1, $2, $3, $4, $5, $6)"
            " ON CONFLICT (job_id, shard) DO UPDATE SET round = $3, state_key = $4, size = $5, sha256 = $6",
            event.job_id, shard, event.round, ref.key, ref.size, ref.sha256)
        await tx.execute(
            "INSERT INTO shard_state_history (job_id, shard, round, state_key, size, sha256)"
            " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (job_id, shard, round) DO NOTHING",
            event.job_id, shard, event.round, ref.key, ref.size, ref.sha256)
    if event.server_state is not None:
        ref = event.server_state
        await tx.execute(
            "INSERT INTO server_states (job_id, round, state_key, size, sha256) VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT (job_id) DO UPDATE SET round = $2, state_key = $3, size = $4, sha256 = $5",
            event.job_id, event.round, ref.key, ref.size, ref.sha256)


async def current(db: Executor, job_id: str) -> tuple[dict[int, ObjectRef], ObjectRef | None]:
    """Each shard's latest state and the shared server state of a job (empty and None before any)."""
    rows = await db.fetch("SELECT shard, state_key, size, sha256 FROM shard_states WHERE job_id = $1", job_id)
    shards = {int(r["shard"]): ObjectRef(key=r["state_key"], size=int(r["size"]), sha256=r["sha256"]) for r in rows}
    row = await db.fetchrow("SELECT state_key, size, sha256 FROM server_states WHERE job_id = $1", job_id)
    server = None if row is None else ObjectRef(key=row["state_key"], size=int(row["size"]), sha256=row["sha256"])
    return shards, server


async def as_of(db: Executor, job_id: str, round_index: int) -> dict[int, ObjectRef]:
    """Each shard's state as aggregated round `round_index` left it (the latest one recorded up to it); the current
    states for a job whose rounds predate the history."""
    rows = await db.fetch("SELECT shard, round, state_key, size, sha256 FROM shard_state_history WHERE job_id = $1"
                          " ORDER BY shard, round", job_id)
    if not rows:
        return (await current(db, job_id))[0]
    return {int(r["shard"]): ObjectRef(key=r["state_key"], size=int(r["size"]), sha256=r["sha256"])
            for r in rows if int(r["round"]) <= round_index}  # in round order: each shard's last one stays


async def sizes(db: Executor, job_id: str) -> dict[int, int]:
    """Each shard's latest state size in bytes (status, the API)."""
    rows = await db.fetch("SELECT shard, size FROM shard_states WHERE job_id = $1", job_id)
    return {int(r["shard"]): int(r["size"]) for r in rows}


def assignment_fields(storage: Storage, a: Assignment, states: dict[int, ObjectRef], server: ObjectRef | None,
                      personal_layers: list[str], ttl: int) -> dict[str, Any]:
    """What a training assignment carries for its shard's state, its URLs presigned for `ttl` seconds: the latest
    state (if any) to download, where this round's goes, and the round's shared server state (if any)."""
    key = keys.shard_state(a.job_id, a.shard, a.round, a.attempt)
    fields: dict[str, Any] = {"state_upload_url": storage.presign_put(key, ttl), "state_key": key,
                              "personal_layers": list(personal_layers)}
    latest = states.get(a.shard)
    if latest is not None:
        fields.update(state_url=storage.presign_get(latest.key, ttl), state_sha256=latest.sha256)
    if server is not None:
        fields.update(server_state_url=storage.presign_get(server.key, ttl), server_state_sha256=server.sha256)
    return fields


async def keep_final(storage: Storage, db: Executor, job_id: str, kept_round: int) -> list[str]:
    """Copy each shard's state as round `kept_round` (the round whose weights are the final model) left it beside
    the final model (keys.final_shard_state); the keys written. A shard with no state by then gets none; a state
    that is gone is skipped, with a warning: the final model stands without it."""
    states = await as_of(db, job_id, kept_round)
    written = []
    for shard, ref in sorted(states.items()):
        try:
            data = await storage.verified_bytes(ref)
        except (ObjectNotFound, ValueError) as e:
            log.warning("job %s: shard %d's state is not kept with the final model: %s", job_id, shard, e)
            continue
        target = keys.final_shard_state(job_id, shard)
        await storage.put_bytes(target, data)
        written.append(target)
    return written


async def prune(storage: Storage, db: Executor, job_id: str, round_index: int, may_be_kept: set[int]) -> int:
    """Once round `round_index` aggregated, delete the shard-state objects nothing can need any more; how many went.

    Needed are the states of every round the final model may still keep (`may_be_kept`: the latest round, and with
    early stopping every round its rule may still pick) and so each shard's current one, which the next round
    downloads and the aggregator's checks read, also after a restart. The assignments' uploads of rounds up to
    this one were judged and copied already. Kept copies of rounds still training are never touched: only objects
    the history names go. Best effort, as the rounds' pruning."""
    prefix = f"{keys.job_prefix(job_id)}shard-state/"
    rows = await db.fetch("SELECT shard, round, state_key FROM shard_state_history WHERE job_id = $1", job_id)
    needed: set[str] = set()
    for kept in may_be_kept:
        needed.update(ref.key for ref in (await as_of(db, job_id, kept)).values())
    needed.update(ref.key for ref in (await current(db, job_id))[0].values())
    superseded = {r["state_key"] for r in rows} - needed
    deleted = 0
    try:
        gone = [key for key in await storage.list(prefix) if key in superseded or _upload_round(key) <= round_index]
        await storage.delete_many(gone)
        deleted = len(gone)
    except (DependencyUnavailable, OSError) as e:
        log.warning("job %s: superseded shard states are left in storage for now: %s", job_id, e)
    return deleted


def _upload_round(key: str) -> int:
    """The round of an assignment's state upload (keys.shard_state); a kept copy's is unbounded (never by round)."""
    name = key.rsplit("/", 1)[-1]
    if not name.startswith("round-"):
        return 1 << 62
    try:
        return int(name.removeprefix("round-").split("-", 1)[0])
    except ValueError:
        return 1 << 62


async def personal_layers_refused(storage: Storage, spec: JobSpec, weights: ObjectRef) -> str | None:
    """Why the job's `personal_layers` cannot apply to its initial weights (they match no tensor, or all of them),
    in one line; None if they split the model or the job names none. Checked before round 1 starts."""
    globs = spec.distributed.personal_layers
    if not globs:
        return None
    names = tensor_names(await storage.get_bytes(weights.key))
    why = personal_layers_error(names, globs)
    return None if why is None else f"distributed.personal_layers: {why}"
