"""Hunt flaky tests: run test files many times, optionally with both cores kept busy, and list every test that
failed at least once, with how often and its first failure's message.

    python scripts/flake_hunt.py --full 3                       # the whole suite three times back to back, as
                                                                # scripts/test runs it (parallel part, then serial)
    python scripts/flake_hunt.py --repeat 20 --busy             # each file of integration/faults/e2e 20 times,
                                                                # stress-ng burning both cores meanwhile
    python scripts/flake_hunt.py --repeat 5 --busy tests/integration/test_aggregator_group_commit.py

Each run's JUnit XML and output land under test-artifacts/flake-hunt/<time>/, with summary.json and a table
printed at the end. The exit status is 1 if any test failed, so the hunt can gate a change. A retry plugin or a
longer sleep is not a fix for what it finds: find the cause (see issue 43).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TREES = ("tests/integration", "tests/faults", "tests/e2e")


@dataclass
class Tally:
    """What one test did over the hunt."""

    runs: int = 0
    failures: int = 0
    first_message: str = ""
    seconds: list[float] = field(default_factory=list)


def test_files(targets: list[str]) -> list[Path]:
    """The test files named, or found under the folders named, in a stable order."""
    files: list[Path] = []
    for target in targets:
        path = (REPO / target).resolve()
        if path.is_dir():
            files.extend(sorted(path.rglob("test_*.py")))
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"flake_hunt: {target} is neither a test file nor a folder")
    return files


@contextlib.contextmanager
def busy(cores: int) -> Iterator[None]:
    """Keep `cores` CPUs busy with stress-ng while the block runs (installing Debian's stress-ng if missing)."""
    if cores <= 0:
        yield
        return
    if shutil.which("stress-ng") is None:
        print("installing Debian's stress-ng", flush=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "stress-ng"], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    burner = subprocess.Popen(["stress-ng", "--cpu", str(cores), "--cpu-method", "matrixprod", "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(burner.pid, signal.SIGTERM)
        burner.wait(timeout=30)


def run_pytest(paths: list[str], junit: Path, log: Path, timeout: int, options: list[str]) -> int:
    """One pytest run of `paths`; its exit status (results are read from the JUnit file)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--timeout={timeout}", f"--junitxml={junit}", *options, *paths]
    with log.open("w") as out:
        return subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def read_junit(junit: Path, tallies: dict[str, Tally]) -> list[str]:
    """Fold one JUnit file into the tallies; the ids of the tests that failed or errored in it."""
    if not junit.exists():
        return []
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        tally = tallies.setdefault(test_id, Tally())
        if case.find("skipped") is not None:
            continue
        tally.runs += 1
        tally.seconds.append(float(case.get("time", 0.0)))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            tally.failures += 1
            failed.append(test_id)
            message = (problem.get("message") or "").strip()
            if not tally.first_message and message:
                tally.first_message = message.splitlines()[0][:300]
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"test files or folders (default: {' '.join(DEFAULT_TREES)})")
    parser.add_argument("--repeat", type=int, default=20, help="runs of each file (default 20)")
    parser.add_argument("--full", type=int, default=0, help="instead: runs of the whole suite, back to back")
    parser.add_argument("--busy", action="store_true", help="keep every core busy with stress-ng meanwhile")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="cores to burn with --busy")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one test may take before it fails")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("APIARY_TEST_WORKERS", "4")),
                        help="pytest-xdist workers of a --full run's parallel part, as scripts/test (default 4)")
    parser.add_argument("--out", type=Path, help="where the runs' files go (default: test-artifacts/flake-hunt/<time>)")
    args = parser.parse_args()

    # A hunt stopped by SIGTERM (a timeout, CI's end) still stops its CPU burner, in busy()'s finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out = args.out or REPO / "test-artifacts" / "flake-hunt" / time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    # Each step: its name, the paths and pytest's options. A full run is scripts/test's two parts: the tests that
    # share no service state in parallel, then the `serial` ones alone. A file's runs are one process each.
    plan: list[tuple[str, list[str], list[str]]]
    if args.full:
        parallel = ["-n", str(args.workers), "--dist", "loadgroup", "-m", "not serial"]
        plan = [step for i in range(args.full) for step in (
            (f"full-{i + 1}", ["tests"], parallel), (f"full-{i + 1}-serial", ["tests"], ["-m", "serial"]))]
    else:
        files = test_files(args.targets or list(DEFAULT_TREES))
        plan = [(f"{f.relative_to(REPO).as_posix().replace('/', '.')}-{i + 1}", [str(f.relative_to(REPO))], [])
                for i in range(args.repeat) for f in files]

    tallies: dict[str, Tally] = {}
    runs: list[dict[str, object]] = []
    started = time.monotonic()
    with busy(args.cores if args.busy else 0):
        for name, paths, options in plan:
            t0 = time.monotonic()
            status = run_pytest(paths, args.out / f"{name}.xml", args.out / f"{name}.log", args.timeout, options)
            failed = read_junit(args.out / f"{name}.xml", tallies)
            seconds = round(time.monotonic() - t0, 1)
            runs.append({"run": name, "status": status, "seconds": seconds, "failed": failed})
            mark = "ok" if status in (0, 5) else f"FAILED ({len(failed)}: {', '.join(failed) or 'see log'})"
            print(f"{name}: {seconds} s {mark}", flush=True)
            # 5 is "nothing selected" (a full run's serial part of a tree without one); 2-4 are an interruption,
            # an internal error or a usage error: the hunt itself is broken.
            if status not in (0, 1, 5):
                print(f"pytest exited {status}: see {args.out / (name + '.log')}", flush=True)

    flaky = {test: t for test, t in tallies.items() if t.failures}
    summary = {"busy": args.busy, "wall_s": round(time.monotonic() - started, 1), "runs": runs,
               "tests_run": sum(t.runs for t in tallies.values()), "distinct_tests": len(tallies),
               "failed": {test: {"failures": t.failures, "runs": t.runs, "first_message": t.first_message,
                                 "max_seconds": max(t.seconds, default=0.0)} for test, t in flaky.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\n{len(runs)} runs, {summary['tests_run']} test runs of {len(tallies)} tests in {summary['wall_s']} s "
          f"({'busy' if args.busy else 'quiet'} machine); results in {args.out}")
    statuses = Counter(r["status"] for r in runs)
    print("pytest exit statuses:", dict(statuses))
    if not flaky:
        print("no test failed")
        return 0
    print("tests that failed at least once (failures/runs, first message):")
    for test, t in sorted(flaky.items(), key=lambda item: -item[1].failures):
        print(f"  {t.failures}/{t.runs}  {test}\n      {t.first_message}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
