"""Worker: consumes assignments, trains in a child process, uploads weights, reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import time
import zipfile
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from opentelemetry.trace import SpanKind

from apiary import telemetry, transfer
from apiary.assignments import (
    POOL,
    PREFERRED,
    PREFERRED_PREFETCH,
    PREFERRED_QUEUE_EXPIRES,
    pinned_queue,
    preferred_queue,
)
from apiary.bus import Bus, Decline, Delivery, Subscription, Unroutable, publish_event, subscribe
from apiary.contracts import (
    Assignment,
    JobFailed,
    ObjectRef,
    WorkerDone,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    WorkerProgress,
)
from apiary.dataset import extract_shard
from apiary.jobspec import parse_entrypoint
from apiary.settings import Settings
from apiary.usercode import TrainCall, UserCodeError, UserCodeRunner
from services.worker.gpu import choose_gpu, gpu_stats

log = logging.getLogger("apiary.worker")

# A worker's control queue (jobs that ended) is its own: the broker drops it once the worker has been
# gone this long, rather than keep filling it for a worker that may never come back.
CONTROL_QUEUE_EXPIRES = 3600.0
ENDED_JOBS_KEPT = 4096  # job ids remembered as ended, to skip their assignments still queued
# An assignment issued less than this before the worker started listening for job ends (clocks of
# different machines may differ) may belong to a job that ended unheard: its end marker is read first.
CLOCK_SKEW = 300.0
# The aggregator stores a job's end marker when it hears the job end, normally within milliseconds; a
# marker still missing this long after the worker started listening means the job had not ended then,
# so the job's later assignments are not probed.
MARKER_SETTLE = 30.0


class Worker:
    """One training slot: takes assignments pinned to its id, those it is preferred for (it trained
    the shard last round) and pool ones, one at a time."""

    def __init__(self, bus: Bus, settings: Settings | None = None, *, worker_id: str | None = None,
                 cache_dir: Path | None = None, runner: UserCodeRunner | None = None) -> None:
        self.bus = bus
        self.settings = settings or Settings()
        self.worker_id = worker_id or self.settings.worker_id
        self.cache = Path(cache_dir or self.settings.home / "workers" / self.worker_id).resolve()
        self.gpu = choose_gpu(self.settings.gpu)  # GpuChoiceError: one line for whoever started the worker
        self.runner = runner or UserCodeRunner(self.settings.code_path, name=f"apiary-{self.worker_id}",
                                               environment=self.gpu.child_environment() if self.gpu else None)
        self._subscriptions: list[Subscription] = []  # assignments: pinned, preferred, pool
        self._pool: Subscription | None = None
        self._dedicated = 0  # pinned or preferred shards training or waiting to, here
        self._control: Subscription | None = None
        self._busy = asyncio.Lock()
        self._ended: OrderedDict[str, str] = OrderedDict()  # job id -> why it ended
        self._alive: OrderedDict[str, None] = OrderedDict()  # jobs known not to have ended unheard
        self._listening_since = float("inf")  # when job ends started to reach this worker
        self._training: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self.state = "idle"
        self.current: Assignment | None = None
        self.samples_per_s: float | None = None
        self.completed = 0

    @property
    def own_queue(self) -> str:
        """The queue for shards pinned to this worker."""
        return pinned_queue(self.worker_id)

    @property
    def control_queue(self) -> str:
        """This worker's copy of the events that end jobs (it stops training a job that ended)."""
        return f"control.worker.{self.worker_id}"

    async def start(self) -> None:
        """Announce the worker and start taking assignments."""
        self.cache.mkdir(parents=True, exist_ok=True)
        await self.runner.start()
        try:
            await publish_event(self.bus, WorkerOnline(worker_id=self.worker_id, hostname=socket.gethostname(),
                                                       gpu=gpu_stats(self.gpu, self.runner.pid)))
        except Unroutable:
            log.warning("worker %s: no service listens for worker.online yet; heartbeats will announce it",
                        self.worker_id)
        prefetch = self.settings.worker_prefetch
        self._control = await subscribe(self.bus, self.control_queue, {"job.failed": self.on_job_ended},
                                        prefetch=1, expires=CONTROL_QUEUE_EXPIRES)
        self._listening_since = time.time()
        self._subscriptions.append(
            await subscribe(self.bus, self.own_queue, {self.own_queue: self.on_assignment}, prefetch=prefetch)
        )
        preferred = preferred_queue(self.worker_id)
        self._subscriptions.append(
            await subscribe(self.bus, preferred, {preferred: self.on_preferred}, prefetch=PREFERRED_PREFETCH,
                            expires=PREFERRED_QUEUE_EXPIRES, reroute=PREFERRED)
        )
        self._pool = await subscribe(self.bus, POOL, {POOL: self.on_assignment}, prefetch=prefetch)
        self._subscriptions.append(self._pool)
        self._heartbeat = asyncio.create_task(self._beat(), name=f"heartbeat:{self.worker_id}")
        log.info("worker %s online", self.worker_id)

    async def stop(self, reason: str = "stopped") -> None:
        """Stop taking work; an assignment in progress goes back to its queue."""
        self._pool = None
        for sub in self._subscriptions:
            await sub.cancel()
        self._subscriptions.clear()
        if self._control is not None:
            await self._control.cancel()
            self._control = None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        with contextlib.suppress(Exception):
            await publish_event(self.bus, WorkerOffline(worker_id=self.worker_id, reason=reason))
        await self.runner.stop()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            with contextlib.suppress(Exception):
                await publish_event(self.bus, self._heartbeat_event())

    def _heartbeat_event(self) -> WorkerHeartbeat:
        a = self.current
        return WorkerHeartbeat(
            worker_id=self.worker_id, state=self.state, job_id=a.job_id if a else None,
            round=a.round if a else None, shard=a.shard if a else None,
            gpu=gpu_stats(self.gpu, self.runner.pid), samples_per_s=self.samples_per_s,
        )

    def _end_probe(self, a: Assignment) -> asyncio.Task[bool] | None:
        """Whether the assignment's job ended before this worker listened for job ends, read from the
        job's end marker (in the background, beside the downloads), for assignments issued about
        then or earlier; None where no reading is needed (most: nothing to pay)."""
        if (a.ended_url is None or a.issued_at is None or a.job_id in self._alive
                or a.issued_at > self._listening_since + CLOCK_SKEW):
            return None
        return asyncio.create_task(self._ended_unheard(a.job_id, a.ended_url), name=f"ended?:{a.job_id}")

    async def _ended_unheard(self, job_id: str, url: str) -> bool:
        asked = time.time()
        marker = await transfer.probe(url)
        if marker is None:
            if asked > self._listening_since + MARKER_SETTLE:
                _remember(self._alive, job_id, None)
            return False
        try:
            reason = str(json.loads(marker).get("reason") or "ended")
        except (ValueError, AttributeError):
            reason = "ended"
        _remember(self._ended, job_id, reason)
        return True

    async def on_job_ended(self, event: JobFailed, delivery: Delivery) -> None:
        """A job was cancelled or failed: stop training its shard now, and skip its queued assignments."""
        _remember(self._ended, event.job_id, event.reason)
        a, training = self.current, self._training
        if a is not None and a.job_id == event.job_id and training is not None and not training.done():
            log.info("worker %s: job %s ended (%s); stopping its round %d shard %d", self.worker_id, a.job_id,
                     event.reason, a.round, a.shard)
            training.cancel()

    async def on_preferred(self, assignment: Assignment, delivery: Delivery) -> None:
        """A shard this worker trained last round (its data is cached here): train it, unless busy;
        then it goes to the pool at once, for any worker."""
        if self._busy.locked():
            await publish_event(self.bus, assignment, routing_key=POOL)
            log.info("worker %s: busy, round %d shard %d of job %s passed to the pool", self.worker_id,
                     assignment.round, assignment.shard, assignment.job_id)
            return
        async with self._dedicated_turn():
            await self._handle(assignment, delivery)

    async def on_assignment(self, assignment: Assignment, delivery: Delivery) -> None:
        """Train one shard for one round and report the outcome; user errors never crash the worker."""
        if delivery.routing_key != POOL:
            async with self._dedicated_turn():  # pinned: only this worker may train it
                await self._handle(assignment, delivery)
            return
        if self._dedicated and self._pool is not None:
            # The pool's free slot took this while a pinned or preferred shard trains here (or waits to):
            # rather than hold it until then, while another worker may be idle, stop taking from the
            # pool and give it back.
            await self._pool.pause()
            raise Decline(f"worker {self.worker_id} is training a shard meant for it")
        async with self._busy:
            await self._handle(assignment, delivery)

    @contextlib.asynccontextmanager
    async def _dedicated_turn(self) -> AsyncIterator[None]:
        """The training slot, for a pinned or preferred shard: until it is done, pool assignments
        reaching this worker are declined; then the pool is read again."""
        self._dedicated += 1
        try:
            async with self._busy:
                yield
        finally:
            self._dedicated -= 1
            if not self._dedicated and self._pool is not None:
                await self._pool.resume()  # if a pool assignment paused it meanwhile

    async def _handle(self, assignment: Assignment, delivery: Delivery) -> None:
        """on_assignment's work, with `_busy` held."""
        if assignment.deadline < time.time():
            log.info("worker %s: skipping stale assignment %s round %d shard %d", self.worker_id,
                     assignment.job_id, assignment.round, assignment.shard)
            return
        if assignment.job_id in self._ended:
            self._skip_ended(assignment)
            return
        self.current, self.state = assignment, "training"
        attributes = {**telemetry.messaging(delivery.routing_key, "process", self.settings.exchange),
                      **self._attributes(assignment)}
        try:
            with telemetry.tracer().start_as_current_span(
                f"{delivery.routing_key} process", kind=SpanKind.CONSUMER, attributes=attributes
            ) as span:
                # Its own task, so that the job ending can stop it (its training child is killed).
                self._training = asyncio.create_task(self._train(assignment), name=f"train:{self.worker_id}")
                try:
                    await self._training
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # the worker is stopping: the assignment goes back to its queue
                    span.add_event("job.ended", {"apiary.reason": self._ended.get(assignment.job_id, "")})
                    # The job is over: nothing to report, and the assignment is done with (acked).
        finally:
            self._training = None
            self.current, self.state = None, "idle"

    def _skip_ended(self, a: Assignment) -> None:
        log.info("worker %s: skipping round %d shard %d of job %s, which ended (%s)", self.worker_id,
                 a.round, a.shard, a.job_id, self._ended[a.job_id])

    def _attributes(self, a: Assignment) -> dict[str, Any]:
        return {"apiary.job_id": a.job_id, "apiary.round": a.round, "apiary.attempt": a.attempt,
                "apiary.shard": a.shard, "apiary.worker_id": self.worker_id}

    async def _train(self, a: Assignment) -> None:
        """Download, train, upload, report; skipped if the job's end marker says it ended unheard (read
        beside the weights' download, or before it where the shard would be downloaded too)."""
        started = time.monotonic()
        ended = self._end_probe(a)
        job_dir = self.cache / "jobs" / a.job_id
        # One working folder per job, reused round after round (this worker trains one shard at a
        # time): its files are replaced whole, and the user's output folder starts empty every call.
        work = job_dir / "work"
        out_dir = work / "out"
        if out_dir.is_dir() and any(out_dir.iterdir()):
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tracer = telemetry.tracer()
        with tracer.start_as_current_span("download", attributes=self._attributes(a)) as span:
            weights = work / "global.safetensors"

            def fetch() -> asyncio.Future[None]:
                return asyncio.ensure_future(transfer.download(a.weights_url, weights, a.weights_sha256))

            fetch_weights: asyncio.Future[None] | None = None
            try:
                if ended is None or self._shard_cached(a, job_dir):
                    fetch_weights = fetch()  # beside the marker's reading; else after it, with the shard
                if ended is not None and await ended:
                    span.add_event("job.ended")
                    self._skip_ended(a)
                    return
                fetch_weights = fetch_weights or fetch()
                data_root, moved = await self._shard(a, job_dir)
                await fetch_weights
                span.set_attribute("apiary.bytes", moved + weights.stat().st_size)
            except (transfer.TransferError, zipfile.BadZipFile, OSError, ValueError) as e:
                telemetry.fail(span, "download.failed", str(e))
                await self._failed(a, f"inputs could not be fetched: {e}")
                return
            finally:
                if fetch_weights is not None:
                    # Never left running: a later assignment downloads to the same file.
                    await asyncio.gather(fetch_weights, return_exceptions=True)
                if ended is not None and not ended.done():
                    ended.cancel()
        progress = _ProgressStream(self, a)
        module, function = parse_entrypoint(a.entrypoint)
        call = TrainCall(
            module=module, function=function,
            weights_path=str(weights), result_path=str(work / "result.safetensors"),
            out_dir=str(out_dir), env=a.env,
            dataset={"data_root": str(data_root), "shard_index": a.shard, "num_samples": a.shard_num_samples,
                     "num_shards": a.num_shards},
            round={"index": a.round, "total": a.num_rounds, "attempt": a.attempt},
            job={"id": a.job_id, "name": a.job_name},
        )
        with tracer.start_as_current_span("train", attributes={**self._attributes(a),
                                                               "apiary.entrypoint": a.entrypoint}) as span:
            try:
                result = await self.runner.train(call, timeout=max(1.0, a.deadline - time.time()),
                                                 on_metrics=progress.add)
            except UserCodeError as e:
                telemetry.fail(span, "user_code.error", str(e))
                await progress.close()
                await self._failed(a, str(e))
                return
            span.set_attribute("apiary.samples", result.samples if isinstance(result.samples, int) else -1)
        await progress.close()
        if isinstance(result.samples, bool) or not isinstance(result.samples, int) or result.samples <= 0:
            await self._failed(a, f"fl_train_model returned samples={result.samples!r}: expected a positive int")
            return
        result_path = Path(call.result_path)
        with tracer.start_as_current_span("upload", attributes=self._attributes(a)) as span:
            try:
                await transfer.upload(a.upload_url, result_path)
                moved = result.size + await self._upload_files(a, Path(call.out_dir), work)
                span.set_attribute("apiary.bytes", moved)
            except (transfer.TransferError, OSError) as e:
                telemetry.fail(span, "upload.failed", str(e))
                await self._failed(a, f"result upload failed: {e}")
                return
        duration = time.monotonic() - started
        self.samples_per_s = result.samples * max(1, int(a.env.get("EPOCHS") or 1)) / max(duration, 1e-6)
        ref = ObjectRef(key=a.result_key, size=result.size, sha256=result.sha256)
        await publish_event(self.bus, WorkerDone(
            job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self.worker_id, shard=a.shard,
            result=ref, samples=result.samples, metrics=result.metrics, duration_s=duration,
        ))
        self.completed += 1
        log.info("worker %s: job %s round %d shard %d done in %.2fs (%d samples)", self.worker_id,
                 a.job_id, a.round, a.shard, duration, result.samples)

    @staticmethod
    def _shard_root(a: Assignment, job_dir: Path) -> Path:
        return job_dir / f"shard-{a.shard:04d}-{a.shard_sha256[:16]}"

    def _shard_cached(self, a: Assignment, job_dir: Path) -> bool:
        return (self._shard_root(a, job_dir) / "manifest.json").is_file()

    async def _shard(self, a: Assignment, job_dir: Path) -> tuple[Path, int]:
        """The shard's folder, downloaded and unpacked once per job; and the bytes fetched for it."""
        root = self._shard_root(a, job_dir)
        if self._shard_cached(a, job_dir):
            return root, 0
        archive = job_dir / f"shard-{a.shard:04d}.zip"
        await transfer.download(a.shard_url, archive, a.shard_sha256)
        size = archive.stat().st_size
        await asyncio.to_thread(extract_shard, archive, root)
        archive.unlink(missing_ok=True)
        return root, size

    async def _upload_files(self, a: Assignment, out_dir: Path, work: Path) -> int:
        if a.files_upload_url is None or not out_dir.is_dir() or not any(out_dir.iterdir()):
            return 0
        archive = work / "files.zip"

        def pack() -> None:
            with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                for path in sorted(out_dir.rglob("*")):
                    if path.is_file():
                        zf.write(path, path.relative_to(out_dir).as_posix())

        await asyncio.to_thread(pack)
        await transfer.upload(a.files_upload_url, archive)
        return archive.stat().st_size

    async def _failed(self, a: Assignment, error: str) -> None:
        log.warning("worker %s: job %s round %d shard %d failed: %s", self.worker_id, a.job_id, a.round,
                    a.shard, error)
        await publish_event(self.bus, WorkerFailed(job_id=a.job_id, round=a.round, attempt=a.attempt,
                                                   worker_id=self.worker_id, shard=a.shard, error=error))


