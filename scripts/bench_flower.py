#!/usr/bin/env python
"""Flower's round overhead on this machine, the reference for `bench_round.py`.

The same case as bench_round: a ~100k-parameter model, K clients whose training returns the weights
it received, FedAvg over all of them, R rounds; Flower's simulation engine (Ray backend). Prints the
median time between consecutive rounds' ends (round 1, which pays start-up, left out) as JSON.

Flower is not a dependency of Apiary: run this in a separate environment that has it, e.g.
    python -m venv /tmp/flwr && /tmp/flwr/bin/pip install torch==2.13.0 'flwr[simulation]==1.42.0'
    /tmp/flwr/bin/python scripts/bench_flower.py --k 4 16 --rounds 20
`bench_round.py --flower-python /tmp/flwr/bin/python` runs it in the same session as Apiary's figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation


def model(params: int = 100_000) -> dict[str, torch.Tensor]:
    """The same shapes as tests/toyjobs/identity.py."""
    gen = torch.Generator().manual_seed(0)
    hidden = 256
    first = max(1, (params - hidden * 10) // hidden)
    return {"fc1.weight": torch.randn(hidden, first, generator=gen), "fc1.bias": torch.zeros(hidden),
            "fc2.weight": torch.randn(10, hidden, generator=gen), "fc2.bias": torch.zeros(10)}


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Return the weights received, with a sample count."""
    arrays = msg.content["arrays"]
    return Message(content=RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 4})}),
                   reply_to=msg)


def run(k: int, rounds: int) -> list[float]:
    ends: list[float] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_evaluate_nodes=0,
                          min_available_nodes=k)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model()), num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: ends.append(time.monotonic()) or None)

    # Flower's default resources per client (what a user gets out of the box).
    run_simulation(server_app=server, client_app=client, num_supernodes=k)
    # ends[0] is the evaluation before round 1; round r ends at ends[r].
    return [b - a for a, b in itertools.pairwise(ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    results = {}
    for k in args.k:
        durations = run(k, args.rounds)
        results[k] = {"median_s": round(statistics.median(durations), 4), "rounds": len(durations)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
