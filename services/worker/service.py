"""Worker: its parts wired together and the handlers (assignments, jobs that ended). Its one assignment at a
time is `slot`, whose turn it is `turns`, its heartbeats and pace `presence`; an assignment's steps are in
`pipeline`, its files in `transfers`, its live metrics in `progress`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from opentelemetry import trace

from apiary.backoff import while_unavailable
from apiary.bus import Bus, Delivery, EventHandler, Subscription, publish_event, subscribe
from apiary.bus.typed import Next, consumer_span
from apiary.contracts import (
    TRAIN,
    Assignment,
    JobCompleted,
    JobFailed,
    JobTrainingEnded,
    PresencePace,
    WorkerFailed,
    pace_key,
    report_key,
    secagg_key,
)
from apiary.settings import Settings
from apiary.trainers import USER_FUNCTION, Trainer, TrainerError, TrainerSetup, make_trainer, trainer_name
from services.worker.bundles import BundleCache
from services.worker.gpu import choose_gpu, gpu_stats
from services.worker.host import left_aside
from services.worker.job_ends import JobEnds
from services.worker.model_cache import ModelCache
from services.worker.pipeline import AssignmentRun
from services.worker.presence import Presence
from services.worker.secagg_inbox import SecAggInbox
from services.worker.slot import HandedOff, Slot
from services.worker.turns import QueueTurns

log = logging.getLogger("apiary.worker")

# A worker's control queue (jobs that ended) is its own: the broker drops it once the worker has been
# gone this long, rather than keep filling it for a worker that may never come back.
CONTROL_QUEUE_EXPIRES = 3600.0


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
        self.slot = Slot()
        self.handed_off = HandedOff()
        self.presence = Presence(bus, self.settings, self.worker_id, self.slot,
                                 lambda: gpu_stats(self.gpu, self._trainer_pid()))
        self.turns = QueueTurns(self.worker_id, self.slot)
        self._control: Subscription | None = None
        self.ended = JobEnds()
        self.secagg = SecAggInbox()
        self.stopping = False
        # Shards (job, round, attempt, shard) this worker's killed process left aside, reported failed when it started.
        self._reported_at_start: set[tuple[str, int, int, int]] = set()

    @property
    def control_queue(self) -> str:
        """This worker's copy of the events that end jobs (it stops training a job that ended)."""
        return f"control.worker.{self.worker_id}"

    async def start(self) -> None:
        """Announce the worker and start taking assignments."""
        self.stopping = False
        self.cache.mkdir(parents=True, exist_ok=True)
        await self.runner.start()
        # Listening before announcing: the scheduler answers a worker that joins a stretched fleet with its pace.
        control: dict[str, EventHandler] = {
            "job.failed": self.on_job_ended, "job.completed": self.on_job_ended,
            JobTrainingEnded.routing_key: self.on_training_ended,
            PresencePace.routing_key: self.presence.on_pace, pace_key(self.worker_id): self.presence.on_pace,
            secagg_key(self.worker_id): self.secagg.on_stage,
        }
        self._control = await subscribe(self.bus, self.control_queue, control, prefetch=1,
                                        expires=CONTROL_QUEUE_EXPIRES)
        self.ended.listening_since = time.time()
        await self.presence.announce()
        await self._report_left_aside()
        # Each queue has its own turn-taking; past it, a stale or ended job's assignment is skipped, and
        # what is trained is traced as the message's processing.
        then = [self._skip_stale_or_ended, consumer_span(self.settings.exchange, self.span_attributes)]
        await self.turns.subscribe(self.bus, self.on_assignment, self.settings.worker_prefetch, then)
        self.presence.start()
        log.info("worker %s online", self.worker_id)

    async def _report_left_aside(self) -> None:
        """Runs set aside by this worker's previous process, killed (SIGKILL, out of memory) before it reported them:
        each one's round still waiting is told the shard failed, as a stopped worker tells it, so that the key
        agreement goes on without the shard rather than waiting for the round's timeout; then its folder goes."""
        for left in await asyncio.to_thread(left_aside, self.cache):
            a = left.assignment
            if a is not None and a.deadline > time.time():
                await self.failed(a, "secure aggregation: the worker was killed before the shard was reported "
                                     "(found when it started again)")
                self._reported_at_start.add((a.job_id, a.round, a.attempt, a.shard))
            await asyncio.to_thread(left.space.remove)

    async def stop(self, reason: str = "stopped") -> None:
        """Stop taking work; an assignment in progress goes back to its queue (one whose last steps go on without
        the slot, a secure shard trained here, is reported failed unless it was reported already, and left out of its
        round)."""
        self.stopping = True
        await self.turns.cancel()
        await self.handed_off.cancel()
        if self._control is not None:
            await self._control.cancel()
            self._control = None
        await self.presence.stop(reason)
        for trainer in self._trainers.values():
            await trainer.stop()

    def _trainer_pid(self) -> int | None:
        """The training process whose GPU readings are this worker's: the one that ran the latest assignment (kept
        warm, it holds its memory after), else any that runs (the user-function child, started with the worker)."""
        latest = self._trainers[self._last_trainer].pid
        if latest is not None:
            return latest
        return next((t.pid for t in self._trainers.values() if t.pid is not None), None)

    async def on_job_ended(self, event: JobFailed | JobCompleted, delivery: Delivery) -> None:
        """A job was cancelled, failed or completed (early stopping ends one while its next round trains): stop
        training its shard now, and skip its queued assignments."""
        self.ended.heard(event.job_id, event.reason or "job completed")
        for a in [self.slot.stop(event.job_id), *self.handed_off.stop(event.job_id)]:
            if a is not None:
                log.info("worker %s: job %s ended (%s); stopping its round %d shard %d", self.worker_id, a.job_id,
                         event.reason, a.round, a.shard)

    async def on_training_ended(self, event: JobTrainingEnded, delivery: Delivery) -> None:
        """A job in mode async stored its last version: stop the training task of it running here (its update would
        go into no version) and skip its queued ones; its evaluations still run."""
        self.ended.heard_training_ended(event.job_id)
        current = self.slot.current
        if current is not None and current.job_id == event.job_id and current.task == TRAIN:
            a = self.slot.stop(event.job_id)
            if a is not None:
                log.info("worker %s: job %s stored its last version %d; stopping its task %d (shard %d)",
                         self.worker_id, a.job_id, event.version, a.attempt, a.shard)

    async def _skip_stale_or_ended(self, assignment: Assignment, delivery: Delivery, call_next: Next) -> None:
        """Go on unless the assignment's deadline passed, its job is known to have ended, or it is a training task
        of a job whose training ended."""
        if assignment.deadline < time.time():
            log.info("worker %s: skipping stale assignment %s round %d shard %d", self.worker_id,
                     assignment.job_id, assignment.round, assignment.shard)
            return
        if assignment.job_id in self.ended:
            self.skip_ended(assignment)
            return
        if delivery.returned and (assignment.job_id, assignment.round, assignment.attempt,
                                  assignment.shard) in self._reported_at_start:
            log.info("worker %s: job %s round %d shard %d came back from this worker's killed process, which it "
                     "reported failed when it started: nothing more to say", self.worker_id, assignment.job_id,
                     assignment.round, assignment.shard)
            return
        if self.ended.training_ended(assignment):
            log.info("worker %s: skipping task %d (shard %d) of job %s, whose last version is stored", self.worker_id,
                     assignment.attempt, assignment.shard, assignment.job_id)
            return
        await call_next()

    async def on_assignment(self, assignment: Assignment, delivery: Delivery) -> None:
        """Train one shard for one round and report the outcome (its turn taken); user errors never
        crash the worker."""
        if assignment.heartbeat_interval is not None:
            self.presence.pace(assignment.heartbeat_interval)
        if not await self.slot.run(assignment, self._run(assignment, delivery), name=f"train:{self.worker_id}"):
            # The job is over (or, in mode async, its training): nothing to report, and the assignment is done
            # with (acked).
            why = self.ended.reason(assignment.job_id) or "its last version is stored"
            trace.get_current_span().add_event("job.ended", {"apiary.reason": why})

    async def _run(self, a: Assignment, delivery: Delivery) -> float | None:
        """The assignment's steps (`pipeline`), in the slot's task; a trained shard's samples per second."""
        run = AssignmentRun(self, a, rate=lambda: self.slot.samples_per_s, delivery=delivery)
        return await run.run(self.ended.probe(a))

    def hand_off(self, a: Assignment, steps: Coroutine[Any, Any, None]) -> None:
        """Let the assignment's last `steps` go on without the training slot (they are stopped if its job ends or
        the worker stops)."""
        self.handed_off.start(a, steps, name=f"after-training:{self.worker_id}:{a.job_id}:{a.round}:{a.shard}")

    def skip_ended(self, a: Assignment) -> None:
        """Log that an assignment of a job that ended is not trained."""
        log.info("worker %s: skipping round %d shard %d of job %s, which ended (%s)", self.worker_id,
                 a.round, a.shard, a.job_id, self.ended.reason(a.job_id))

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
        await while_unavailable(lambda: publish_event(self.bus, failed, routing_key=report_key(failed, a)),
                                self.settings.dependency_backoff(),
                                f"worker {self.worker_id}: failure report of round {a.round} shard {a.shard}", log)

