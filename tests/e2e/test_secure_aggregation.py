"""Secure aggregation through a whole job on the embedded stack: the final weights are the plain weighted mean
within the quantisation bound, every stored contribution is a masked vector that does not correlate with its
worker's plain update, a worker that goes silent after masking is recovered from the others' shares, and an
aggregator that tells workers different survivor sets gets no share revealed (the consistency check)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from apiary import keys
from apiary.bus import publish_event
from apiary.contracts import Assignment, SecAggStage, secagg_key
from apiary.jobspec import JobSpec
from apiary.secagg.messages import node
from apiary.secagg.protocol import Collector
from apiary.secagg.settings import SecureAggregation
from apiary.secagg.updates import MASKED
from apiary.strategies.private import seeded
from apiary.weights import loads
from services.aggregator.round_state import RoundKey
from services.aggregator.secure_rounds import SecureRound, SecureRounds
from services.app.runtime import Embedded
from services.scheduler.round_plan import worker_noise
from services.worker import Worker, transfers
from services.worker.secure_rounds import SecureShard
from tests.fixtures.embedded import StackFactory, start_and_final, toy_request
from tests.toyjobs.toy import Gates, noise_update

WIDTH = 4000
SECAGG = {"num_shares": 1, "reconstruction_threshold": 2}


def request(dataset: Path, **distributed: object) -> dict:
    body = toy_request(dataset, secure_aggregation=SECAGG, **distributed)
    body["config"] = {"mode": "ok", "noise": 0.05, "width": WIDTH}
    return body


async def outcomes(stack: Embedded, job_id: str) -> list[Any]:
    """Each shard's contribution row of the job: shard, status and reason."""
    return await stack.ports.db.fetch(
        "SELECT shard, status, reason FROM contributions WHERE job_id = $1 ORDER BY shard", job_id)


def plain_update(round_index: int, shard: int, previous: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: (shard + 1 + noise_update(round_index, shard, name, tuple(t.shape), 0.05)).numpy().astype(np.float64)
            for name, t in previous.items() if t.is_floating_point()}


async def test_a_secure_job_gives_the_weighted_mean_and_stores_only_masked_vectors(embedded: StackFactory,
                                                                                  toy_dataset: Path) -> None:
    async with embedded(workers=3) as stack:
        # Every round's contributions kept (distributed.transfer), so the test can read each one back.
        job_id = await stack.submit(request(toy_dataset, num_rounds=2, transfer={"keep_contributions": True}))
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT round, shard, samples, result_key FROM contributions WHERE job_id = $1 AND status = 'accepted'"
            " ORDER BY round, shard", job_id)
        stored = {(r["round"], r["shard"]): loads(await stack.ports.storage.get_bytes(r["result_key"])) for r in rows}
        samples = {r["shard"]: r["samples"] for r in rows}
        first = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 1)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    assert len(stored) == 6 and samples == {0: 5, 1: 4, 2: 4}
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    for name in ("layer.weight", "layer.bias", "wide.weight"):
        expected = first[name].double() + sum(
            samples[s] * torch.from_numpy(plain_update(2, s, first)[name]) for s in range(3)) / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + 1e-6
    assert int(final["steps"]) == 2  # integer tensors are averaged too (each worker added 1)
    for (round_index, shard), tensors in stored.items():
        assert set(tensors) == {MASKED}
        masked = tensors[MASKED].numpy().view(np.uint32).astype(np.float64)
        update = np.concatenate([v.ravel() for _, v in sorted(plain_update(round_index, shard, final).items())])
        wide = masked[-1 - WIDTH:-1]  # the vector is every tensor in name order, then the sample count
        correlation = np.corrcoef(wide, update[-WIDTH:])[0, 1]
        assert abs(correlation) < 0.1, (round_index, shard, correlation)
        assert masked.std() > 2**32 / 4  # spread over the ring (uniform: 2**32 / sqrt(12))


