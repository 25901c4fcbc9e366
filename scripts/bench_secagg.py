#!/usr/bin/env python
"""Secure aggregation benchmark: a round's protocol work against the plain weighted sum, K=4 and K=16 in one run,
and the bytes each worker sends per round with and without it.

The round runs in this process, party by party, on one model of `--params` float32 values: every worker's stages
(advertise, share keys, quantise and mask, reveal) and the aggregator's (relay, ring sum, unmask, dequantise, then
FedAvg on the one unmasked contribution), one worker dropping after masking (recovered from shares). The round time
reported is its critical path, `max(worker stage time) + aggregator time`, as workers run in parallel; the plain
round's is FedAvg folding the K contributions. The bus's extra round trips (the stages a plain round does not have)
are not in it: `--services` measures whole rounds with them. Bytes are the payloads a worker
publishes or uploads: safetensors for the contribution, raw keys, ciphertexts and shares for the key agreement
(each bus message adds its envelope, about 200 bytes, not counted).

With `--services`, the same comparison as whole jobs on the embedded stack (`apiary run`'s services, memory bus,
SQLite, a folder), K workers each training one shard of the toy job with `--width` values: the round time is the
aggregator's (round.start stored to round closed, from its table), the mean over `--rounds` rounds after the first;
the bytes are what each worker published on the bus and uploaded to storage per round.

Usage: python scripts/bench_secagg.py [--params 1000000] [--k 4 16] [--services [--width 100000] [--rounds 3]]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.toyjobs, for --services

from apiary.secagg import crypto
from apiary.secagg.aggregate import contribution_of_mean
from apiary.secagg.protocol import Collector, Participant
from apiary.secagg.settings import SecureAggregation
from apiary.secagg.updates import MASKED, from_wire, to_wire, update_vector
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.weights import dumps, spec_of_tensors


def fedavg(contributions: list[Contribution], global_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    strategy = create("federated_averaging", {})
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL)
    for c in contributions:
        strategy.accept(c)
    return strategy.finish().weights


def bench(k: int, params: int) -> dict[str, float]:
    rng = np.random.default_rng(k)
    global_weights = {"w": torch.from_numpy(rng.normal(0, 1, params).astype(np.float32))}
    plain = [Contribution({"w": global_weights["w"] + torch.from_numpy(rng.normal(0, 0.01, params).astype(np.float32))},
                          samples=int(rng.integers(100, 1000))) for _ in range(k)]
    plain_bytes = len(dumps(plain[0].weights))
    fedavg(plain[:2], global_weights)  # warm: the first fold pays for torch's first calls
    started = time.perf_counter()
    expected = fedavg(plain, global_weights)
    plain_round = time.perf_counter() - started

    settings = SecureAggregation(num_shares=1, reconstruction_threshold=0.5).resolved(k)
    signing = {n: crypto.new_signing_key() for n in range(1, k + 1)}
    verify = {n: crypto.verify_key(key) for n, key in signing.items()}
    context = b"bench/1/0"
    worker_time = dict.fromkeys(signing, 0.0)
    sent = dict.fromkeys(signing, 0)
    aggregator = 0.0

    def timed_worker(n: int, call):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = call()
        worker_time[n] += time.perf_counter() - t
        return out

    base = {"w": global_weights["w"].numpy()}
    workers = {n: Participant(n, context, settings, signing[n], verify) for n in signing}
    t = time.perf_counter()
    collector = Collector(context, settings, verify, params)
    aggregator += time.perf_counter() - t
    for n, w in workers.items():
        ad = timed_worker(n, w.advertise)
        sent[n] += len(ad.c_public) + len(ad.s_public) + len(ad.signature)
        t = time.perf_counter()
        collector.take_advertisement(ad)
        aggregator += time.perf_counter() - t
    roster = collector.roster_list()
    for n, w in workers.items():
        shares = timed_worker(n, lambda w=w: w.share_keys(roster))
        sent[n] += sum(len(s.ciphertext) + 16 for s in shares)  # + source and destination ids
        t = time.perf_counter()
        collector.take_shares(n, shares)
        aggregator += time.perf_counter() - t
    collector.close_shares()
    for n, w in workers.items():
        def mask(n: int = n, w: Participant = w) -> bytes:
            vector = update_vector({"w": plain[n - 1].weights["w"].numpy()}, base)
            masked, _ = w.masked_input(collector.forwarded(n), vector, plain[n - 1].samples)
            return save_numpy({MASKED: to_wire(masked)})
        upload = timed_worker(n, mask)
        sent[n] += len(upload)
        t = time.perf_counter()
        collector.take_masked(n, from_wire(load_numpy(upload)[MASKED]))
        aggregator += time.perf_counter() - t
    survivors = collector.fix_survivors(collector.contributed)
    signers = sorted(set(survivors) - {k})  # the last worker dropped after masking
    for n in signers:
        signature = timed_worker(n, lambda n=n: workers[n].check(survivors))
        sent[n] += len(signature)
        t = time.perf_counter()
        collector.take_check(n, signature)
        aggregator += time.perf_counter() - t
    for n in signers:
        reveal = timed_worker(n, lambda n=n: workers[n].unmask(collector.unmask_request(n)))
        sent[n] += sum(len(s) + 8 for s in (*reveal.b_shares.values(), *reveal.s_shares.values()))
        t = time.perf_counter()
        collector.take_reveal(reveal)
        aggregator += time.perf_counter() - t
    t = time.perf_counter()
    mean, total, contributors = collector.finish()
    got = fedavg([contribution_of_mean(mean, global_weights, total)], global_weights)
    aggregator += time.perf_counter() - t
    error = float((got["w"].double() - expected["w"].double()).abs().max())
    bound = settings.error_bound(contributors, total) + 6e-8 * float(expected["w"].abs().max())
    assert error <= bound, (error, bound)
    secure_round = max(worker_time.values()) + aggregator
    return {"k": k, "plain_s": plain_round, "secure_s": secure_round, "worker_s": max(worker_time.values()),
            "aggregator_s": aggregator, "plain_bytes": plain_bytes, "secure_bytes": max(sent.values()),
            "error": error, "bound": bound}


async def job_round(k: int, width: int, rounds: int, secure: bool, home: Path) -> tuple[float, float]:
    """(mean round seconds after the first, bytes each worker sent per round) of a toy job on the embedded stack."""
    from apiary.settings import Settings
    from services.app.runtime import Embedded
    from tests.toyjobs.toy import make_dataset

    repo = Path(__file__).resolve().parents[1]
    dataset = make_dataset(home / "data", 4 * k)
    settings = Settings(home=home / ".apiary", heartbeat_interval=1.0, progress_interval=0.0,
                        allowed_entrypoints=["tests.toyjobs.*"], data_roots=[home])
    distributed: dict[str, object] = {"num_rounds": rounds, "min_workers": k, "max_workers": k,
                                      "aggregation_timeout": 600, "fault_tolerance": 0, "evaluate_every": 0}
    if secure:
        distributed["secure_aggregation"] = {"num_shares": 1, "reconstruction_threshold": 0.5}
    sent: dict[str, int] = {}
    async with Embedded(settings, workers=k, code_paths=[str(repo)]) as stack:
        for worker in stack.workers:  # each worker publishes on its own view of the bus
            worker.bus.publish = counting(worker.bus.publish, sent)  # type: ignore[method-assign]
        job_id = await stack.submit({"name": "bench", "entrypoint": "tests.toyjobs.toy:fl_train_model",
                                     "dataset": str(dataset), "config": {"mode": "ok", "noise": 0.01, "width": width},
                                     "distributed": distributed})
        view = await stack.wait(job_id, timeout=1800)
        if view["status"] != "completed":
            raise SystemExit(f"the bench job ended {view['status']}: {view.get('reason')}")
        spans = await stack.ports.db.fetch("SELECT round, closed_at - opened_at AS s FROM aggregations WHERE job_id ="
                                           " $1 AND status = 'aggregated' ORDER BY round", job_id)
        uploads = await stack.ports.db.fetch("SELECT SUM(size) AS b FROM contributions WHERE job_id = $1 AND status"
                                             " = 'accepted'", job_id)
    later = [float(r["s"]) for r in spans][1:] or [float(spans[0]["s"])]
    per_worker = (sum(sent.values()) + int(uploads[0]["b"])) / (k * rounds)
    return sum(later) / len(later), per_worker


def counting(publish: Callable[..., Awaitable[None]], sent: dict[str, int]) -> Callable[..., Awaitable[None]]:
    """`publish`, adding the bytes of each round's reports (worker.done and the protocol's) to `sent`."""

    async def counted(routing_key: str, body: bytes, **kwargs: object) -> None:
        if routing_key.startswith(("worker.done", "worker.failed", "worker.secagg.")):
            sent[routing_key] = sent.get(routing_key, 0) + len(body)
        await publish(routing_key, body, **kwargs)

    return counted


def services(ks: list[int], width: int, rounds: int) -> None:
    """Whole toy jobs with and without secure aggregation, K workers each."""
    import tempfile

    print(f"embedded stack, toy job with {width + 9} values, {rounds} rounds (round time: the mean after the first)")
    print("K   plain round s  secure round s  ratio   bytes/worker/round plain  secure  ratio")
    for k in ks:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            plain_s, plain_b = asyncio.run(job_round(k, width, rounds, False, Path(a)))
            secure_s, secure_b = asyncio.run(job_round(k, width, rounds, True, Path(b)))
        print(f"{k:<3} {plain_s:>13.3f}  {secure_s:>14.3f}  {secure_s / plain_s:>5.2f}x  {plain_b:>23.0f}  "
              f"{secure_b:>6.0f}  {secure_b / plain_b:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--services", action="store_true", help="whole jobs on the embedded stack")
    parser.add_argument("--width", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.services:
        services(args.k, args.width, args.rounds)
        return
    print(f"model: {args.params} float32 values; one worker drops after masking")
    print("K   plain round s  secure round s  ratio  (worker s, aggregator s)  bytes/worker plain  secure  ratio"
          "  max error / bound")
    for k in args.k:
        r = bench(k, args.params)
        print(f"{r['k']:<3} {r['plain_s']:>13.3f}  {r['secure_s']:>14.3f}  {r['secure_s'] / r['plain_s']:>5.1f}x"
              f"  ({r['worker_s']:.3f}, {r['aggregator_s']:.3f})        {r['plain_bytes']:>12}  {r['secure_bytes']:>7}"
              f"  {r['secure_bytes'] / r['plain_bytes']:.4f}  {r['error']:.2e} / {r['bound']:.2e}")


if __name__ == "__main__":
    main()
