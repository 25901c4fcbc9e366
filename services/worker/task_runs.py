"""A job's other assignments, beside training: its initial weights (`fl_init_weights`, or a built-in job's base
weights), each evaluated round's metrics (`fl_evaluate_model`) and a built-in job's final adapter merged into its
base model, run in the same training child as its training (so the job's code, or the base model in this
worker's cache, reaches them the same way) and reported to the scheduler. The control plane never runs a job's
code nor loads a base model."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TypeAlias

from apiary import telemetry, transfer
from apiary.backoff import while_unavailable
from apiary.bus import publish_event
from apiary.contracts import (
    EVALUATE,
    INIT,
    MERGE,
    AdapterMerged,
    Assignment,
    ObjectRef,
    WeightsInitialized,
    WorkerEvaluated,
)
from apiary.registry import zip_folder
from apiary.storage.base import sha256_file
from apiary.trainers import EVALUATE_FUNCTION, INIT_FUNCTION, TrainCall, TrainerError
from services.worker import transfers
from services.worker.host import Host, Workspace

log = logging.getLogger("apiary.worker")

Report: TypeAlias = WeightsInitialized | WorkerEvaluated | AdapterMerged


class TaskRun:
    """Run one init, evaluate or merge assignment and report its outcome; user errors are reported, never
    raised."""

    def __init__(self, worker: Host, assignment: Assignment, space: Workspace, call: TrainCall) -> None:
        self.worker, self.a, self.space, self.call = worker, assignment, space, call

    async def run(self) -> None:
        """The assignment's task in its own span; its report published (waiting for the broker if need be)."""
        a = self.a
        attributes = {**self.worker.span_attributes(a), "apiary.task": a.task}
        with telemetry.tracer().start_as_current_span(a.task, attributes=attributes) as span:
            report = await self._outcome()
            if report.error:
                telemetry.fail(span, "user_code.error", report.error)
                log.warning("worker %s: job %s %s failed: %s", self.worker.worker_id, a.job_id, a.task, report.error)
        await publish_report(self.worker, a, report)
        log.info("worker %s: job %s %s (round %d) done", self.worker.worker_id, a.job_id, a.task, a.round)

    async def _outcome(self) -> Report:
        """The task's report: its result, or why it has none."""
        if self.a.task == INIT:
            return await self._init()
        if self.a.task == MERGE:
            return await self._merge()
        return await self._evaluate()

    def _timeout(self) -> float:
        return max(1.0, self.a.deadline - time.time())

    async def _init(self) -> WeightsInitialized:
        a, target = self.a, Path(self.call.result_path)
        done = WeightsInitialized(job_id=a.job_id, attempt=a.attempt, worker_id=self.worker.worker_id)
        try:
            if not await self.worker.trainer_for(a).init_task(self.call, timeout=self._timeout()):
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
        done = WorkerEvaluated(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self.worker.worker_id,
                               shard=a.shard if a.scores_shard else None)
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

    async def _merge(self) -> AdapterMerged:
        """The final adapter merged into the base model (in the training child) and uploaded as one zip of the
        merged model folder; the zip's claim, or why there is none."""
        a, work = self.a, self.space.work
        done = AdapterMerged(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=self.worker.worker_id)
        folder, archive = work / "merged", work / "merged.zip"
        try:
            try:
                await transfers.fetch_weights(a, self.space.weights)
            except transfers.FETCH_ERRORS as e:
                return done.model_copy(update={"error": f"the final adapter could not be fetched: {e}"})
            try:
                call = replace(self.call, weights_path=str(self.space.weights), result_path=str(folder))
                await self.worker.trainer_for(a).merge_task(call, timeout=self._timeout())
            except TrainerError as e:
                return done.model_copy(update={"error": str(e)})
            try:
                await asyncio.to_thread(zip_folder, folder, archive)
                ref = ObjectRef(key=a.result_key, size=archive.stat().st_size,
                                sha256=await asyncio.to_thread(sha256_file, archive))
                await transfer.upload(a.upload_url, archive, deadline=a.deadline)
            except transfers.UPLOAD_ERRORS as e:
                return done.model_copy(update={"error": f"the merged model could not be stored: {e}"})
            return done.model_copy(update={"merged": ref})
        finally:  # a model's size, twice: not kept here
            shutil.rmtree(folder, ignore_errors=True)
            archive.unlink(missing_ok=True)


async def task_failed(worker: Host, a: Assignment, error: str) -> None:
    """Report that an init, evaluate or merge assignment could not run, and why (one line)."""
    log.warning("worker %s: job %s %s failed: %s", worker.worker_id, a.job_id, a.task, error)
    report: Report
    if a.task == INIT:
        report = WeightsInitialized(job_id=a.job_id, attempt=a.attempt, worker_id=worker.worker_id, error=error)
    elif a.task == MERGE:
        report = AdapterMerged(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=worker.worker_id,
                               error=error)
    else:
        report = WorkerEvaluated(job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=worker.worker_id,
                                 error=error, shard=a.shard if a.scores_shard else None)
    await publish_report(worker, a, report)


async def publish_report(worker: Host, a: Assignment, report: Report) -> None:
    """Publish a task's report with the assignment's secret (the scheduler believes no report without it),
    waiting for the broker rather than running the task again."""
    report = report.model_copy(update={"secret": a.secret or ""})
    await while_unavailable(lambda: publish_event(worker.bus, report), worker.settings.dependency_backoff(),
                            f"worker {worker.worker_id}: report of job {a.job_id}'s {a.task}", log)


def task_function(task: str) -> str:
    """The user's function a task runs (none for a merge: only a built-in trainer merges)."""
    return {INIT: INIT_FUNCTION, EVALUATE: EVALUATE_FUNCTION}.get(task, "")
