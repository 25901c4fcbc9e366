"""The aggregator's side of secure aggregation (apiary.secagg): it relays the protocol's stages between a round's
workers and holds each round's `Collector`, which the round's strategy (apiary.secagg.strategy.MaskedSum) folds
masked vectors into.

Stage by stage: every shard's signed keys in (`worker.secagg.keys`), the roster out to each worker
(`secagg.worker.<id>`); every advertised shard's encrypted shares in, each worker's forwarded out; masked
vectors arrive as the round's contributions (`worker.done`); once they have all settled (or at the round's
timeout) the unmask requests go out and the round closes when the revealed shares rebuild every secret. A shard
whose worker fails (`worker.failed`) before masking is left out of the stages still to come.

Every protocol message is stored (`secagg_messages`) before it is taken in, and so is every stage the aggregator
moves to before that stage's messages go out: a restarted aggregator replays them into a new collector (the
masked vectors it re-folds from storage like any round's contributions) and sends the current stage's messages
again, which workers that had them ignore. Secure rounds need a single aggregator replica: the stages of a round
must reach the one that holds its collector.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from apiary import proof
from apiary.bus import Bus, publish_event
from apiary.contracts import RoundTimeout, SecAggKeys, SecAggReveal, SecAggShares, SecAggStage, secagg_key
from apiary.secagg import crypto
from apiary.secagg.messages import advertisement, keys_of, node, reveal, shard_of, share, shares_of
from apiary.secagg.protocol import Collector, SecAggError
from apiary.secagg.strategy import MaskedSum
from apiary.status import ContributionStatus
from apiary.strategies.base import Strategy
from services.aggregator.decisions import secret_digests
from services.aggregator.round_state import Round, RoundKey, RoundState
from services.aggregator.store import AggregatorStore

log = logging.getLogger("apiary.aggregator")

UNMASK_WAIT = 60.0  # seconds the unmask stage waits for shares when the job's settings name no timeout
LOST = ("the aggregator holds no key agreement for this round (it restarted during the round): its masks cannot "
        "be removed")


@dataclass
class SecureRound:
    """One round's key agreement: the collector, which worker holds each node, and the stage reached."""

    collector: Collector
    workers: dict[int, str] = field(default_factory=dict)
    stage: str = "keys"  # keys -> shares -> masked -> unmask (or aborted)
    unmask_deadline: float = 0.0  # when the unmask stage stops waiting for shares
    reason: str = ""  # aborted: why


