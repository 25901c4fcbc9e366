"""The aggregator's side of secure aggregation (apiary.secagg): it relays the protocol's stages between a round's
workers and holds each round's `Collector`; the round's strategy (apiary.secagg.strategy.MaskedSum) folds masked
vectors into a sum of its own and unmasks it through the collector.

Stage by stage: every shard's signed keys in (`worker.secagg.keys`), the roster out to each worker
(`secagg.worker.<id>`); every advertised shard's encrypted shares in, each worker's forwarded out; masked
vectors arrive as the round's contributions (`worker.done`); once they have all settled (or at the round's
timeout) the survivor set goes out to be signed (`check`), the signatures come in (`worker.secagg.check`), the
unmask requests go out with them once every survivor signed (or at the check's wait, if at least the threshold
did), and the round closes when the revealed shares rebuild every secret. A shard whose worker fails
(`worker.failed`) before masking is left out of the stages still to come.

The database is the round's truth, so that any number of aggregator replicas, each handed some of the round's
messages by the broker, run one protocol: every protocol message is stored (`secagg_messages`) before it is
taken in, and every stage the round moves to is stored (shard -1) with the set of shards it fixed (the roster
U1, the share senders U2, the survivors U3, the signers U4) before that stage's messages go out. Only the
replica whose insert stored the stage sends them; a replica that lost the race adopts the stored sets. Before
it decides anything a replica reads the round's stored messages it has not taken in (`sync`), under the job's
lock: of two replicas storing a message each, the later reader sees both. A restarted aggregator replays them
the same way and sends the current stage's messages again, which workers that had them ignore.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from apiary import proof
from apiary.bus import Bus, publish_event
from apiary.contracts import (
    RoundTimeout,
    SecAggCheck,
    SecAggKeys,
    SecAggReveal,
    SecAggShares,
    SecAggStage,
    SecAggSummary,
    secagg_key,
)
from apiary.secagg import crypto
from apiary.secagg.messages import advertisement, keys_of, node, reveal, shard_of, share, shares_of
from apiary.secagg.protocol import Collector, SecAggError
from apiary.secagg.strategy import MaskedSum
from apiary.strategies.base import Strategy
from apiary.strategies.validation import InvalidContribution
from services.aggregator.decisions import secret_digests
from services.aggregator.round_state import Round, RoundKey, RoundState
from services.aggregator.store import AggregatorStore

log = logging.getLogger("apiary.aggregator")

STAGE_WAIT = 60.0  # seconds the check and unmask stages wait when the job's settings name no timeout
LOST = ("the aggregator holds no key agreement for this round (it restarted during the round): its masks cannot "
        "be removed")
# The stages in the order a round goes through them (aborted ends it at any point), and the order in which stored
# messages are taken in (each kind needs the ones before it).
STAGES = ("keys", "shares", "masked", "check", "unmask", "aborted")
KINDS = ("keys", "shares", "check", "reveal")
Message = SecAggKeys | SecAggShares | SecAggCheck | SecAggReveal


@dataclass
class SecureRound:
    """One round's key agreement as this aggregator has read it: the collector, which worker holds each node,
    the stage reached and the stored rows taken in."""

    collector: Collector
    workers: dict[int, str] = field(default_factory=dict)
    stage: str = "keys"
    deadline: float = 0.0  # check and unmask: when the stage stops waiting
    reason: str = ""  # aborted: why
    applied: set[tuple[int, str]] = field(default_factory=set)  # (shard, kind) of the stored rows taken in


class SecureRounds:
    """The key agreements of the secure rounds this aggregator has seen."""

    def __init__(self, bus: Bus, store: AggregatorStore) -> None:
        self._bus, self._store = bus, store
        self._rounds: dict[RoundKey, SecureRound] = {}

    def start(self, round_: Round) -> SecureRound | None:
        """The round's key agreement, begun now if it is not held (a round without secure aggregation: None)."""
        if round_.secure is None:
            return None
        held = self._rounds.get(round_.key)
        if held is None:
            # The job's earlier rounds have closed (a round starts once the one before it ended): a replica that
            # did not close them forgets them here (read back from the database, should one be needed again).
            job_id, round_index, attempt = round_.key
            for key in [k for k in self._rounds if k[0] == job_id and (k[1], k[2]) < (round_index, attempt)]:
                del self._rounds[key]
            params = round_.secure.settings.resolved(len(round_.secure.verify_keys))
            verify = {node(shard): bytes.fromhex(key) for shard, key in round_.secure.verify_keys.items()}
            context = crypto.round_context(*round_.key)
            held = self._rounds[round_.key] = SecureRound(Collector(context, params, verify, length=0))
        return held

    async def restore(self, round_: Round) -> None:
        """Before a round's strategy is made: its key agreement as stored; where this aggregator held none (it
        restarted), the messages of the stage the round reached are sent again."""
        fresh = round_.secure is not None and round_.key not in self._rounds
        held = await self.sync(round_)
        if fresh and held is not None and held.applied:
            log.info("job %s round %d: secure aggregation restored at its %s stage", *round_.key[:2], held.stage)
            await self._resend(round_.key, held)

    async def sync(self, round_: Round) -> SecureRound | None:
        """The round's key agreement with every stored row taken in: the stages' fixed sets first (a message
        outside them is refused), then the messages, each kind after the one it needs."""
        held = self.start(round_)
        if held is None:
            return None
        rows = await self._store.secagg_messages(*round_.key)
        new = [r for r in rows if (r["shard"], r["kind"]) not in held.applied]
        if not new:
            return held
        collector = held.collector
        stages = {r["kind"].removeprefix("stage."): r for r in rows if r["kind"].startswith("stage.")}
        for stage in STAGES:
            row = stages.get(stage)
            if row is None or (-1, row["kind"]) in held.applied:
                continue
            fixed = _fixed(row["body"])
            nodes = [node(s) for s in fixed.get("shards", [])]
            if stage == "shares":
                collector.fix_roster(nodes)
            elif stage == "masked":
                collector.fix_senders(nodes)
            elif stage == "check":
                collector.fix_survivors(nodes, checked=False)
            elif stage == "unmask":
                collector.fix_signers(nodes, checked=False)
            elif stage == "aborted":
                held.reason = fixed.get("reason", "")
        for kind in KINDS:
            for row in (r for r in new if r["kind"] == kind):
                try:
                    self._take(held, kind, row["body"])
                except SecAggError as e:
                    log.info("job %s round %d: stored %s of shard %d not taken in: %s", *round_.key[:2], kind,
                             row["shard"], e)
        reached = max((s for s in stages if s != "aborted"), key=STAGES.index, default="keys")
        held.stage = "aborted" if "aborted" in stages else reached
        if held.stage in ("check", "unmask"):
            held.deadline = float(stages[held.stage]["received_at"]) + self._wait(round_)
        held.applied.update((r["shard"], r["kind"]) for r in new)
        return held

    @staticmethod
    def _take(held: SecureRound, kind: str, body: str) -> None:
        collector = held.collector
        if kind == "keys":
            keys = SecAggKeys.model_validate_json(body)
            collector.take_advertisement(advertisement(keys))
            held.workers[node(keys.shard)] = keys.worker_id
        elif kind == "shares":
            shares = SecAggShares.model_validate_json(body)
            collector.take_shares(node(shares.shard), [share(s) for s in shares.shares])
        elif kind == "check":
            check = SecAggCheck.model_validate_json(body)
            collector.take_check(node(check.shard), _hex(check.signature))
        elif kind == "reveal":
            collector.take_reveal(reveal(SecAggReveal.model_validate_json(body)))

    async def admit(self, round_: Round, shard: int) -> None:
        """Before a shard's masked vector is taken in: the key agreement as stored (the vector needs its shard's
        shares among those forwarded); InvalidContribution if it came after the survivors were fixed."""
        held = await self.sync(round_)
        if held is not None and (late := held.collector.late(node(shard))) is not None:
            raise InvalidContribution(late)

    def strategy(self, round_: Round, inner: Strategy) -> Strategy:
        """The round's strategy: `inner` itself, or wrapped to fold masked vectors and unmask their sum."""
        if round_.secure is None:
            return inner
        held = self._rounds.get(round_.key)
        return MaskedSum(inner, None if held is None else held.collector, LOST)

    def summary(self, key: RoundKey, *, unmasked: bool = False) -> SecAggSummary | None:
        """What the round's key agreement did, as round.aggregated and round.failed carry it (None: not a
        secure round held here)."""
        held = self._rounds.get(key)
        if held is None:
            return None
        c = held.collector

        def shards(nodes: Iterable[int]) -> list[int]:
            return sorted(shard_of(n) for n in nodes)

        survivors = c.survivors or frozenset()
        return SecAggSummary(
            stage="unmasked" if unmasked else held.stage, threshold=c.params.threshold,
            num_shares=c.params.num_shares, participants=shards(c.roster), shared=shards(c.shares),
            survivors=shards(survivors), signers=shards(c.checks), revealed=shards(c.reveals),
            dropped=shards(set(c.shares) - survivors) if c.survivors is not None else [])

    def drop_job(self, job_id: str) -> None:
        """Forget every key agreement of a job."""
        for key in [k for k in self._rounds if k[0] == job_id]:
            del self._rounds[key]

    def drop(self, key: RoundKey) -> None:
        """Forget a round's key agreement (it closed)."""
        self._rounds.pop(key, None)

    async def on_keys(self, state: RoundState, event: SecAggKeys, user_id: str | None) -> None:
        """Stage 1: a shard's keys; the roster goes out once every shard still in the round has advertised."""
        held = await self._judged(state, event, user_id)
        if held is None:
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
        held = await self._judged(state, event, user_id)
        if held is None or held.stage != "shares":
            return
        try:
            held.collector.take_shares(node(event.shard), [share(s) for s in event.shares])
        except SecAggError as e:
            log.warning("job %s round %d shard %d: shares refused: %s", *state.key[:2], event.shard, e)
            return
        await self._keep(state.key, event.shard, "shares", event.model_dump_json())
        await self.advance(state)

    async def on_check(self, state: RoundState, event: SecAggCheck, user_id: str | None) -> None:
        """Stage 4: a survivor's signature over the survivor set; the unmask requests go out once every survivor
        has signed."""
        held = await self._judged(state, event, user_id)
        if held is None or held.stage != "check":
            return
        try:
            held.collector.take_check(node(event.shard), _hex(event.signature))
        except SecAggError as e:
            log.warning("job %s round %d shard %d: signature refused: %s", *state.key[:2], event.shard, e)
            return
        await self._keep(state.key, event.shard, "check", event.model_dump_json())
        await self.advance(state)

    async def on_reveal(self, state: RoundState, event: SecAggReveal, user_id: str | None) -> bool:
        """Stage 5: a survivor's shares; whether the round can be unmasked now."""
        held = await self._judged(state, event, user_id)
        if held is None or held.stage != "unmask":
            return False
        try:
            held.collector.take_reveal(reveal(event))
        except SecAggError as e:
            log.warning("job %s round %d shard %d: shares refused: %s", *state.key[:2], event.shard, e)
            return False
        await self._keep(state.key, event.shard, "reveal", event.model_dump_json())
        held = await self.sync(state.round)
        return held is not None and held.stage == "unmask" and held.collector.ready()

    async def advance(self, state: RoundState) -> None:
        """Move the key agreement on where every shard still in the round has done its part (a shard failed or
        refused, by any replica, is no longer waited for), and where every survivor has signed."""
        held = await self.sync(state.round)
        if held is None or held.stage not in ("keys", "shares", "check"):
            return
        out = await self._store.refused_shards(*state.key)
        waited = {node(shard) for shard in state.round.shards - out}
        collector = held.collector
        try:
            if held.stage == "keys" and waited <= set(collector.roster):
                collector.roster_list()  # refuses a roster some node's threshold cannot hold
                await self._move(state.round, held, "shares", collector.roster)
            elif held.stage == "shares" and waited & set(collector.roster) <= set(collector.shares):
                collector.close_shares()
                await self._move(state.round, held, "masked", collector.shares)
            elif held.stage == "check" and collector.checked():
                await self._move(state.round, held, "unmask", collector.checks)
        except SecAggError as e:
            await self._abort(state.round, held, str(e))

    async def holds_back(self, state: RoundState) -> bool:
        """Whether closing the round (`state` holding every accepted contribution) must wait: with the masked
        vectors in, the survivor set goes out to be signed; once every survivor signed, or at the check's wait
        with at least the threshold signed, the unmask requests go out; the round closes when the shares are
        in, or when the unmask stage's wait is over (failing if they cannot unmask it)."""
        held = await self.sync(state.round)
        if held is None or not isinstance(state.strategy, MaskedSum):
            return False
        collector = held.collector
        if held.stage == "masked" and state.strategy.contributed:
            try:
                collector.fix_survivors(state.strategy.contributed)  # refuses a set some threshold cannot hold
            except SecAggError as e:
                await self._abort(state.round, held, str(e))
                return False
            await self._move(state.round, held, "check", state.strategy.contributed)
            return True
        if held.stage == "check":
            if time.time() < held.deadline:
                return True
            try:
                collector.fix_signers(collector.checks)  # refuses fewer signers than the threshold
            except SecAggError as e:
                await self._abort(state.round, held, str(e))
                return False
            await self._move(state.round, held, "unmask", collector.checks)
            return True
        return held.stage == "unmask" and not collector.ready() and time.time() < held.deadline

    async def _judged(self, state: RoundState, event: Message, user_id: str | None) -> SecureRound | None:
        held = await self.sync(state.round)
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
    def _wait(round_: Round) -> float:
        settings = round_.secure
        return settings.settings.timeout if settings is not None and settings.settings.timeout else STAGE_WAIT

    async def _keep(self, key: RoundKey, shard: int, kind: str, body: str) -> None:
        await self._store.keep_secagg(key, shard, kind, body)

    async def _move(self, round_: Round, held: SecureRound, stage: str, nodes: Iterable[int] = (),
                    reason: str = "") -> None:
        """Go to `stage`, fixing `nodes` as its set: stored first; only the replica whose insert stored it sends
        its messages (and, for check and unmask, the delayed round.timeout that ends their wait). One that lost
        the race takes in the stored set instead of its own."""
        body = json.dumps({"shards": sorted(shard_of(n) for n in nodes), "reason": reason})
        stored = await self._store.keep_secagg(round_.key, -1, f"stage.{stage}", body)
        await self.sync(round_)
        if not stored:
            log.info("job %s round %d: the %s stage was stored by another aggregator replica", *round_.key[:2],
                     stage)
            return
        await self._resend(round_.key, held)
        if stage in ("check", "unmask"):
            job_id, round_index, attempt = round_.key
            await publish_event(self._bus, RoundTimeout(job_id=job_id, round=round_index, attempt=attempt),
                                delay=self._wait(round_))

    async def _resend(self, key: RoundKey, held: SecureRound) -> None:
        """The messages of the stage the round is at, to each worker concerned."""
        job_id, round_index, attempt = key
        collector = held.collector

        def stage(n: int, name: Literal["roster", "forward", "check", "unmask", "abort"],
                  **fields: Any) -> SecAggStage:
            return SecAggStage(job_id=job_id, round=round_index, attempt=attempt, shard=shard_of(n), stage=name,
                               **fields)

        messages: dict[int, SecAggStage] = {}
        if held.stage == "shares":
            roster = [keys_of(ad) for ad in collector.roster_list()]
            messages = {n: stage(n, "roster", roster=roster) for n in collector.roster}
        elif held.stage == "masked":
            messages = {n: stage(n, "forward", shares=shares_of(collector.forwarded(n))) for n in collector.roster}
        elif held.stage == "check" and collector.survivors is not None:
            survivors = sorted(shard_of(n) for n in collector.survivors)
            messages = {n: stage(n, "check", survivors=survivors) for n in collector.survivors}
        elif held.stage == "unmask":
            signatures = {shard_of(n): sig.hex() for n, sig in collector.checks.items()}
            requests = {n: collector.unmask_request(n) for n in sorted(collector.checks)}
            messages = {n: stage(n, "unmask", survivors=[shard_of(x) for x in r.survivors],
                                 dropped=[shard_of(x) for x in r.dropped], signatures=signatures)
                        for n, r in requests.items()}
        elif held.stage == "aborted":
            messages = {n: stage(n, "abort", reason=held.reason) for n in held.workers}
        for n, message in sorted(messages.items()):
            if n in held.workers:
                await publish_event(self._bus, message, routing_key=secagg_key(held.workers[n]))

    async def _abort(self, round_: Round, held: SecureRound, reason: str) -> None:
        log.warning("job %s round %d: secure aggregation cannot go on: %s", *round_.key[:2], reason)
        await self._move(round_, held, "aborted", reason=reason)


def _hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SecAggError("a signature is not hex") from None


def _fixed(body: str) -> dict[str, Any]:
    """A stage row's fixed set and reason (a row stored before stages carried sets holds the reason alone)."""
    try:
        fixed = json.loads(body)
    except ValueError:
        return {"reason": body}
    return fixed if isinstance(fixed, dict) else {"reason": body}
