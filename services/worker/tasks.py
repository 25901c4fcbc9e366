"""A job's other assignments, beside training: its initial weights (`fl_init_weights`) and each evaluated
round's metrics (`fl_evaluate_model`), run in the same training child as `fl_train_model` (so the job's code
reaches them the same way) and reported to the scheduler. The control plane never runs a job's code."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from apiary import telemetry, transfer
from apiary.backoff import while_unavailable
from apiary.bus import publish_event
from apiary.contracts import INIT, Assignment, ObjectRef, WeightsInitialized, WorkerEvaluated
from apiary.trainers import EVALUATE_FUNCTION, INIT_FUNCTION, TrainCall, TrainerError, UserCodeRunner
from services.worker import transfers

if TYPE_CHECKING:
    from services.worker.pipeline import Slot, Workspace

log = logging.getLogger("apiary.worker")

Report: TypeAlias = WeightsInitialized | WorkerEvaluated


class TaskRun:
    """Run one init or evaluate assignment and report its outcome; user errors are reported, never raised."""

    def __init__(self, worker: Slot, assignment: Assignment, space: Workspace, call: TrainCall) -> None:
        self.worker, self.a, self.space, self.call = worker, assignment, space, call

    async def run(self) -> None:
        """The assignment's task in its own span; its report published (waiting for the broker if need be)."""
        a = self.a
        attributes = {**self.worker.span_attributes(a), "apiary.task": a.task}
        with telemetry.tracer().start_as_current_span(a.task, attributes=attributes) as span:
            report = await (self._init() if a.task == INIT else self._evaluate())
            if report.error:
                telemetry.fail(span, "user_code.error", report.error)
                log.warning("worker %s: job %s %s failed: %s", self.worker.worker_id, a.job_id, a.task, report.error)
        await publish_report(self.worker, a, report)
        log.info("worker %s: job %s %s (round %d) done", self.worker.worker_id, a.job_id, a.task, a.round)

    def _runner(self) -> UserCodeRunner:
        trainer = self.worker.trainer_for(self.a)
        if not isinstance(trainer, UserCodeRunner):
            raise TrainerError(f"job {self.a.job_id}'s trainer runs no user code: it has no {self.a.task} task")
        return trainer

    def _timeout(self) -> float:
        return max(1.0, self.a.deadline - time.time())

    async def _init(self) -> WeightsInitialized:
        a, target = self.a, Path(self.call.result_path)
        done = WeightsInitialized(job_id=a.job_id, attempt=a.attempt, worker_id=self.worker.worker_id)
        try:
            if not await self._runner().init_task(self.call, timeout=self._timeout()):
                return done.model_copy(update={"found": False})
            # Written by the child as safetensors; the scheduler checks them before any round starts from them
            # (this process never loads torch).
            data = await asyncio.to_thread(target.read_bytes)
            await transfer.upload(a.upload_url, target, deadline=a.deadline)
        except TrainerError as e:
            return done.model_copy(update={"error": str(e)})
        except transfers.UPLOAD_ERRORS as e:
            return done.model_copy(update={"error": f"initial weights could not be stored: {e}"})
        ref = ObjectRef(key=a.result_key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        return done.model_copy(update={"weights": ref})

    async def _evaluate(self) -> WorkerEvaluated:
        a = self.a
        done = WorkerEvaluated(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self.worker.worker_id)
        try:
            await transfers.fetch_weights(a, self.space.weights)
        except transfers.FETCH_ERRORS as e:
            return done.model_copy(update={"error": f"round {a.round}'s weights could not be fetched: {e}"})
        try:
            metrics = await self.worker.trainer_for(self.a).evaluate_task(self.call, timeout=self._timeout())
        except TrainerError as e:
            return done.model_copy(update={"error": str(e)})
        if metrics is None:
            return done.model_copy(update={"found": False})
        return done.model_copy(update={"metrics": metrics})


async def task_failed(worker: Slot, a: Assignment, error: str) -> None:
    """Report that an init or evaluate assignment could not run, and why (one line)."""
    log.warning("worker %s: job %s %s failed: %s", worker.worker_id, a.job_id, a.task, error)
    report: Report
    if a.task == INIT:
        report = WeightsInitialized(job_id=a.job_id, attempt=a.attempt, worker_id=worker.worker_id, error=error)
    else:
        report = WorkerEvaluated(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=worker.worker_id,
                                 error=error)
    await publish_report(worker, a, report)


async def publish_report(worker: Slot, a: Assignment, report: Report) -> None:
    """Publish a task's report with the assignment's secret (the scheduler believes no report without it),
    waiting for the broker rather than running the task again."""
    report = report.model_copy(update={"secret": a.secret or ""})
    await while_unavailable(lambda: publish_event(worker.bus, report), worker.settings.dependency_backoff(),
                            f"worker {worker.worker_id}: report of job {a.job_id}'s {a.task}", log)


def task_function(task: str) -> str:
    """The user's function a task runs."""
    return INIT_FUNCTION if task == INIT else EVALUATE_FUNCTION
