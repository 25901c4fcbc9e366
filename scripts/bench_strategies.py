#!/usr/bin/env python
"""Strategy benchmark: each strategy's aggregation time and peak extra memory, beside Flower 1.42's.

K contributions of a transformer-like model are built in memory (bench_aggregate's layout); for each
strategy the same round runs through Apiary (accept every contribution, then finish; order
statistics read them back from memory) and through Flower (its `aggregate_fit` for the server
optimisers, its `aggregate_*` functions for median, trimmed mean and Krum). Peak extra memory is
VmHWM above the RSS before the run, as a multiple of one model. Flower is a test-only dependency.

Usage: python scripts/bench_strategies.py [--params 63000000] [--k 16] [--repeat 2] [--only fedadam krum ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.server.strategy import FedAdagrad, FedAdam, FedAvgM, FedProx, FedYogi
from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg

sys.path.insert(0, str(Path(__file__).parent))
from bench_aggregate import model_layout, reset_peak, rss_bytes
from bench_record import add_json_argument, record

from apiary.strategies.base import Contribution, ContributionList, create
from apiary.strategies.format import UpdateFormat
from apiary.weights import spec_of_tensors

Results = list[tuple[list[np.ndarray], int]]
SERVER: dict[str, tuple[Any, dict[str, Any]]] = {
    "fedavgm": (FedAvgM, {"server_momentum": 0.9}), "fedprox": (FedProx, {"proximal_mu": 0.1}),
    "fedadam": (FedAdam, {}), "fedyogi": (FedYogi, {}), "fedadagrad": (FedAdagrad, {}),
}
ORDER: dict[str, tuple[dict[str, Any], Callable[[Results], Any]]] = {
    "fedmedian": ({}, aggregate_median),
    "fedtrimmedavg": ({}, lambda results: aggregate_trimmed_avg(results, 0.2)),
    "krum": ({"num_malicious_nodes": 2}, lambda results: aggregate_krum(results, 2, 0)),
    "multikrum": ({"num_malicious_nodes": 2, "num_nodes_to_keep": 8}, lambda results: aggregate_krum(results, 2, 8)),
}


def measured(run: Callable[[], object]) -> tuple[float, int]:
    """Seconds and peak extra bytes of one call (its result dropped before the next measure)."""
    gc.collect()
    before = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM") - before
    del result
    return seconds, peak


def apiary(name: str, params: dict[str, Any], global_weights: dict[str, torch.Tensor],
           contributions: list[Contribution]) -> Callable[[], object]:
    def run() -> object:
        strategy = create(name, params)
        strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL)
        for contribution in contributions:
            strategy.accept(contribution)
        return strategy.finish(global_weights, ContributionList(contributions))
    return run


def flower(name: str, global_weights: dict[str, torch.Tensor], results: Results) -> Callable[[], object]:
    if name in ORDER:
        return lambda: ORDER[name][1](results)
    flower_class, params = SERVER[name]
    initial = ndarrays_to_parameters([t.numpy() for t in global_weights.values()])
    strategy = flower_class(initial_parameters=initial, **params)
    # Flower's results arrive serialised (FitRes.parameters): the deserialising is part of its round.
    fit = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(w), n, {})) for w, n in results]
    return lambda: strategy.aggregate_fit(1, fit, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=63_000_000)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--only", nargs="*", default=[*SERVER, *ORDER])
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each, Apiary and Flower alternating; the fastest of each counts (the machine "
                             "may be shared: a busy spell lengthens a run, nothing shortens one)")
    add_json_argument(parser, "strategies")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    layout = model_layout(args.params)
    gen = torch.Generator().manual_seed(0)
    global_weights = {name: torch.randn(shape, generator=gen) for name, shape in layout.items()}
    contributions = [Contribution({n: t + 0.01 * (i + 1) for n, t in global_weights.items()}, 10 + i)
                     for i in range(args.k)]
    results = [([t.numpy() for t in c.weights.values()], c.samples) for c in contributions]
    model_bytes = sum(t.numel() * t.element_size() for t in global_weights.values())
    print(f"{sum(t.numel() for t in global_weights.values()) / 1e6:.1f}M parameters x {args.k} contributions")
    print(f"{'strategy':14s} {'apiary s':>9s} {'flower s':>9s} {'ratio':>6s} {'apiary mem':>11s} {'flower mem':>11s}")
    figures: dict[str, dict[str, float]] = {}
    for name in args.only:
        params = SERVER[name][1] if name in SERVER else ORDER[name][0]
        runs = [(measured(apiary(name, params, global_weights, contributions)),
                 measured(flower(name, global_weights, results))) for _ in range(args.repeat)]
        ours = (min(r[0][0] for r in runs), max(r[0][1] for r in runs))
        theirs = (min(r[1][0] for r in runs), max(r[1][1] for r in runs))
        print(f"{name:14s} {ours[0]:9.2f} {theirs[0]:9.2f} {ours[0] / theirs[0]:6.2f} "
              f"{ours[1] / model_bytes:10.2f}x {theirs[1] / model_bytes:10.2f}x", flush=True)
        figures[name] = {"apiary_s": round(ours[0], 3), "flower_s": round(theirs[0], 3),
                         "ratio": round(ours[0] / theirs[0], 3), "apiary_peak_models": round(ours[1] / model_bytes, 2),
                         "flower_peak_models": round(theirs[1] / model_bytes, 2)}
    record("strategies", args.json, {"params": args.params, "k": args.k, "repeat": args.repeat, "strategies": figures},
           reference="Flower 1.42's strategy (or aggregate function) on the same contributions, right after Apiary's")


if __name__ == "__main__":
    main()
