"""Where a benchmark's figures go: docs/benchmarks/<name>.json, beside the page that shows them.

Every `scripts/bench_*.py` ends with `record(...)`: the figures it printed, the command that produced them, the
machine and its load while it ran, and the reference measured in the same run. The page `docs/benchmarks/<name>.md`
quotes the current figures; the history stays in git. `--json PATH` writes elsewhere, `--json -` nowhere (a trial
run that must not replace the page's figures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGES = REPO / "docs" / "benchmarks"


def add_json_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """`--json PATH`: where the figures are written (default: beside the benchmark's page; `-`: nowhere)."""
    parser.add_argument("--json", default=str(PAGES / f"{name}.json"), metavar="PATH",
                        help=f"where the figures go (default docs/benchmarks/{name}.json; '-' writes none)")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    """The machine the figures were measured on, and how busy it was when they were recorded."""
    import torch  # every benchmark has it loaded already

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def record(name: str, path: str, figures: dict[str, Any], *, reference: str) -> Path | None:
    """Write the figures of benchmark `name` to `path` (from `--json`); returns the path, or None for `-`."""
    if path == "-":
        return None
    target = Path(path)
    document = {
        "benchmark": name,
        "command": " ".join(["python", *[a if a and " " not in a else repr(a) for a in sys.argv]]),
        "measured_at": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "commit": _git_commit(),
        "machine": machine(),
        "reference": reference,
        "figures": figures,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"figures written to {target}")
    return target
