#!/usr/bin/env python
"""The long fuzz run: every decoder and validator of tests/fuzz (bus messages under each routing key, job
requests, manifests, dataset zips, safetensors headers, JSONL) with fresh random inputs, many of them.

The normal test suite runs the same properties with a few dozen seeded examples each; this runs thousands
(APIARY_FUZZ_EXAMPLES) and prints, per property, how many inputs it tried and how long it took. A failure is
printed by hypothesis with the smallest input that shows it.

Usage: python scripts/fuzz.py [--examples 5000] [-k EXPRESSION]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run tests/fuzz with many fresh examples; the exit status is pytest's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5000, help="inputs per property (default 5000)")
    parser.add_argument("-k", default="", help="only the properties whose names match (pytest -k)")
    args = parser.parse_args()
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    env = {**os.environ, "APIARY_FUZZ_EXAMPLES": str(args.examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz",
               "--hypothesis-show-statistics", "-W", "ignore::UserWarning", *(["-k", args.k] if args.k else [])]
    return subprocess.call(command, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
