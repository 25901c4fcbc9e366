#!/usr/bin/env python
"""Large models (issue 39): what one round of a big fp32 model costs in storage, memory and bytes on the wire.

For a generated model of --params parameters (fp32, llama-like tensor sizes; nothing is downloaded) and K
contributions (the model plus noise), against moto's S3 server (tests/fixtures/s3server.py) and the embedded
local store, each in the same run:

- raw read: every contribution read with boto3's `download_fileobj` and its TransferConfig (8 threads, 32 MiB
  parts) into a sink, the fastest plain client here; for the local store, plain file reads;
- fold: FedAvg's accumulator fed straight from storage (`apiary.streamed_weights`: ranged reads, 4 in flight,
  256 MiB window, no hashing where the store vouches for the bytes: moto's objects read by their ETag, the local
  store's files by the sha256 recorded when they were written), in a fresh process, timed, with its peak RSS above
  its baseline; the same fold hashing every byte (`fold_streamed_sha256`); also the whole-object path (fetch the
  object, then fold it) for comparison;
- bytes per worker per round: fp32 both ways against bf16 download + int8_blockwise delta upload, measured on the
  encoded objects;
- worker upload resume: a multipart upload (parts of --part-mib) killed with SIGKILL once half its parts are
  stored, then resumed: how many parts went again, and how long the resume took.

Prints one JSON object. Usage:
    python scripts/bench_large.py --params 63e6 --k 4
    python scripts/bench_large.py --params 1e9 --k 4   # needs ~ 4 x model of disk and 1.3 x model of memory
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "shared"), str(ROOT)]

import torch  # noqa: E402

from bench_record import add_json_argument, record  # noqa: E402

HIDDEN = 2048


def layout(params: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a llama-like model of about `params` parameters (hidden 2048; embedding of 32000 tokens)."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (32000, HIDDEN)}
    left = params - 32000 * HIDDEN
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * 5632 + 2 * HIDDEN
    layers = max(1, left // per_layer)
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"layers.{i}.attn.{name}.weight"] = (HIDDEN, HIDDEN)
        for name in ("gate", "up"):
            shapes[f"layers.{i}.mlp.{name}.weight"] = (5632, HIDDEN)
        shapes[f"layers.{i}.mlp.down.weight"] = (HIDDEN, 5632)
        shapes[f"layers.{i}.norm1.weight"] = (HIDDEN,)
        shapes[f"layers.{i}.norm2.weight"] = (HIDDEN,)
    if params < 32000 * HIDDEN + per_layer:  # a small model: shrink to size, keeping the layout's kinds
        shapes = {"embed.weight": (max(1, params // 2 // HIDDEN), HIDDEN),
                  "layers.0.mlp.up.weight": (max(1, params // 2 // HIDDEN), HIDDEN), "norm.weight": (HIDDEN,)}
    return shapes


def write_model(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, base: Path | None = None) -> None:
    """A float32 safetensors file written tensor by tensor (memory: one tensor): seeded random weights or, given
    `base`, those plus small noise (a trained contribution)."""
    from safetensors import safe_open

    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section 8-byte aligned, as safetensors writes it
    g = torch.Generator().manual_seed(seed)
    reference = safe_open(str(base), framework="pt") if base is not None else None
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            t = torch.empty(shape).uniform_(-0.05, 0.05, generator=g)
            if reference is not None:
                t = reference.get_tensor(name).add_(t, alpha=0.02)
            out.write(t.numpy().tobytes())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start the process's peak RSS (VmHWM) again from its current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _fold_child(mode: str, sources: list[tuple[str, int, str, str | None]], spec_path: str, queue: Any) -> None:
    """In a fresh process: FedAvg over the contributions (streamed, or fetched whole), timed, with peak RSS."""
    from apiary.strategies.base import Contribution, create
    from apiary.strategies.format import UpdateFormat
    from apiary.streamed_weights import RangeSource, StreamedWeights
    from apiary.transfer import _http
    from apiary.weights import DTYPES, TensorSpec, loads, read_header

    class Unvouched(RangeSource):
        """The same reads, every byte hashed: as if the store vouched for nothing."""

        def vouched(self, sha256: str) -> bool:
            return False

    with open(spec_path, "rb") as f:  # the spec from the header alone
        head = f.read(8)
        head += f.read(int.from_bytes(head, "little"))
    entries, _ = read_header(head, total=Path(spec_path).stat().st_size)
    spec = {n: TensorSpec(DTYPES[e["dtype"]], tuple(e["shape"])) for n, e in entries.items()}
    torch.set_num_threads(2)
    held = []
    if mode == "memory":  # the compute ceiling: the same fold over contributions already in memory, unhashed
        held = [loads(Path(url[len("file://"):]).read_bytes()) for url, _, _, _ in sources]
    reset_peak()
    baseline = rss()
    strategy = create("federated_averaging")
    strategy.begin(spec, UpdateFormat.FULL)
    started = time.perf_counter()
    total = 0
    for index, (url, size, digest, etag) in enumerate(sources):
        if mode == "streamed":
            weights: Any = StreamedWeights(RangeSource(url, etag), size, digest)
        elif mode == "hashed":
            weights = StreamedWeights(Unvouched(url, etag), size, digest)
        elif mode == "memory":
            weights = held[index]
        else:
            if url.startswith("file:"):
                blob = Path(url[len("file://"):]).read_bytes()
            else:
                blob = _http().get(url).content
            if hashlib.sha256(blob).hexdigest() != digest:
                raise SystemExit("sha256 mismatch")
            weights = loads(blob, copy=False)
        strategy.accept(Contribution(weights, 1 + index))
        del weights
        total += size
    strategy.finish()
    elapsed = time.perf_counter() - started
    peak = peak_rss()
    queue.put({"seconds": elapsed, "bytes": total, "gb_per_s": total / elapsed / 1e9,
               "peak_extra_bytes": peak - baseline})


def fold(mode: str, sources: list[tuple[str, int, str, str | None]], spec_path: Path) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_fold_child, args=(mode, sources, str(spec_path), queue))
    child.start()
    while True:
        try:
            result: dict[str, Any] = queue.get(timeout=5)
            break
        except Exception:  # queue.Empty: still folding, unless the child died (killed for memory, say)
            if not child.is_alive():
                return {"error": f"the fold process exited with {child.exitcode}"}
    child.join()
    return result


def raw_read_s3(client: Any, bucket: str, keys: list[str]) -> dict[str, Any]:
    from boto3.s3.transfer import TransferConfig

    class Sink:
        def __init__(self) -> None:
            self.n = 0

        def write(self, b: bytes) -> int:
            self.n += len(b)
            return len(b)

    config = TransferConfig(multipart_chunksize=32 * 2**20, max_concurrency=4)  # as many reads as the fold's
    started = time.perf_counter()
    total = 0
    for key in keys:
        sink = Sink()
        client.download_fileobj(bucket, key, sink, Config=config)
        total += sink.n
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "bytes": total, "gb_per_s": total / elapsed / 1e9}


def raw_read_local(paths: list[Path]) -> dict[str, Any]:
    started = time.perf_counter()
    total = 0
    buf = bytearray(32 * 2**20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "bytes": total, "gb_per_s": total / elapsed / 1e9}


def wire_bytes(base: Path, trained: Path) -> dict[str, Any]:
    """Bytes per worker and round, fp32 against bf16 download + int8_blockwise delta upload: each tensor encoded on
    its own (memory: two tensors), the sizes summed (each tensor's small header counted, a little over the truth)."""
    from safetensors import safe_open

    from apiary.wire_codec import encode_update, halve

    down = up = 0
    with safe_open(str(base), framework="pt") as g, safe_open(str(trained), framework="pt") as t:
        for name in g.keys():
            reference = {name: g.get_tensor(name)}
            down += len(halve(reference, "bf16"))
            up += len(encode_update({name: t.get_tensor(name)}, reference, "int8_blockwise", 256))
    fp32 = base.stat().st_size + trained.stat().st_size
    return {"fp32_bytes": fp32, "bf16_int8_bytes": down + up, "bf16_download": down, "int8_delta_upload": up,
            "ratio": (down + up) / fp32}


def _upload_child(upload_json: str, source: str, started_log: str) -> None:
    """Upload in parts, noting each part as it starts in `started_log`, and SIGKILL this process the moment half
    the parts are stored (parts in flight then are cut off mid-body, as a worker killed at 50% would be)."""
    import logging

    from apiary import transfer_parts
    from apiary.contracts import MultipartUpload

    upload = MultipartUpload.model_validate_json(upload_json)
    half = transfer_parts.part_count(Path(source).stat().st_size, upload.part_size) // 2
    fd = os.open(started_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    class Started(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            os.write(fd, f"{record.args[0]}\n".encode())  # type: ignore[index]

    logger = logging.getLogger("apiary.transfer_parts")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Started())
    stored: list[int] = []

    def sent(number: int) -> None:
        stored.append(number)
        if len(stored) >= half:
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(transfer_parts.upload(upload, Path(source), sent=sent))


def resume(storage: Any, source: Path, part_mib: int) -> dict[str, Any]:
    """A multipart upload killed (SIGKILL) once half its parts are stored, then resumed: which parts went again.
    `resent` are all the parts the resume sent; of them `resent_already_stored` (parts stored before the kill,
    which a resume must not send) and `resent_started_before_kill` (the parts in flight at the kill, cut off
    mid-body: the only bytes that go twice)."""
    from apiary import transfer_parts

    part = part_mib * 2**20
    parts = transfer_parts.part_count(source.stat().st_size, part)
    key = "bench/resume.safetensors"
    upload = asyncio.run(storage.start_multipart(key, parts, part, 3600))
    with tempfile.TemporaryDirectory() as tmp:
        started_log = Path(tmp) / "started"
        child = subprocess.run([sys.executable, __file__, "--upload-child", upload.model_dump_json(), str(source),
                                str(started_log)], check=False)
        if child.returncode != -signal.SIGKILL:
            return {"error": f"the upload child exited with {child.returncode} before it was killed"}
        started = {int(line) for line in started_log.read_text().split()}
    full = f"{storage.prefix}/{key}" if storage.prefix else key
    at_kill = {p["PartNumber"] for p in storage._client.list_parts(Bucket=storage.bucket, Key=full,
                                                                   UploadId=upload.upload_id).get("Parts", [])}
    resent: list[int] = []
    started_at = time.perf_counter()
    asyncio.run(transfer_parts.upload(upload, source, sent=resent.append))
    elapsed = time.perf_counter() - started_at
    return {"parts": parts, "part_mib": part_mib, "parallel": transfer_parts.PARALLEL, "stored_at_kill": len(at_kill),
            "in_flight_at_kill": len(started - at_kill), "resent": len(resent),
            "resent_already_stored": len(at_kill & set(resent)),
            "resent_started_before_kill": len(started & set(resent)),
            "resent_beyond_missing": len(resent) - (parts - len(at_kill)), "resume_seconds": elapsed}


def round_times(model_bytes: int, k: int, transfer: dict[str, Any], rounds: int, work: Path) -> dict[str, Any]:
    """Whole rounds of a job on the embedded stack (K workers, tests/toyjobs/big.py's model of `model_bytes`):
    each aggregated round's time, from its start to its result stored."""
    from apiary.settings import Settings
    from services.app.runtime import Embedded
    from tests.toyjobs.toy import make_dataset

    home = Path(tempfile.mkdtemp(prefix="round-", dir=work))
    # The benchmark's toy job and data are allowed here, as the tests allow them (tests/conftest.py).
    os.environ["APIARY_ALLOWED_ENTRYPOINTS"] = json.dumps(["tests.toyjobs.*"])
    os.environ["APIARY_DATA_ROOTS"] = json.dumps([str(work)])
    request = {"name": "large", "entrypoint": "tests.toyjobs.big:fl_train_model",
               "dataset": str(make_dataset(home / "data", 4 * k)), "config": {"big_mib": model_bytes / 2**20},
               "distributed": {"num_rounds": rounds, "min_workers": k, "max_workers": k, "aggregation_timeout": 3600,
                               "fault_tolerance": 0, "transfer": transfer}}

    async def run() -> dict[str, Any]:
        settings = Settings(home=home / ".apiary", heartbeat_interval=1.0, progress_interval=0.0)
        async with Embedded(settings, workers=k, code_paths=[str(ROOT)]) as stack:
            job_id = await stack.submit(request)
            view = await stack.wait(job_id, timeout=3600)
            rows = await stack.ports.db.fetch("SELECT round, started_at, ended_at FROM rounds WHERE job_id = $1"
                                              " AND status = 'aggregated' ORDER BY round", job_id)
        seconds = [r["ended_at"] - r["started_at"] for r in rows]
        if not seconds:
            return {"status": view["status"], "reason": view.get("reason")}
        return {"status": view["status"], "round_s": seconds, "median_round_s": sorted(seconds)[len(seconds) // 2]}

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=63e6)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--part-mib", type=int, default=64)
    parser.add_argument("--work", default=None, help="folder for the generated files (default: a temporary one)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep the model files a run left in --work")
    parser.add_argument("--skip-whole", action="store_true", help="skip the whole-object fold (it holds 2 x model)")
    parser.add_argument("--rounds", type=int, default=0, help="also time this many whole rounds on the embedded "
                        "stack, fp32 and bf16 + int8 delta (K workers on this machine)")
    parser.add_argument("--resume-only", action="store_true", help="only the upload killed at 50%% and resumed")
    parser.add_argument("--upload-child", nargs=3, help=argparse.SUPPRESS)
    add_json_argument(parser, "large")
    args = parser.parse_args()
    if args.upload_child:
        _upload_child(*args.upload_child)
        return
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    from apiary.storage.local import LocalStorage
    from apiary.storage.s3 import S3Storage
    from apiary.transfer import upload as upload_file

    shapes = layout(int(args.params))
    params = sum(math.prod(s) for s in shapes.values())
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-large-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "global.safetensors"
    reuse = args.reuse and base.is_file() and base.stat().st_size >= params * 4
    if not reuse:
        write_model(base, shapes, 0)
    local = LocalStorage(work / "store")
    contributions = []
    for i in range(args.k):
        # Into the local store as a worker's upload puts them there: copied, with the sha256 its training child
        # computed while writing the file recorded beside the copy.
        path, written = local.root / "c" / str(i), work / "result.safetensors"
        if not (reuse and path.is_file() and path.stat().st_size == base.stat().st_size):
            write_model(written, shapes, i + 1, base)
            digest = hashlib.file_digest(written.open("rb"), "sha256").hexdigest()
            asyncio.run(upload_file(local.presign_put(f"c/{i}", 3600), written, sha256=digest))
            written.unlink()
        contributions.append(path)
    model_bytes = base.stat().st_size
    if args.resume_only:
        from tests.fixtures import s3server

        server, endpoint = s3server.launch()
        try:
            out = {"params": params, "model_bytes": model_bytes,
                   "resume": resume(S3Storage("s3://bench-large/runs", endpoint_url=endpoint), contributions[0],
                                    args.part_mib)}
        finally:
            server.terminate()
            server.wait()
        print(json.dumps(out, indent=1))
        return
    digests = [hashlib.file_digest(p.open("rb"), "sha256").hexdigest() for p in contributions]
    out: dict[str, Any] = {"params": params, "model_bytes": model_bytes, "k": args.k,
                           "wire": wire_bytes(base, contributions[0])}
    out["wire"]["per_worker_round_1b_gb"] = {k: v / params * 1e9 / 1e9 for k, v in out["wire"].items()
                                             if k.endswith("bytes")}
    sources = [(local.presign_get(f"c/{i}", 3600), p.stat().st_size, d, None)
               for i, (p, d) in enumerate(zip(contributions, digests, strict=True))]
    out["local"] = {"raw_read": raw_read_local(contributions), "fold_streamed": fold("streamed", sources, base),
                    "fold_streamed_sha256": fold("hashed", sources, base)}
    if not args.skip_whole:
        out["local"]["fold_whole"] = fold("whole", sources, base)
        out["local"]["fold_in_memory"] = fold("memory", sources, base)
    if not args.skip_s3:
        from tests.fixtures import s3server

        server, endpoint = s3server.launch()
        try:
            s3 = S3Storage("s3://bench-large/runs", endpoint_url=endpoint)
            refs = [asyncio.run(s3.put_file(f"c/{i}", p)) for i, p in enumerate(contributions)]
            # Read by the ETag S3 gave the objects (If-Match, no hashing), as the aggregator reads multipart results.
            etags = [s3._client.head_object(Bucket=s3.bucket, Key=f"runs/{r.key}")["ETag"] for r in refs]
            sources = [(s3.presign_get(r.key, 3600), r.size, d, e)
                       for r, d, e in zip(refs, digests, etags, strict=True)]
            out["moto"] = {"raw_read": raw_read_s3(s3._client, s3.bucket, [f"runs/{r.key}" for r in refs]),
                           "fold_streamed_sha256": fold("hashed", sources, base)}
            out["moto"]["fold_streamed"] = fold("streamed", sources, base)
            if not args.skip_whole:
                out["moto"]["fold_whole"] = fold("whole", sources, base)
            out["moto"]["resume"] = resume(s3, contributions[0], args.part_mib)
        finally:
            server.terminate()
            server.wait()
    if args.rounds:
        out["rounds"] = {name: round_times(model_bytes, args.k, transfer, args.rounds, work) for name, transfer in
                         {"fp32": {}, "bf16_int8_delta": {"download": "bf16", "upload": "int8_blockwise",
                                                          "delta": True}}.items()}
    for where in ("local", "moto"):
        if where in out and "error" not in out[where]["fold_streamed"]:
            r = out[where]
            r["fold_over_raw"] = r["fold_streamed"]["gb_per_s"] / r["raw_read"]["gb_per_s"]
            r["peak_extra_over_model"] = r["fold_streamed"]["peak_extra_bytes"] / model_bytes
    print(json.dumps(out, indent=1))
    record("large", args.json, out, reference="raw reads of the same objects in the same run (boto3 download_fileobj "
           "from moto; file reads from the local store); fp32 transfers for the encoded ones")


if __name__ == "__main__":
    main()
