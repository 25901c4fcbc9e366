#!/usr/bin/env python
"""Secure aggregation benchmark: a round's protocol work against the plain weighted sum, K=4 and K=16 in one run,
and the bytes each worker sends per round with and without it.

The round runs in this process, party by party, on one model of `--params` float32 values: every worker's stages
(advertise, share keys, quantise and mask, reveal) and the aggregator's (relay, ring sum, unmask, dequantise, then
FedAvg on the one unmasked contribution), one worker dropping after masking (recovered from shares). The round time
reported is its critical path, `max(worker stage time) + aggregator time`, as workers run in parallel; the plain
round's is FedAvg folding the K contributions. The bus's extra round trips (three more stages than a plain round)
are not in it: the services do not run the stages yet (docs/security.md). Bytes are the payloads a worker
publishes or uploads: safetensors for the contribution, raw keys, ciphertexts and shares for the key agreement
(each bus message adds its envelope, about 200 bytes, not counted).

Usage: python scripts/bench_secagg.py [--params 1000000] [--k 4 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from safetensors.numpy import load as load_numpy
from safetensors.numpy import save as save_numpy

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
    for n in sorted(collector.contributed - {k}):  # the last worker dropped after masking
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
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