class SecureRounds:
    """The key agreements of the rounds this aggregator holds."""

    def __init__(self, bus: Bus, store: AggregatorStore) -> None:
        self._bus, self._store = bus, store
        self._rounds: dict[RoundKey, SecureRound] = {}

    async def restore(self, round_: Round) -> None:
        """A secure round's key agreement as stored, replayed into a new collector if it is not held (after a
        restart), and the messages of the stage it reached sent again."""
        if round_.secure is None or round_.key in self._rounds:
            return
        rows = await self._store.secagg_messages(*round_.key)
        if not rows:
            return
        held = self.start(round_)
        assert held is not None
        collector = held.collector
        for row in rows:
            kind, shard = row["kind"], row["shard"]
            try:
                if kind == "keys":
                    event = SecAggKeys.model_validate_json(row["body"])
                    collector.take_advertisement(advertisement(event))
                    held.workers[node(shard)] = event.worker_id
                elif kind == "shares":
                    collector.take_shares(node(shard), [share(s) for s in
                                                        SecAggShares.model_validate_json(row["body"]).shares])
                elif kind == "reveal":
                    collector.take_reveal(reveal(SecAggReveal.model_validate_json(row["body"])))
                elif kind == "stage.masked":
                    collector.close_shares()
                if kind.startswith("stage."):
                    held.stage, held.reason = kind.removeprefix("stage."), row["body"]
                    if held.stage == "unmask":
                        held.unmask_deadline = float(row["received_at"]) + self._unmask_wait(round_)
            except SecAggError as e:
                log.warning("job %s round %d: stored %s of shard %d not replayed: %s", *round_.key[:2], kind, shard, e)
        log.info("job %s round %d: secure aggregation restored at its %s stage", *round_.key[:2], held.stage)
        await self._resend(round_.key, held)

    def start(self, round_: Round) -> SecureRound | None:
        """The round's key agreement, begun now if it is not held (a round without secure aggregation: None)."""
        if round_.secure is None:
            return None
        held = self._rounds.get(round_.key)
        if held is None:
            params = round_.secure.settings.resolved(len(round_.secure.verify_keys))
            verify = {node(shard): bytes.fromhex(key) for shard, key in round_.secure.verify_keys.items()}
            context = crypto.round_context(*round_.key)
            held = self._rounds[round_.key] = SecureRound(Collector(context, params, verify, length=0))
        return held

    def strategy(self, round_: Round, inner: Strategy) -> Strategy:
        """The round's strategy: `inner` itself, or wrapped to fold masked vectors into its collector."""
        if round_.secure is None:
            return inner
        held = self._rounds.get(round_.key)
        return MaskedSum(inner, None if held is None else held.collector, LOST)

    def drop_job(self, job_id: str) -> None:
        """Forget every key agreement of a job."""
        for key in [k for k in self._rounds if k[0] == job_id]:
            del self._rounds[key]

    def drop(self, key: RoundKey) -> None:
        """Forget a round's key agreement (it closed)."""
        self._rounds.pop(key, None)

    async def on_keys(self, state: RoundState, event: SecAggKeys, user_id: str | None) -> None:
        """Stage 1: a shard's keys; the roster goes out once every shard still in the round has advertised."""
        held = self._judged(state, event, user_id)
        if held is None:
            return
        if held.stage != "keys":
            log.info("job %s round %d: keys of shard %d after the roster went out: ignored", *state.key[:2],
                     event.shard)
            return
        try:
            held.collector.take_advertisement(advertisement(event))
        except SecAggError as e:
            log.warning("job %s round %d shard %d: keys refused: %s", *state.key[:2], event.shard, e)
            return
        held.workers[node(event.shard)] = event.worker_id
        await self._keep(state.key, event.shard, "keys", event.model_dump_json())
        await self.advance(state)

    async def on_shares(self, state: RoundState, event: SecAggShares, user_id: str | None) -> None:
        """Stage 2: a shard's encrypted shares; forwarded once every shard of the roster has sent them."""
        held = self._judged(state, event, user_id)
        if held is None or held.stage != "shares":
            return
        try:
            held.collector.take_shares(node(event.shard), [share(s) for s in event.shares])
        except SecAggError as e:
            log.warning("job %s round %d shard %d: shares refused: %s", *state.key[:2], event.shard, e)
            return
        await self._keep(state.key, event.shard, "shares", event.model_dump_json())
        await self.advance(state)

    async def on_reveal(self, state: RoundState, event: SecAggReveal, user_id: str | None) -> bool:
        """Stage 4: a survivor's shares; whether the round can be unmasked now."""
        held = self._judged(state, event, user_id)
        if held is None or held.stage != "unmask":
            return False
        try:
            held.collector.take_reveal(reveal(event))
        except SecAggError as e:
            log.warning("job %s round %d shard %d: shares refused: %s", *state.key[:2], event.shard, e)
            return False
        await self._keep(state.key, event.shard, "reveal", event.model_dump_json())
        return held.collector.ready()

    async def advance(self, state: RoundState) -> None:
        """Move the key agreement on where every shard still in the round has done its part (a failed shard is
        no longer waited for)."""
        held = self._rounds.get(state.key)
        if held is None:
            return
        out = {shard for shard, status in state.settled.items() if status is not ContributionStatus.ACCEPTED}
        waited = {node(shard) for shard in state.round.shards} - {node(shard) for shard in out}
        collector = held.collector
        try:
            if held.stage == "keys" and waited <= set(collector.roster):
                collector.roster_list()  # refuses a roster some node's threshold cannot hold
                await self._move(state.key, held, "shares")
            elif held.stage == "shares" and waited & set(collector.roster) <= set(collector.shares):
                collector.close_shares()
                await self._move(state.key, held, "masked")
        except SecAggError as e:
            await self._abort(state.key, held, str(e))

    async def holds_back(self, state: RoundState) -> bool:
        """Whether closing the round must wait for the unmask stage: the requests go out (once) and the round
        closes when the shares are in, or fails when the stage's wait is over."""
        held = self._rounds.get(state.key)
        if held is None or held.collector.ready():
            return False
        if held.stage == "masked" and held.collector.contributed:
            try:
                for n in held.collector.contributed:
                    held.collector.unmask_request(n)  # refuses a round some node's threshold cannot hold
            except SecAggError as e:
                await self._abort(state.key, held, str(e))
                return False
            wait = self._unmask_wait(state.round)
            held.unmask_deadline = time.time() + wait
            await self._move(state.key, held, "unmask")
            job_id, round_index, attempt = state.key
            await publish_event(self._bus, RoundTimeout(job_id=job_id, round=round_index, attempt=attempt),
                                delay=wait)
            return True
        # Waiting for shares until the stage's own deadline (the round's timeout may come meanwhile); then the
        # round closes with what it has, and fails if that cannot unmask it.
        return held.stage == "unmask" and time.time() < held.unmask_deadline

    def _judged(self, state: RoundState, event: SecAggKeys | SecAggShares | SecAggReveal,
                user_id: str | None) -> SecureRound | None:
        held = self.start(state.round)
        if held is None:
            log.info("job %s round %d: a %s for a round without secure aggregation: ignored", *state.key[:2],
                     event.routing_key)
            return None
        if event.shard not in state.round.shards:
            log.warning("job %s round %d: %s for unassigned shard %d: ignored", *state.key[:2], event.routing_key,
                        event.shard)
            return None
        digest = secret_digests(state.round.secret_digests).get(str(event.shard), proof.UNMATCHABLE)
        forged = proof.judge(event.worker_id, user_id, event.secret, digest, about=f"shard {event.shard}")
        if forged is not None:
            log.warning("job %s round %d: %s refused as forged: %s", *state.key[:2], event.routing_key, forged)
            return None
        return held

    @staticmethod
    def _unmask_wait(round_: Round) -> float:
        settings = round_.secure
        return settings.settings.timeout if settings is not None and settings.settings.timeout else UNMASK_WAIT

    async def _keep(self, key: RoundKey, shard: int, kind: str, body: str) -> None:
        await self._store.keep_secagg(key, shard, kind, body)

    async def _move(self, key: RoundKey, held: SecureRound, stage: str) -> None:
        """Go to `stage`: stored first, then its messages sent (a restart in between sends them again)."""
        held.stage = stage
        await self._keep(key, -1, f"stage.{stage}", held.reason)
        await self._resend(key, held)

    async def _resend(self, key: RoundKey, held: SecureRound) -> None:
        """The messages of the stage the round is at, to each worker concerned."""
        job_id, round_index, attempt = key
        collector = held.collector

        def stage(n: int, name: Literal["roster", "forward", "unmask", "abort"], **fields: Any) -> SecAggStage:
            return SecAggStage(job_id=job_id, round=round_index, attempt=attempt, shard=shard_of(n), stage=name,
                               **fields)

        messages: dict[int, SecAggStage] = {}
        if held.stage == "shares":
            roster = [keys_of(ad) for ad in collector.roster_list()]
            messages = {n: stage(n, "roster", roster=roster) for n in held.workers}
        elif held.stage == "masked":
            messages = {n: stage(n, "forward", shares=shares_of(collector.forwarded(n))) for n in held.workers}
        elif held.stage == "unmask":
            requests = {n: collector.unmask_request(n) for n in sorted(collector.contributed)}
            messages = {n: stage(n, "unmask", survivors=[shard_of(x) for x in r.survivors],
                                 dropped=[shard_of(x) for x in r.dropped]) for n, r in requests.items()}
        elif held.stage == "aborted":
            messages = {n: stage(n, "abort", reason=held.reason) for n in held.workers}
        for n, message in sorted(messages.items()):
            if n in held.workers:
                await publish_event(self._bus, message, routing_key=secagg_key(held.workers[n]))

    async def _abort(self, key: RoundKey, held: SecureRound, reason: str) -> None:
        log.warning("job %s round %d: secure aggregation cannot go on: %s", *key[:2], reason)
        held.reason = reason
        await self._move(key, held, "aborted")