async def test_one_worker_trains_every_shard_of_a_secure_round_in_turn(embedded: StackFactory,
                                                                         toy_dataset: Path) -> None:
    # Three shards, one worker: each trained shard gives the slot back and waits for the round's keys beside the
    # next shard's training, so the key agreement completes with every shard from the one worker.
    async with embedded(workers=1) as stack:
        job_id = await stack.submit(request(toy_dataset, num_rounds=2, min_workers=1))
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT round, shard, worker_id FROM contributions WHERE job_id = $1 AND status = 'accepted'"
            " ORDER BY round, shard", job_id)
        first = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 1)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        leftovers = list(stack.settings.home.rglob("aside/*"))

    assert view["status"] == "completed", view.get("reason")
    assert [(r["round"], r["shard"]) for r in rows] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert len({r["worker_id"] for r in rows}) == 1
    assert view["rounds"][1]["secure_aggregation"]["participants"] == [0, 1, 2]
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    for name in ("layer.weight", "wide.weight"):
        expected = first[name].double() + sum(
            n * torch.from_numpy(plain_update(2, s, first)[name]) for s, n in ((0, 5), (1, 4), (2, 4))) / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + 1e-6
    assert leftovers == []  # each shard's set-aside folder is removed once its run ended


async def test_a_worker_stopped_while_its_trained_shard_waits_reports_it_failed_and_the_round_goes_on(
        embedded: StackFactory, toy_dataset: Path, tmp_path: Path) -> None:
    # Shard 2 trains until the test opens its gate, so shards 0 and 1, trained, wait for its shares; then shard 0's
    # worker stops. It reports shard 0 failed, and the round is made from shards 1 and 2 (threshold 2).
    gates = Gates(tmp_path, opened=0)
    async with embedded(workers=3) as stack:
        body = request(toy_dataset, num_rounds=1)
        body["config"] = {**body["config"], "mode": "gated", "fail_shards": [2], "gate": gates.path}
        job_id = await stack.submit(body)

        def waiting(shard: int) -> list[Worker]:
            return [w for w in stack.workers if any(a.shard == shard for a in w.handed_off.held())]

        deadline = time.monotonic() + 60
        while not (waiting(0) and waiting(1)):
            assert time.monotonic() < deadline, "shards 0 and 1 never waited for the round's shares"
            await asyncio.sleep(0.05)
        stopped = waiting(0)[0]
        await stopped.stop()
        gates.open_through(1)
        view = await stack.wait(job_id, timeout=120)
        rows = await outcomes(stack, job_id)
        start, final = await start_and_final(stack, job_id)

    assert view["status"] == "completed", view.get("reason")
    assert [(r["shard"], r["status"]) for r in rows] == [(0, "failed"), (1, "accepted"), (2, "accepted")]
    assert "the worker stopped before the shard was reported" in rows[0]["reason"]
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(2, 8)
    expected = start["wide.weight"].double() + sum(
        n * torch.from_numpy(plain_update(1, s, start)["wide.weight"]) for s, n in ((1, 4), (2, 4))) / 8
    assert (final["wide.weight"].double() - expected).abs().max().item() <= bound + 1e-6


async def test_a_bfloat16_model_is_masked_and_its_mean_stored_in_bfloat16(embedded: StackFactory,
                                                                          toy_dataset: Path) -> None:
    async with embedded(workers=3) as stack:
        body = toy_request(toy_dataset, secure_aggregation=SECAGG, num_rounds=1)
        body["config"] = {"mode": "ok", "dtype": "bfloat16"}
        job_id = await stack.submit(body)
        view = await stack.wait(job_id, timeout=120)
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    assert {name: t.dtype for name, t in final.items()} == {
        "layer.weight": torch.bfloat16, "layer.bias": torch.bfloat16, "steps": torch.int64}
    # Shards of 5, 4 and 4 samples add 1, 2 and 3: the mean adds 25/13 to zeros and to [0, 1], each result then
    # rounded to bfloat16 (8 significant bits).
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    for name, start in (("layer.weight", torch.zeros(2, 3)), ("layer.bias", torch.arange(2.0))):
        expected = start.double() + 25 / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + expected.abs().max().item() * 2**-8
    assert int(final["steps"]) == 1


