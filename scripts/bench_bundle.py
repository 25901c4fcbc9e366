#!/usr/bin/env python
"""What code bundles cost (issue 17), each figure beside a reference measured in the same run:

- packing a 200-file project (apiary.bundle.pack: walk, ignore rules, deterministic zip, sha256), against
  shutil.make_archive zipping the same folder;
- a worker's cache-hit path per assignment (services.worker.bundles.code_for with the bundle cached: touch,
  requirements check, cache cleaning), against the same call for a job without a bundle;
- the first assignment's cost with a cold cache (download over HTTP from a local server, sha256, unpack
  read-only), against the bare HTTP download of the same bytes (transfer.download);
- switching bundles on a warm training child (the child is restarted with the new bundle first on sys.path),
  against a call on the warm child.

Usage: python scripts/bench_bundle.py [--files 200] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apiary import bundle, transfer  # noqa: E402
from apiary.contracts import Assignment, CodeBundle  # noqa: E402
from apiary.trainers import TrainCall, UserCodeRunner  # noqa: E402
from apiary.weights import dumps  # noqa: E402
from services.worker.bundles import BundleCache, code_for  # noqa: E402

from bench_record import add_json_argument, record  # noqa: E402

TRAIN_PY = '''
import torch

def fl_train_model(payload, out_dir, logger=None):
    return {{"weights": {{"w": torch.zeros(1)}}, "samples": {samples}}}
'''


def make_project(root: Path, files: int) -> Path:
    """A project of `files` files: Python modules in a few packages (1-8 kB each), plus a requirements.txt."""
    rng = random.Random(0)
    for i in range(files - 1):
        package = root / f"pkg{i % 8}" / f"sub{i % 3}"
        package.mkdir(parents=True, exist_ok=True)
        lines = [f"def f{j}(x):\n    return x * {rng.random():.6f} + {j}\n" for j in range(rng.randint(20, 160))]
        (package / f"mod{i}.py").write_text("".join(lines))
    (root / "requirements.txt").write_text("numpy>=1\n")
    return root


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


async def atimed(fn: Callable[[], Awaitable[object]], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - started)
    return out


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


FIGURES: dict[str, dict[str, float | str]] = {}


def report(what: str, ours: list[float], reference: list[float], against: str) -> None:
    FIGURES[what] = {"ms": round(ms(ours), 3), "reference": against, "reference_ms": round(ms(reference), 3),
                     "ratio": round(ms(ours) / ms(reference), 3), "samples": len(ours)}
    print(f"{what}: {ms(ours):.2f} ms (median of {len(ours)}); {against}: {ms(reference):.2f} ms; "
          f"ratio {ms(ours) / ms(reference):.2f}")


def assignment(code: CodeBundle | None) -> Assignment:
    return Assignment(
        job_id="bench", round=1, job_name="bench", num_rounds=1, shard=0, num_shards=1, shard_num_samples=1,
        shard_url="file:///nowhere", shard_sha256="0" * 64, weights_url="file:///nowhere", weights_sha256="0" * 64,
        upload_url="file:///nowhere", result_key="r", entrypoint="m:f", env={}, deadline=time.time() + 3600,
        code=code,
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per request."""


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


async def cache_paths(tmp: Path, packed: bundle.Packed, base: str, repeat: int) -> None:
    ref = CodeBundle(key=f"code/{packed.sha256}.zip", sha256=packed.sha256, size=packed.size,
                     url=f"{base}/{packed.sha256}.zip")
    cold: list[float] = []
    plain: list[float] = []
    for i in range(repeat):  # interleaved: the machine may be shared
        cache = BundleCache(tmp / f"cold-{i}")
        cold += await atimed(lambda c=cache: code_for(c, assignment(ref)), 1)  # type: ignore[misc]
        plain += await atimed(lambda i=i: download_and_extract(ref, tmp, i), 1)  # type: ignore[misc]
    report("first assignment, cold cache (download, verify, check, unpack read-only)", cold, plain,
           "bare HTTP download + zipfile.extractall of the same zip")
    warm = BundleCache(tmp / "cold-0")
    hit = await atimed(lambda: code_for(warm, assignment(ref)), repeat * 5)
    none = await atimed(lambda: code_for(warm, assignment(None)), repeat * 5)
    report("cache hit per assignment", hit, none, "same call for a job without a bundle")


async def download_and_extract(ref: CodeBundle, tmp: Path, i: int) -> None:
    target = tmp / f"bare-{i}.zip"
    await transfer.download(ref.url, target, ref.sha256)
    with zipfile.ZipFile(target) as zf:
        zf.extractall(tmp / f"extract-{i}")


async def child_switch(tmp: Path, repeat: int) -> None:
    folders = []
    for n in (1, 2):
        packed = bundle.pack(make_versioned(tmp / f"v{n}", n))
        archive = tmp / f"v{n}.zip"
        archive.write_bytes(packed.data)
        bundle.unpack(archive, tmp / f"unpacked-{n}")
        folders.append(tmp / f"unpacked-{n}")
    weights = tmp / "w.safetensors"
    weights.write_bytes(dumps({}))
    runner = UserCodeRunner()

    def call(folder: Path) -> TrainCall:
        return TrainCall(module="benchtoy.train", function="fl_train_model", weights_path=str(weights),
                         result_path=str(tmp / "r.safetensors"), out_dir=str(tmp / "out"), env={}, dataset={},
                         round={}, job={}, code_path=str(folder))

    try:
        await runner.train(call(folders[0]))
        same = await atimed(lambda: runner.train(call(folders[0])), repeat)
        switches = []
        for i in range(max(3, repeat // 4)):
            switches += await atimed(lambda i=i: runner.train(call(folders[(i + 1) % 2])), 1)  # type: ignore[misc]
    finally:
        await runner.stop()
    report("switching bundles on a warm training child (restart with torch import)", switches, same,
           "a call on the warm child")


def make_versioned(root: Path, samples: int) -> Path:
    (root / "benchtoy").mkdir(parents=True)
    (root / "benchtoy" / "train.py").write_text(TRAIN_PY.format(samples=samples))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-child", action="store_true", help="skip the training-child switch figure")
    add_json_argument(parser, "bundle")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="apiary-bench-bundle-") as name:
        tmp = Path(name)
        project = make_project(tmp / "project", args.files)
        packed = bundle.pack(project)
        raw = sum(p.stat().st_size for p in project.rglob("*") if p.is_file())
        print(f"project: {len(packed.files)} files, {raw} bytes; bundle {packed.size} bytes, "
              f"sha256 {packed.sha256[:12]}")
        ours = timed(lambda: bundle.pack(project), args.repeat)
        reference = timed(lambda: shutil.make_archive(str(tmp / "ref"), "zip", project), args.repeat)
        report(f"packing a {args.files}-file project", ours, reference, "shutil.make_archive of the same folder")
        served = tmp / "served"
        served.mkdir()
        (served / f"{packed.sha256}.zip").write_bytes(packed.data)
        server, base = serve(served)
        try:
            asyncio.run(cache_paths(tmp, packed, base, args.repeat))
        finally:
            server.shutdown()
        if not args.no_child:
            asyncio.run(child_switch(tmp, args.repeat))
    record("bundle", args.json, {"files": args.files, "bundle_bytes": packed.size, "medians": FIGURES},
           reference="each figure's own reference (see 'reference' beside it), measured interleaved in the same run")


if __name__ == "__main__":
    main()
