#!/usr/bin/env python
"""Flower 1.42's simulation on bench_large.py's model (the reference for docs/benchmarks/large.md): K clients that
return the weights they receive, FedAvg, two rounds; prints the round time (round 2: round 1 pays start-up) and the
peak memory of the whole process tree (sum of PSS, sampled every 0.2 s: Ray's workers and object store included),
or the error Flower gives.

Flower's simulation needs Ray, which is not a dependency of Apiary: install it beside the project's environment,
    python -m pip install --no-deps --target /tmp/ray-pkgs ray==2.60.0 tomli tomli_w
    PYTHONPATH=/tmp/ray-pkgs python scripts/bench_large_flower.py --params 63e6 --k 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_large import layout
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Return the weights received, with a sample count."""
    return Message(content=RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 4})}),
                   reply_to=msg)


def tree_pss() -> int:
    """Sum of the PSS of this process and its descendants (bytes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=63e6)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    g = torch.Generator().manual_seed(0)
    model = {n: torch.empty(s).uniform_(-0.05, 0.05, generator=g) for n, s in layout(int(args.params)).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    baseline = tree_pss()
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], tree_pss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ends: list[float] = []
    server = ServerApp()

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=args.k, min_evaluate_nodes=0,
                          min_available_nodes=args.k)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model), num_rounds=2,
                       evaluate_fn=lambda rnd, arrays: ends.append(time.monotonic()) or None)

    out: dict[str, Any] = {"params": sum(t.numel() for t in model.values()), "model_bytes": model_bytes,
                           "k": args.k}
    started = time.monotonic()
    try:
        run_simulation(server_app=server, client_app=client, num_supernodes=args.k)
    except BaseException as e:  # what Flower gives is the result here
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    stop.set()
    sampler.join()
    out["wall_s"] = time.monotonic() - started
    if len(ends) >= 3:
        out["round_s"] = ends[2] - ends[1]
        out["first_round_s"] = ends[1] - ends[0]
    else:
        out.setdefault("error", f"only {max(0, len(ends) - 1)} rounds ended")
    out["peak_pss_bytes"] = peak[0]
    out["peak_pss_over_model"] = peak[0] / model_bytes
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