def _remember(kept: OrderedDict[str, Any], job_id: str, value: Any) -> None:
    """Remember a job (most recent last), forgetting the oldest beyond ENDED_JOBS_KEPT."""
    kept[job_id] = value
    kept.move_to_end(job_id)
    while len(kept) > ENDED_JOBS_KEPT:
        kept.popitem(last=False)


class _ProgressStream:
    """Turns the user's `logger.log_metrics` calls into throttled worker.progress events."""

    def __init__(self, worker: Worker, assignment: Assignment) -> None:
        self._worker, self._a = worker, assignment
        self._latest: dict[str, Any] | None = None
        self._last_sent = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, record: dict[str, Any]) -> None:
        self._latest = record
        now = time.monotonic()
        if now - self._last_sent >= self._worker.settings.progress_interval:
            self._send()

    def _send(self) -> None:
        if self._latest is None:
            return
        record, self._latest = self._latest, None
        self._last_sent = time.monotonic()
        a = self._a
        event = WorkerProgress(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self._worker.worker_id,
                               shard=a.shard, metrics=record["metrics"], step=record["step"],
                               samples_per_s=self._worker.samples_per_s)
        task = asyncio.get_running_loop().create_task(publish_event(self._worker.bus, event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Send the last unsent record and wait for every publish."""
        self._send()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