async def test_a_worker_silent_after_masking_is_recovered_from_shares(embedded: StackFactory, toy_dataset: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    reveal = SecureShard.reveal
    silent: list[int] = []

    async def only_some(self: SecureShard) -> None:
        if self.a.shard == 0:  # shard 0's worker uploads its masked vector, then never reveals a share
            silent.append(self.a.round)
            return
        await reveal(self)

    monkeypatch.setattr(SecureShard, "reveal", only_some)
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request(toy_dataset, num_rounds=1))
        view = await stack.wait(job_id, timeout=120)
        rows = await stack.ports.db.fetch(
            "SELECT shard FROM contributions WHERE job_id = $1 AND status = 'accepted' ORDER BY shard", job_id)
        revealed = await stack.ports.db.fetch(
            "SELECT shard FROM secagg_messages WHERE job_id = $1 AND kind = 'reveal' ORDER BY shard", job_id)
        start = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    assert silent == [1]
    assert [r["shard"] for r in rows] == [0, 1, 2]  # shard 0's contribution counts...
    assert [r["shard"] for r in revealed] == [1, 2]  # ...its self mask rebuilt from shards 1 and 2's shares
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    sizes = {0: 5, 1: 4, 2: 4}
    for name in ("layer.weight", "wide.weight"):
        expected = start[name].double() + sum(
            sizes[s] * torch.from_numpy(plain_update(1, s, start)[name]) for s in range(3)) / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + 1e-6


async def test_a_worker_that_cannot_join_fails_its_shard_not_the_job(embedded: StackFactory,
                                                                     toy_dataset: Path) -> None:
    # Shard 2's training fails after its keys went out: the key agreement goes on without it (threshold 2 holds).
    async with embedded(workers=3) as stack:
        body = request(toy_dataset, num_rounds=1)
        body["config"] = {**body["config"], "mode": "raise", "fail_shards": [2]}
        job_id = await stack.submit(body)
        view = await stack.wait(job_id, timeout=120)
        rows = await outcomes(stack, job_id)
        start = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    assert [(r["shard"], r["status"]) for r in rows] == [(0, "accepted"), (1, "accepted"), (2, "failed")]
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(2, 9)
    expected = start["wide.weight"].double() + sum(
        n * torch.from_numpy(plain_update(1, s, start)["wide.weight"]) for s, n in ((0, 5), (1, 4))) / 9
    assert (final["wide.weight"].double() - expected).abs().max().item() <= bound + 1e-6


async def test_a_masked_upload_that_fails_fails_its_shard_and_reports_nothing_more(
        embedded: StackFactory, toy_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    upload = transfers.upload_outputs

    async def refuse_shard_2(a: Assignment, *args: Any) -> tuple[int, str | None]:
        if a.shard == 2:
            raise OSError("no space left on the test's device")
        return await upload(a, *args)

    monkeypatch.setattr(transfers, "upload_outputs", refuse_shard_2)
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request(toy_dataset, num_rounds=1))
        view = await stack.wait(job_id, timeout=120)
        rows = await outcomes(stack, job_id)

    assert view["status"] == "completed", view.get("reason")
    assert [(r["shard"], r["status"]) for r in rows] == [(0, "accepted"), (1, "accepted"), (2, "failed")]
    assert "result upload failed: no space left" in rows[2]["reason"]


async def test_differential_privacy_clipped_on_workers_noises_the_unmasked_mean(embedded: StackFactory,
                                                                               toy_dataset: Path) -> None:
    # Workers clip their updates to C before masking; the aggregator adds noise of std z * C / m to the mean.
    dp = {"noise_multiplier": 0.5, "clipping_norm": 400.0, "clip_on": "worker", "seed": 11}
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request(toy_dataset, num_rounds=1, differential_privacy=dp))
        view = await stack.wait(job_id, timeout=120)
        start, final = await start_and_final(stack, job_id)

    assert view["status"] == "completed", view.get("reason")
    std = 0.5 * 400.0 / 3
    expected = start["wide.weight"].double() + sum(
        n * torch.from_numpy(plain_update(1, s, start)["wide.weight"]) for s, n in ((0, 5), (1, 4), (2, 4))) / 13
    noise = final["wide.weight"].double() - expected
    assert abs(noise.std().item() / std - 1) < 0.1  # the central noise, on the unmasked mean
    assert view["metrics"].get("dp_epsilon") is not None


