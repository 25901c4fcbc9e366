"""Worker: the consumer wiring (which queues, whose turn) and the handlers; an assignment's steps are
in `pipeline`, its files in `transfers`, its live metrics in `progress`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from opentelemetry import trace

from apiary import proof, transfer
from apiary.assignments import (
    POOL,
    PREFERRED,
    PREFERRED_PREFETCH,
    PREFERRED_QUEUE_EXPIRES,
    pinned_queue,
    preferred_queue,
)
from apiary.backoff import while_unavailable
from apiary.bus import Bus, Decline, Delivery, PassOn, Subscription, Unroutable, publish_event, subscribe
from apiary.bus.typed import Next, consumer_span
from apiary.contracts import (
    TRAIN,
    Assignment,
    JobCompleted,
    JobFailed,
    PresencePace,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerOffline,
    WorkerOnline,
    pace_key,
)
from apiary.pace import MAX_FACTOR
from apiary.settings import Settings
from apiary.trainers import USER_FUNCTION, Trainer, TrainerError, TrainerSetup, make_trainer, trainer_name
from services.worker.bundles import BundleCache
from services.worker.gpu import choose_gpu, gpu_stats
from services.worker.model_cache import ModelCache
from services.worker.pipeline import AssignmentRun

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
                 cache_dir: Path | None = None, runner: Trainer | None = None) -> None:
        self.bus = bus
        self.settings = settings or Settings()
        self.worker_id = worker_id or self.settings.worker_id
        self.cache = Path(cache_dir or self.settings.home / "workers" / self.worker_id).resolve()
        self.models = ModelCache(Path(self.settings.model_cache or self.cache / "models").resolve(),
                                 int(self.settings.model_cache_limit_gb * 1e9))
        self.bundles = BundleCache(self.cache / "code", int(self.settings.code_cache_limit_gb * 2**30))
        self.gpu = choose_gpu(self.settings.gpu)  # GpuChoiceError: one line for whoever started the worker
        self._setup = TrainerSetup(code_paths=list(self.settings.code_path), name=f"apiary-{self.worker_id}",
                                   environment=self.gpu.child_environment() if self.gpu else {})
        # The user-function trainer, started with the worker (its child's imports are paid before the
        # first assignment); others are made when a job first needs them.
        self.runner = runner or make_trainer(USER_FUNCTION, self._setup)
        self._trainers: dict[str, Trainer] = {USER_FUNCTION: self.runner}
        self._last_trainer = USER_FUNCTION  # the trainer of the latest assignment: its child holds the GPU memory
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
        self.beat_every = self.settings.heartbeat_interval  # stretched for a large fleet (apiary.pace)
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
        # Listening before announcing: the scheduler answers a worker that joins a stretched fleet with its pace.
        self._control = await subscribe(self.bus, self.control_queue, {"job.failed": self.on_job_ended,
                                                                       "job.completed": self.on_job_ended,
                                                                       PresencePace.routing_key: self.on_pace,
                                                                       pace_key(self.worker_id): self.on_pace},
                                        prefetch=1, expires=CONTROL_QUEUE_EXPIRES)
        self._listening_since = time.time()
        try:
            await publish_event(self.bus, WorkerOnline(worker_id=self.worker_id, hostname=socket.gethostname(),
                                                       gpu=gpu_stats(self.gpu, self._trainer_pid()),
                                                       kind=self.settings.worker_kind))
        except Unroutable:
            log.warning("worker %s: no service listens for worker.online yet; heartbeats will announce it",
                        self.worker_id)
        prefetch = self.settings.worker_prefetch
        # Each queue has its own turn-taking; past it, a stale or ended job's assignment is skipped, and
        # what is trained is traced as the message's processing.
        then = [self._skip_stale_or_ended, consumer_span(self.settings.exchange, self.span_attributes)]
        self._subscriptions.append(await subscribe(self.bus, self.own_queue, {self.own_queue: self.on_assignment},
                                                   prefetch=prefetch, middleware=[self._dedicated_turn, *then]))
        preferred = preferred_queue(self.worker_id)
        self._subscriptions.append(await subscribe(
            self.bus, preferred, {preferred: self.on_assignment}, prefetch=PREFERRED_PREFETCH,
            expires=PREFERRED_QUEUE_EXPIRES, reroute=PREFERRED, middleware=[self._preferred_turn, *then],
        ))
        self._pool = await subscribe(self.bus, POOL, {POOL: self.on_assignment}, prefetch=prefetch,
                                     middleware=[self._pool_turn, *then])
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
        for trainer in self._trainers.values():
            await trainer.stop()

    def _trainer_pid(self) -> int | None:
        """The training process whose GPU readings are this worker's: the one that ran the latest assignment (kept
        warm, it holds its memory after), else any that runs (the user-function child, started with the worker)."""
        latest = self._trainers[self._last_trainer].pid
        if latest is not None:
            return latest
        return next((t.pid for t in self._trainers.values() if t.pid is not None), None)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat_every)
            with contextlib.suppress(Exception):
                # Not kept on the broker's disk: the next beat replaces a beat lost in a broker restart.
                await publish_event(self.bus, self._heartbeat_event(), persistent=False)

    def _heartbeat_event(self) -> WorkerHeartbeat:
        a = self.current
        return WorkerHeartbeat(
            worker_id=self.worker_id, state=self.state, job_id=a.job_id if a else None,
            round=a.round if a else None, shard=a.shard if a else None,
            gpu=gpu_stats(self.gpu, self._trainer_pid()), samples_per_s=self.samples_per_s,
            kind=self.settings.worker_kind, token=proof.progress_token(a.secret) if a and a.secret else None,
            interval=self.beat_every,
        )

    def pace(self, interval: float) -> None:
        """Beat every `interval` seconds from the next beat on, as the scheduler asks for the fleet's size
        (apiary.pace), never faster than this worker's own setting."""
        base = self.settings.heartbeat_interval
        self.beat_every = min(max(base, interval), base * MAX_FACTOR)

    async def on_pace(self, event: PresencePace, delivery: Delivery) -> None:
        """The fleet's heartbeat pace changed (or, sent to this worker alone, is not the one it beats at)."""
        self.pace(event.interval)

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

    async def on_job_ended(self, event: JobFailed | JobCompleted, delivery: Delivery) -> None:
        """A job was cancelled, failed or completed (early stopping ends one while its next round trains): stop
        training its shard now, and skip its queued assignments."""
        _remember(self._ended, event.job_id, event.reason or "job completed")
        a, training = self.current, self._training
        if a is not None and a.job_id == event.job_id and training is not None and not training.done():
            log.info("worker %s: job %s ended (%s); stopping its round %d shard %d", self.worker_id, a.job_id,
                     event.reason, a.round, a.shard)
            training.cancel()

    async def _preferred_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """A shard this worker trained last round (its data is cached here): train it, unless busy;
        then it goes to the pool at once, for any worker (rejected: the broker moves it where the preferred
        queue reroutes, so a worker needs no permission to publish to the pool)."""
        if self._busy.locked():
            log.info("worker %s: busy, round %d shard %d of job %s passed to the pool", self.worker_id,
                     assignment.round, assignment.shard, assignment.job_id)
            raise PassOn(f"worker {self.worker_id} is busy")
        await self._dedicated_turn(assignment, delivery, call_next)

    async def _pool_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """A shard for any worker: train it when the slot is free, unless a shard meant for this worker
        trains or waits here."""
        if self._dedicated and self._pool is not None:
            # The pool's free slot took this while a pinned or preferred shard trains here (or waits to):
            # rather than hold it until then, while another worker may be idle, stop taking from the
            # pool and give it back.
            await self._pool.pause()
            raise Decline(f"worker {self.worker_id} is training a shard meant for it")
        async with self._busy:
            await call_next()

    async def _dedicated_turn(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """The training slot, for a pinned or preferred shard (only this worker may train a pinned
        one): until it is done, pool assignments reaching this worker are declined; then the pool is
        read again."""
        self._dedicated += 1
        try:
            async with self._busy:
                await call_next()
        finally:
            self._dedicated -= 1
            if not self._dedicated and self._pool is not None:
                await self._pool.resume()  # if a pool assignment paused it meanwhile

    async def _skip_stale_or_ended(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """Go on unless the assignment's deadline passed or its job is known to have ended."""
        if assignment.deadline < time.time():
            log.info("worker %s: skipping stale assignment %s round %d shard %d", self.worker_id,
                     assignment.job_id, assignment.round, assignment.shard)
            return
        if assignment.job_id in self._ended:
            self.skip_ended(assignment)
            return
        await call_next()

    async def on_assignment(self, assignment: Assignment, delivery: Delivery) -> None:
        """Train one shard for one round and report the outcome (its turn taken); user errors never
        crash the worker."""
        # An init or evaluate task names no shard: heartbeats say which task, not that a shard trains.
        self.current, self.state = assignment, "training" if assignment.task == TRAIN else assignment.task
        if assignment.heartbeat_interval is not None:
            self.pace(assignment.heartbeat_interval)
        try:
            # Its own task, so that the job ending can stop it (its training child is killed).
            self._training = asyncio.create_task(self._train(assignment), name=f"train:{self.worker_id}")
            try:
                await self._training
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the worker is stopping: the assignment goes back to its queue
                trace.get_current_span().add_event(
                    "job.ended", {"apiary.reason": self._ended.get(assignment.job_id, "")})
                # The job is over: nothing to report, and the assignment is done with (acked).
        finally:
            self._training = None
            self.current, self.state = None, "idle"

    async def _train(self, a: Assignment) -> None:
        await AssignmentRun(self, a).run(self._end_probe(a))

    def skip_ended(self, a: Assignment) -> None:
        """Log that an assignment of a job that ended is not trained."""
        log.info("worker %s: skipping round %d shard %d of job %s, which ended (%s)", self.worker_id,
                 a.round, a.shard, a.job_id, self._ended[a.job_id])

    def span_attributes(self, a: Assignment) -> dict[str, Any]:
        """What every span of an assignment says about it."""
        return {"apiary.job_id": a.job_id, "apiary.round": a.round, "apiary.attempt": a.attempt,
                "apiary.shard": a.shard, "apiary.worker_id": self.worker_id, "apiary.task": a.task}

    def trainer_for(self, a: Assignment) -> Trainer:
        """The trainer for the assignment's job (made on first use); TrainerError if there is none."""
        name = trainer_name(a.entrypoint)
        if name not in self._trainers:
            try:
                self._trainers[name] = make_trainer(name, self._setup)
            except ValueError as e:
                raise TrainerError(str(e)) from None
        self._last_trainer = name
        return self._trainers[name]

    async def failed(self, a: Assignment, error: str) -> None:
        """Report that the assignment failed, and why."""
        log.warning("worker %s: job %s round %d shard %d failed: %s", self.worker_id, a.job_id, a.round,
                    a.shard, error)
        failed = WorkerFailed(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self.worker_id,
                              shard=a.shard, error=error, secret=a.secret or "")
        # Like worker.done: a report waits for the broker rather than the shard being trained again.
        await while_unavailable(lambda: publish_event(self.bus, failed), self.settings.dependency_backoff(),
                                f"worker {self.worker_id}: failure report of round {a.round} shard {a.shard}", log)


def _remember(kept: OrderedDict[str, Any], job_id: str, value: Any) -> None:
    """Remember a job (most recent last), forgetting the oldest beyond ENDED_JOBS_KEPT."""
    kept[job_id] = value
    kept.move_to_end(job_id)
    while len(kept) > ENDED_JOBS_KEPT:
        kept.popitem(last=False)
