"""Closing a round: aggregate it through its strategy and publish round.aggregated, or fail it."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from apiary import keys, metrics, telemetry
from apiary.contracts import RoundAggregated, RoundFailed, SecAggSummary
from apiary.outbox import Outbox
from apiary.status import ContributionStatus, RoundStatus
from apiary.storage import Storage
from apiary.strategies.base import RoundResult
from apiary.weights import dumps as dump_weights
from apiary.weights import loads as load_weights
from apiary.weights import spec_of
from services.aggregator import shard_states
from services.aggregator.decisions import failure_reason, refusals
from services.aggregator.open_rounds import OpenRounds
from services.aggregator.round_state import RoundState
from services.aggregator.store import AggregatorStore
from services.aggregator.stored_contributions import StoredRound

log = logging.getLogger("apiary.aggregator")


class RoundCloser:
    """Ends an open round exactly once: its result and the event announcing it commit together."""

    def __init__(self, store: AggregatorStore, storage: Storage, outbox: Outbox, rounds: OpenRounds) -> None:
        self._store, self._storage, self._outbox, self._rounds = store, storage, outbox, rounds
        # What secure aggregation did in a round, for its round.aggregated / round.failed (unmasked: aggregated).
        self.secure_summary: Callable[..., SecAggSummary | None] = lambda key, unmasked=False: None

    async def close(self, state: RoundState, *, timed_out: bool) -> None:
        """Aggregate or fail the round, inside one span: a child of the round, linked to every
        contribution taken in."""
        # Every contribution in the state's sum is stored first (a failed commit raises here: the round's reports
        # are delivered again, and the round closes from its rows).
        await self._rounds.recorder.drain(state.key)
        rows = await self._store.contributions(*state.key)
        accepted = [r for r in rows if r["status"] == ContributionStatus.ACCEPTED]
        # Another aggregator replica may have taken some of the round's reports: this one takes them in too.
        state = await self._rounds.complete(state, accepted)
        round_ = state.round
        job_id, round_index, attempt = round_.key
        links = [link for r in accepted if (link := telemetry.link_from({"traceparent": r["traceparent"] or ""}))]
        attributes = {"apiary.job_id": job_id, "apiary.round": round_index, "apiary.attempt": attempt,
                      "apiary.contributions": len(accepted), "apiary.samples": sum(r["samples"] for r in accepted),
                      "apiary.bytes": sum(r["size"] for r in accepted)}
        parent = telemetry.context_from({"traceparent": round_.traceparent or ""})
        with telemetry.tracer().start_as_current_span("aggregate", context=parent, links=links,
                                                      attributes=attributes) as span:
            if timed_out:
                span.add_event("round.timeout")
            for r in rows:
                if r["status"] in (ContributionStatus.REJECTED, ContributionStatus.FAILED):
                    span.add_event(f"contribution.{r['status']}", {"apiary.shard": r["shard"],
                                                                    "apiary.worker_id": r["worker_id"],
                                                                    "reason": r["reason"] or ""})
            refused = refusals(rows)
            reason = failure_reason(len(accepted), len(round_.shards), round_.min_workers, refused,
                                    timed_out=timed_out)
            if reason is None:
                reason = await self._aggregate(state, accepted, refused, timed_out=timed_out)
            if reason is not None:
                telemetry.fail(span, "round.failed", reason)
                await self._fail(state, reason, len(accepted))

    async def _fail(self, state: RoundState, reason: str, reported: int) -> None:
        job_id, round_index, attempt = state.key
        failed = RoundFailed(job_id=job_id, round=round_index, attempt=attempt, reason=reason,
                             reported=reported, required=state.round.min_workers,
                             secure_aggregation=self.secure_summary(state.key))
        async with self._store.db.transaction() as tx:
            closed = await self._store.close(tx, state.key, RoundStatus.FAILED, reason=reason)
            if closed:
                await self._outbox.add(tx, failed)
        if closed:
            self._rounds.remember_closed(state.key, RoundStatus.FAILED)
        self._rounds.drop(state.key)
        await self._outbox.flush()

    async def _aggregate(self, state: RoundState, accepted: list[dict[str, Any]], refused: dict[str, str], *,
                         timed_out: bool) -> str | None:
        """Store the round's result and the strategy's new server state, and announce them; or, if the
        strategy cannot aggregate what arrived (Krum with too few contributions, say), why the round fails."""
        job_id, round_index, attempt = state.key
        started = time.perf_counter()
        # finish() consumes the running state: should closing fail after it, the retry re-folds from storage.
        self._rounds.drop(state.key)
        try:
            result = await self._finish(state, accepted)
        except ValueError as e:
            return f"strategy {state.strategy.name} cannot aggregate this round: {e}"
        data = dump_weights(result.weights)
        server_state = state.strategy.state()
        state_key = keys.strategy_state(job_id, round_index) if server_state else None
        async with self._store.db.transaction() as tx:
            # The round's row is claimed before anything is written: a replica closing the round at the same
            # moment (a timeout racing the last report) waits for this commit, then writes nothing. The stored
            # weights are those the row and the event name; a crash before the commit leaves the round open
            # and objects the retry rewrites.
            if not await self._store.close(tx, state.key, RoundStatus.AGGREGATED,
                                           result_key=keys.global_weights(job_id, round_index), state_key=state_key):
                log.info("job %s: round %d was closed by another aggregator replica", job_id, round_index)
                return None
            ref = await self._storage.put_bytes(keys.global_weights(job_id, round_index), data)
            shared = None
            if state_key is not None:
                stored = await self._storage.put_bytes(state_key, dump_weights(server_state))
                shared = stored if state.strategy.shares_state else None
            done = RoundAggregated(
                job_id=job_id, round=round_index, attempt=attempt, weights=ref,
                contributors=sorted(r["shard"] for r in accepted), total_samples=result.total_samples,
                metrics=result.metrics, rejected=refused,
                trained_by={r["shard"]: r["worker_id"] for r in accepted},
                shard_states=await shard_states.of_round(tx, state.key, (r["shard"] for r in accepted)),
                server_state=shared, secure_aggregation=self.secure_summary(state.key, unmasked=True),
            )
            await self._outbox.add(tx, done)
        self._rounds.remember_closed(state.key, RoundStatus.AGGREGATED)
        self._rounds.remember_spec(ref, spec_of(data))
        self._rounds.remember_state(job_id, round_index, state_key)
        log.info("job %s: round %d aggregated from %d shards (%d samples)%s", job_id, round_index,
                 len(accepted), done.total_samples, " at timeout" if timed_out else "")
        await self._outbox.flush()
        metrics.aggregated(time.perf_counter() - started, sum(int(r["size"]) for r in accepted))
        return None

    async def _finish(self, state: RoundState, accepted: list[dict[str, Any]]) -> RoundResult:
        """The strategy's result: from its running state, or, for one that cannot fold, from the round's
        contributions read back from storage tensor by tensor."""
        strategy = state.strategy
        global_weights = None
        if strategy.wants_global_weights():
            global_weights = load_weights(await self._storage.get_bytes(state.round.weights.key))
        if strategy.streaming:
            return strategy.finish(global_weights)
        with tempfile.TemporaryDirectory(prefix="apiary-round-") as folder:
            async def decode(data: bytes) -> Mapping[str, torch.Tensor]:
                return (await self._rounds.decoder.contribution(data, state.round.weights, 1, {})).weights

            stored = await StoredRound.download(self._storage, accepted, Path(folder), decode)
            return strategy.finish(global_weights, stored=stored)
