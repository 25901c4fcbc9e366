#!/usr/bin/env python
"""The long HTTP API fuzz run: tests/integration/test_api_fuzz.py (Schemathesis over the tracker's own
/openapi.json: every route and method, as an admin, a submitter, a viewer and with no token, inputs that fit
the schema and inputs that do not) with many more examples, on the embedded SQLite and on PostgreSQL.

The test suite sends 20 seeded examples per operation and mode as the admin (a quarter of that with each other
token); this sends --examples (and a quarter) of them, from
--seed (a new seed explores new inputs; the same seed repeats a run). Each failure is printed with a curl
command that reproduces it; the exit status is pytest's.

Usage: python scripts/fuzz_api.py [--examples 500] [--seed 44] [-k sqlite|postgres]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run the API fuzz test with many examples; the exit status is pytest's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500,
                        help="inputs per operation and generation mode as the admin, a quarter with each"
                             " other token (default 500)")
    parser.add_argument("--seed", type=int, default=44, help="hypothesis's seed (default 44)")
    parser.add_argument("-k", default="", help="only the backends whose names match (pytest -k: sqlite, postgres)")
    args = parser.parse_args()
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    env = {**os.environ, "APIARY_API_FUZZ_EXAMPLES": str(args.examples), "APIARY_API_FUZZ_SEED": str(args.seed)}
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--timeout", "0",
               "tests/integration/test_api_fuzz.py::test_no_input_makes_the_api_fail_or_answer_outside_its_document",
               *(["-k", args.k] if args.k else [])]
    return subprocess.call(command, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
