#!/usr/bin/env python
"""The CPU a message costs apiary.metrics, in-process: one handled delivery (`message_handled`: a counter and the
handling-time histogram) and one publish (`message_sent`), with metrics off and on (a Prometheus reader), and one
scrape of the resulting page. Multiply by the messages a round sends and handles (scripts/metrics_series.py prints
them) for the cost per round, a figure the machine's noise cannot blur as it does bench_round.py --metrics-pairs.

Usage: python scripts/bench_metrics.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

from apiary import metrics


def per_call(calls: int, record: object) -> float:
    """The best of 5 runs of `calls` calls, in microseconds a call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            record()  # type: ignore[operator]
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    started = time.perf_counter()

    def handled() -> None:
        metrics.message_handled("rabbitmq", "apiary.tracker", "worker.progress", "ack", started)

    def sent() -> None:
        metrics.message_sent("rabbitmq", "worker.progress")

    results = {}
    for state in ("off", "on"):
        metrics.shutdown()
        if state == "on":
            metrics.setup("apiary-bench", "prometheus")
        results[state] = {"handled_us": round(per_call(args.calls, handled), 3),
                          "sent_us": round(per_call(args.calls, sent), 3)}
    start = time.perf_counter()
    for _ in range(100):
        metrics.exposition()
    results["scrape_ms"] = round((time.perf_counter() - start) * 10, 3)
    metrics.shutdown()
    print(f"off: handled {results['off']['handled_us']} us, sent {results['off']['sent_us']} us; "
          f"on: handled {results['on']['handled_us']} us, sent {results['on']['sent_us']} us; "
          f"a scrape of this page {results['scrape_ms']} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