async def test_an_aggregator_telling_workers_different_survivor_sets_gets_no_reveal(
        embedded: StackFactory, toy_dataset: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A lying aggregator: it tells shard 0 that every shard survived (to get shares of shard 2's self mask) and
    # shards 1 and 2 that shard 2 dropped (to get shares of its mask key), and takes any signature without looking.
    resend = SecureRounds._resend

    async def lie(self: SecureRounds, key: RoundKey, held: SecureRound) -> None:
        if held.stage != "check":
            await resend(self, key, held)
            return
        for n, worker_id in held.workers.items():
            told = [0, 1, 2] if n == node(0) else [0, 1]
            await publish_event(self._bus, SecAggStage(job_id=key[0], round=key[1], attempt=key[2], shard=n - 1,
                                                       stage="check", survivors=told),
                                routing_key=secagg_key(worker_id))

    def take_any(self: Collector, n: int, signature: bytes) -> None:
        self.checks.setdefault(n, signature)

    monkeypatch.setattr(SecureRounds, "_resend", lie)
    monkeypatch.setattr(Collector, "take_check", take_any)
    caplog.set_level(logging.WARNING, logger="apiary.worker")
    async with embedded(workers=3) as stack:
        body = request(toy_dataset, num_rounds=1)
        body["distributed"]["secure_aggregation"] = {**SECAGG, "timeout": 3}  # each stage's wait, in seconds
        job_id = await stack.submit(body)
        view = await stack.wait(job_id, timeout=120)
        signed = await stack.ports.db.fetch(
            "SELECT shard FROM secagg_messages WHERE job_id = $1 AND round = 1 AND attempt = 1 AND kind = 'check'"
            " ORDER BY shard", job_id)
        revealed = await stack.ports.db.fetch(
            "SELECT shard FROM secagg_messages WHERE job_id = $1 AND kind = 'reveal'", job_id)
        failed = await stack.ports.db.fetchrow(
            "SELECT status, reason FROM aggregations WHERE job_id = $1 AND round = 1 AND attempt = 1", job_id)

    assert view["status"] == "failed"
    assert [r["shard"] for r in signed] == [0, 1]  # shard 2, told it dropped after masking, signs nothing
    assert revealed == []  # no worker revealed a share: nothing of any update can be unmasked
    assert failed["status"] == "failed" and "too few shares revealed" in failed["reason"]
    refusals = [r.getMessage() for r in caplog.records if "different survivor sets" in r.getMessage()]
    assert len(refusals) >= 2  # shards 0 and 1 each saw fewer than 2 valid signatures over the set it signed
    assert view["rounds"][0]["secure_aggregation"]["stage"] == "unmask"


async def test_noise_added_by_the_workers_before_masking_is_all_the_unmasked_mean_carries(embedded: StackFactory,
                                                                                      toy_dataset: Path) -> None:
    # noise_on worker: each worker adds N(0, (z C / sqrt(m))^2) to its clipped update before masking, so not even the
    # aggregator sees an un-noised sum, and adds none itself. Seeded (tests only): each task's noise is known here.
    dp = {"noise_multiplier": 0.003, "clipping_norm": 400.0, "clip_on": "worker", "noise_on": "worker", "seed": 11}
    body = request(toy_dataset, num_rounds=1, differential_privacy=dp)
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(body)
        view = await stack.wait(job_id, timeout=120)
        start, final = await start_and_final(stack, job_id)

    assert view["status"] == "completed", view.get("reason")
    spec = JobSpec.model_validate(body)
    sigma = 0.003 * 400.0 / 3 ** 0.5
    bound = SecureAggregation(**SECAGG).resolved(3).error_bound(3, 13)
    samples = {0: 5, 1: 4, 2: 4}
    for name in ("layer.weight", "layer.bias", "wide.weight"):
        shape = tuple(start[name].shape)
        noised = {s: torch.from_numpy(plain_update(1, s, start)[name] + seeded(
            worker_noise(spec, 1, 1, s)["noise_seed"], 0, name).normal(0.0, sigma, shape)) for s in samples}
        expected = start[name].double() + sum(samples[s] * noised[s] for s in samples) / 13
        assert (final[name].double() - expected).abs().max().item() <= bound + 1e-6, name
    mean_std = sigma * (5 ** 2 + 4 ** 2 + 4 ** 2) ** 0.5 / 13
    assert view["metrics"]["dp_noise_std"] == pytest.approx(mean_std)
    assert view["metrics"].get("dp_epsilon") is not None
