"""A worker's side of secure aggregation for one shard (apiary.secagg): it advertises its keys before training,
masks its trained update instead of uploading it, signs the survivor set it is told of, and reveals shares when
the aggregator unmasks the round (only if enough survivors signed that same set).

The aggregator's stages reach the worker on its control queue (`secagg.worker.<id>`) and wait in its
`SecAggInbox` for the run of the shard they name. The worker process never loads torch: the update is read with
safetensors' numpy API. Anything that stops the key agreement (a forged key, a stage not reached by the deadline,
an abort) fails this shard, in one line; the round goes on without it while the threshold holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import replace
from pathlib import Path

from safetensors.numpy import save_file

from apiary.backoff import while_unavailable
from apiary.bus import publish_event
from apiary.contracts import Assignment, SecAggCheck, SecAggKeys, SecAggReveal, SecAggShares, SecAggStage
from apiary.safetensors_header import WeightsError
from apiary.secagg import crypto
from apiary.secagg.messages import advertisement, node, revealed, share, shares_of, unmask_nodes
from apiary.secagg.protocol import Participant, SecAggError, UnmaskRequest
from apiary.secagg.updates import MASKED, read_tensors, to_wire, update_vector
from apiary.trainers import TrainResult
from services.worker.host import Host
from services.worker.secagg_inbox import SecAggInbox, StageKey

log = logging.getLogger("apiary.worker")

class SecureShard:
    """One shard's protocol run on this worker, from advertising its keys to revealing its shares."""

    def __init__(self, worker: Host, a: Assignment, inbox: SecAggInbox) -> None:
        if a.secure_aggregation is None or not a.secret:
            raise SecAggError("the assignment carries no secure-aggregation settings or secret")
        self.worker, self.a, self.inbox = worker, a, inbox
        self.key: StageKey = (a.job_id, a.round, a.attempt, a.shard)
        context = crypto.round_context(a.job_id, a.round, a.attempt)
        try:
            verify = {node(int(shard)): bytes.fromhex(key) for shard, key in a.secagg_verify_keys.items()}
            params = a.secure_aggregation.resolved(len(verify))
        except ValueError as e:
            raise SecAggError(f"the assignment's secure-aggregation settings are unusable: {e}") from None
        self.participant = Participant(node(a.shard), context, params,
                                       crypto.signing_key_from_secret(a.secret, context), verify)
        self._queue = inbox.open(self.key)
        self._seen: set[str] = set()

    async def advertise(self) -> None:
        """Stage 1: publish the shard's signed keys (before training: the others' keys arrive meanwhile)."""
        ad = self.participant.advertise()
        await self._publish(SecAggKeys(job_id=self.a.job_id, round=self.a.round, attempt=self.a.attempt,
                                       worker_id=self.worker.worker_id, shard=self.a.shard, c_public=ad.c_public.hex(),
                                       s_public=ad.s_public.hex(), signature=ad.signature.hex(),
                                       secret=self.a.secret or ""))

    async def mask(self, result: TrainResult, result_path: Path, weights_path: Path) -> TrainResult:
        """Stages 2 and 3: share keys, then replace the trained weights at `result_path` by the masked update;
        the masked file's claim."""
        a = self.a
        roster = await self._stage("roster")
        shares = self.participant.share_keys([advertisement(k) for k in roster.roster])
        await self._publish(SecAggShares(job_id=a.job_id, round=a.round, attempt=a.attempt,
                                         worker_id=self.worker.worker_id, shard=a.shard, shares=shares_of(shares),
                                         secret=a.secret or ""))
        forwarded = await self._stage("forward")
        async with self.inbox.masking:
            try:
                trained = await asyncio.to_thread(lambda: read_tensors(result_path.read_bytes()))
                start = await asyncio.to_thread(lambda: read_tensors(weights_path.read_bytes()))
            except (WeightsError, OSError) as e:
                raise SecAggError(f"the trained weights cannot be read for masking: {e}") from None
            vector = update_vector(trained, start)
            del trained, start
            masked, clipped = self.participant.masked_input([share(s) for s in forwarded.shares], vector,
                                                            result.samples)
            del vector
            if clipped:
                log.warning("secure aggregation: job %s round %d shard %d: %d weighted update values over "
                            "clipping_range were clipped", a.job_id, a.round, a.shard, clipped)
            await asyncio.to_thread(save_file, {MASKED: to_wire(masked)}, str(result_path))
        data = await asyncio.to_thread(result_path.read_bytes)
        return replace(result, size=len(data), sha256=hashlib.sha256(data).hexdigest())

    async def check(self) -> None:
        """Stage 4, the consistency check: sign the survivor set the aggregator names, once the round's masked
        vectors are in."""
        a = self.a
        told = await self._stage("check")
        signature = self.participant.check(node(s) for s in told.survivors)
        await self._publish(SecAggCheck(job_id=a.job_id, round=a.round, attempt=a.attempt,
                                        worker_id=self.worker.worker_id, shard=a.shard, signature=signature.hex(),
                                        secret=a.secret or ""))

    async def reveal(self) -> None:
        """Stage 5: the shares the aggregator asks for, if at least the threshold of survivors signed the set
        this worker signed."""
        a = self.a
        request = await self._stage("unmask")
        survivors, dropped = unmask_nodes(request)
        try:
            signatures = {node(int(s)): bytes.fromhex(sig) for s, sig in request.signatures.items()}
        except ValueError:
            raise SecAggError("the unmask request's signatures are not hex") from None
        b_shares, s_shares = revealed(self.participant.unmask(UnmaskRequest(survivors, dropped, signatures)))
        await self._publish(SecAggReveal(job_id=a.job_id, round=a.round, attempt=a.attempt,
                                         worker_id=self.worker.worker_id, shard=a.shard, b_shares=b_shares,
                                         s_shares=s_shares, secret=a.secret or ""))

    def close(self) -> None:
        """The run is over: later stages for it are dropped."""
        self.inbox.close(self.key)

    async def _stage(self, stage: str) -> SecAggStage:
        while True:  # a stage sent again (by an aggregator that restarted) is one this run has had
            left = self.a.deadline - time.time()
            try:
                event = await asyncio.wait_for(self._queue.get(), timeout=max(left, 0.001))
            except TimeoutError:
                raise SecAggError(f"the {stage} stage did not come by the round's deadline") from None
            if event.stage not in self._seen:
                break
        self._seen.add(event.stage)
        if event.stage == "abort":
            raise SecAggError(f"the aggregator ended the key agreement: {event.reason}")
        if event.stage != stage:
            raise SecAggError(f"expected the {stage} stage, got {event.stage}")
        return event

    async def _publish(self, event: SecAggKeys | SecAggShares | SecAggCheck | SecAggReveal) -> None:
        what = f"worker {self.worker.worker_id}: {event.routing_key} of job {event.job_id}"
        await while_unavailable(lambda: publish_event(self.worker.bus, event),
                                self.worker.settings.dependency_backoff(), what, log)
