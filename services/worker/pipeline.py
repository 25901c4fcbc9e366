"""One assignment from start to end: download its inputs, train, upload the result, report; each step
in its own span under the assignment's consumer span."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from opentelemetry.trace import Span

from apiary import telemetry
from apiary.backoff import while_unavailable
from apiary.bus import Delivery, Kept, publish_event
from apiary.contracts import TRAIN, Assignment, ObjectRef, WorkerDone, report_key
from apiary.jobspec import parse_entrypoint
from apiary.trainers import TrainCall, TrainerError, TrainResult
from services.worker import transfers
from services.worker.bundles import BundleError, code_for
from services.worker.host import Host, Workspace
from services.worker.progress import ProgressStream
from services.worker.secure_rounds import SecureShard
from services.worker.task_runs import TaskRun, task_failed, task_function

log = logging.getLogger("apiary.worker")


class AssignmentRun:
    """Download, train, upload, report one assignment; a failed step reports worker.failed and ends it."""

    def __init__(self, worker: Host, assignment: Assignment, rate: Callable[[], float | None],
                 delivery: Delivery) -> None:
        self.worker, self.a = worker, assignment
        self.delivery = delivery  # how it came (returned from a lost worker?), and how it is kept past the slot
        self._rate = rate  # the worker's samples per second so far, which its progress reports carry
        self.space = Workspace(worker.cache / "jobs" / assignment.job_id)
        self.model_path: Path | None = None  # the job's base model in the worker's cache, if it has one
        self.code_path: Path | None = None  # the job's code bundle in the worker's cache, if it has one

    async def run(self, ended: asyncio.Task[bool] | None) -> float | None:
        """Every step in turn; skipped if `ended`, the reading of the job's end marker, says the job
        ended unheard (read beside the weights' download, or before it where the shard would be
        downloaded too). A trained shard, reported, returns the samples per second it measured; else None."""
        if self.a.secure_aggregation is not None and self.a.task == TRAIN and self.delivery.returned:
            await self._secure_taken_over()
            return None
        if not await self._code():
            return None
        if self.a.task != TRAIN:
            await self._task(ended)
            return None
        started = time.monotonic()
        self.space.clear_outputs()
        tracer = telemetry.tracer()
        with tracer.start_as_current_span("download", attributes=self.worker.span_attributes(self.a)) as span:
            data_root = await self._download(ended, span)
        if data_root is None:
            return None
        call = self._call(data_root)
        if self.a.secure_aggregation is not None:
            return await self._secure(call, started)
        result = await self._train(call)
        if result is None:
            return None
        uploaded, etag = await self._upload(result)
        if not uploaded:
            return None
        return await self._report(result, time.monotonic() - started, etag)

    async def _secure_taken_over(self) -> None:
        """A secure shard's assignment came back from a worker that was lost (killed, or cut off from the broker)
        after taking it: its keys were advertised before training and its private keys died with that worker, so
        no other worker can take its part. Said at once, so the round goes on without it instead of waiting for
        its timeout (one that was reported already is recovered from the others' shares, and this report of a
        settled shard is a duplicate the aggregator ignores)."""
        a = self.a
        log.warning("worker %s: job %s round %d shard %d came back from a lost worker: secure aggregation cannot "
                    "take its part over; reported failed", self.worker.worker_id, a.job_id, a.round, a.shard)
        await self.worker.failed(a, "secure aggregation: the worker that took the shard was lost (its assignment "
                                    "came back to the queue); its part of the key agreement cannot be taken over")

    async def _secure(self, call: TrainCall, started: float) -> float | None:
        """Train with secure aggregation (services.worker.secure_rounds): keys advertised before training; then the
        slot is given back and the rest goes on beside the worker's next assignment (`_after_training`), since it
        waits for every shard's keys, which may come from the shards this worker trains next (a round with more
        shards than workers). A protocol failure fails the shard, in one line."""
        a, worker = self.a, self.worker
        try:
            secure = SecureShard(worker, a, worker.secagg)
        except ValueError as e:
            await worker.failed(a, f"secure aggregation: {e}")
            return None
        try:
            await secure.advertise()
            result = await self._train(call)
            if result is not None:
                self.space = await asyncio.to_thread(self.space.set_aside, f"{a.round}-{a.attempt}-{a.shard}", a)
                # Kept from the broker until the shard is reported: if this worker dies for good meanwhile, the
                # assignment goes back to its queue and the worker that takes it reports the shard failed.
                kept = await self.delivery.keep()
        except BaseException:
            secure.close()
            raise
        if result is None:
            secure.close()
            return None
        worker.hand_off(a, self._after_training(secure, result, started, kept))
        return self._samples_per_s(result, time.monotonic() - started)

    async def _after_training(self, secure: SecureShard, result: TrainResult, started: float, kept: Kept) -> None:
        """A secure shard's steps after training, from its set-aside folder: share keys and mask the update in
        place of the weights, upload and report it, then sign the survivor set and reveal shares. Its assignment,
        `kept` from the broker, is released once the shard is reported (or has failed, or the worker stops)."""
        a, worker = self.a, self.worker
        reported = False
        try:
            try:
                result = await secure.mask(result, self.space.result, self.space.weights)
            except ValueError as e:
                await worker.failed(a, f"secure aggregation: {e}")
                return
            uploaded, _ = await self._upload(result)
            if not uploaded:
                return
            await self._report(result, time.monotonic() - started)
            reported = True
            await asyncio.to_thread(self.space.mark_reported)
            await kept.release()
            try:
                await secure.check()
                await secure.reveal()
            except ValueError as e:  # reported already: the round rebuilds this shard's mask from the others' shares
                log.warning("worker %s: job %s round %d shard %d: secure aggregation: %s", worker.worker_id, a.job_id,
                            a.round, a.shard, e)
        except asyncio.CancelledError:
            if worker.stopping and not reported:
                # Said rather than left to the round's timeout: the key agreement goes on without this shard.
                await worker.failed(a, "secure aggregation: the worker stopped before the shard was reported")
            raise
        finally:
            secure.close()
            await kept.release()
            await asyncio.to_thread(self.space.remove)

    async def _download(self, ended: asyncio.Task[bool] | None, span: Span) -> Path | None:
        """The shard's folder, with the global weights beside it; None if the job ended or a download failed."""
        a, space = self.a, self.space
        weights: asyncio.Future[None] | None = None
        try:
            if ended is None or transfers.shard_cached(a, space.job_dir):
                weights = transfers.fetch_weights(a, space.weights)  # beside the marker's reading
            if ended is not None and await ended:
                span.add_event("job.ended")
                self.worker.skip_ended(a)
                return None
            weights = weights or transfers.fetch_weights(a, space.weights)
            data_root, moved = await transfers.fetch_shard(a, space.job_dir)
            moved += await transfers.fetch_states(a, space.work)
            if a.base_model is not None:
                self.model_path, fetched = await self.worker.models.fetch(a.base_model, deadline=a.deadline)
                moved += fetched
            await weights
            span.set_attribute("apiary.bytes", moved + space.weights.stat().st_size)
            return data_root
        except transfers.FETCH_ERRORS as e:
            telemetry.fail(span, "download.failed", str(e))
            await self.worker.failed(a, f"inputs could not be fetched: {e}")
            return None
        finally:
            if weights is not None:
                # Never left running: a later assignment downloads to the same file.
                await asyncio.gather(weights, return_exceptions=True)
            if ended is not None and not ended.done():
                ended.cancel()

    async def _task(self, ended: asyncio.Task[bool] | None) -> None:
        """An init or evaluate assignment (`tasks`): no shard, the same training child."""
        if ended is not None and await ended:
            self.worker.skip_ended(self.a)
            return
        self.space.work.mkdir(parents=True, exist_ok=True)
        try:
            data_root = await self._task_inputs()
        except transfers.FETCH_ERRORS as e:
            await task_failed(self.worker, self.a, f"inputs could not be fetched: {e}")
            return
        call = replace(self._call(data_root), function=task_function(self.a.task),
                       result_path=str(self.space.work / "initial.safetensors"))
        await TaskRun(self.worker, self.a, self.space, call).run()

    async def _task_inputs(self) -> Path | None:
        """A task's inputs: for one shard's evaluation its data and state (the shard's folder); for a built-in job
        its base model (from this worker's cache) and, for an evaluation, the held-out records the assignment names
        in its shard's fields (their folder; None where it names none)."""
        a = self.a
        if a.scores_shard:
            # A personal-layers job scores each shard's personalised model where the shard is: its data and state.
            data_root, _ = await transfers.fetch_shard(a, self.space.job_dir)
            await transfers.fetch_states(a, self.space.work)
            return data_root
        if a.base_model is not None:
            self.model_path, _ = await self.worker.models.fetch(a.base_model, deadline=a.deadline)
        return await transfers.fetch_records(a, self.space.job_dir) if a.shard_url else None

    def _call(self, data_root: Path | None) -> TrainCall:
        a, space = self.a, self.space
        module, function = parse_entrypoint(a.entrypoint) if a.entrypoint else ("", "")
        return TrainCall(
            module=module, function=function, weights_path=str(space.weights), result_path=str(space.result),
            out_dir=str(space.out_dir), env=a.env,
            dataset={} if data_root is None else {"data_root": str(data_root), "shard_index": a.shard,
                                                  "num_samples": a.shard_num_samples, "num_shards": a.num_shards},
            round={"index": a.round, "total": a.num_rounds, "attempt": a.attempt},
            job={"id": a.job_id, "name": a.job_name},
            model_path=str(self.model_path) if self.model_path is not None else None,
            code_path=str(self.code_path) if self.code_path is not None else None,
            clipping_norm=a.clipping_norm, noise_std=a.noise_std, noise_seed=a.noise_seed,
            transfer=a.transfer.model_dump() if a.transfer is not None and a.transfer.encodes_upload else None,
            **transfers.state_call(a, space.work, space.weights),
        )

    async def _code(self) -> bool:
        """The job's code bundle ready here (downloaded once per worker) and the requirements it declares met,
        whatever the assignment's task; False (reported, in one line) if not."""
        try:
            self.code_path = await code_for(self.worker.bundles, self.a)
        except BundleError as e:
            if self.a.task != TRAIN:
                await task_failed(self.worker, self.a, str(e))
            else:
                await self.worker.failed(self.a, str(e))
            return False
        return True

    async def _train(self, call: TrainCall) -> TrainResult | None:
        """The trainer's result; None (reported) if training failed or returned no usable sample count."""
        a, worker = self.a, self.worker
        progress = ProgressStream(worker.bus, worker.worker_id, a, interval=worker.settings.progress_interval,
                                  rate=self._rate)
        attributes = {**worker.span_attributes(a), "apiary.entrypoint": a.entrypoint}
        with telemetry.tracer().start_as_current_span("train", attributes=attributes) as span:
            try:
                trainer = worker.trainer_for(a)
                span.set_attribute("apiary.update_format", trainer.update_format(a.env).value)
                result = await trainer.train(call, timeout=max(1.0, a.deadline - time.time()), on_metrics=progress.add)
            except TrainerError as e:
                telemetry.fail(span, "user_code.error", str(e))
                await progress.close()
                await worker.failed(a, str(e))
                return None
            span.set_attribute("apiary.samples", result.samples if isinstance(result.samples, int) else -1)
        await progress.close()
        if not result.has_samples():
            await worker.failed(a, f"{call.function} returned samples={result.samples!r}: expected a positive int")
            return None
        return result

    async def _upload(self, result: TrainResult) -> tuple[bool, str | None]:
        """Upload the trained weights and the run's files; False (reported) if that failed, and the result's ETag
        where it went in parts."""
        a, space = self.a, self.space
        with telemetry.tracer().start_as_current_span("upload", attributes=self.worker.span_attributes(a)) as span:
            try:
                moved, etag = await transfers.upload_outputs(a, space.result, result.size, result.sha256,
                                                              space.out_dir, space.work)
                moved += await transfers.upload_state(a, space.work, result.state_size)
                span.set_attribute("apiary.bytes", moved)
            except transfers.UPLOAD_ERRORS as e:
                telemetry.fail(span, "upload.failed", str(e))
                await self.worker.failed(a, f"result upload failed: {e}")
                return False, None
        return True, etag

    async def _report(self, result: TrainResult, duration: float, etag: str | None = None) -> float:
        """Report the trained shard (worker.done, with the result's ETag where it went in parts); the samples per
        second it measured."""
        a, worker = self.a, self.worker
        ref = ObjectRef(key=a.result_key, size=result.size, sha256=result.sha256, etag=etag)
        done = WorkerDone(
            job_id=a.job_id, round=a.round, attempt=a.attempt, worker_id=worker.worker_id, shard=a.shard,
            result=ref, samples=result.samples, metrics=result.metrics, duration_s=duration, secret=a.secret or "",
            state=transfers.state_ref(a, result.state_size, result.state_sha256),
        )
        # The trained shard is worth keeping through a broker outage: the report waits for the broker,
        # rather than the whole assignment running again.
        await while_unavailable(lambda: publish_event(worker.bus, done, routing_key=report_key(done, a)),
                                worker.settings.dependency_backoff(),
                                f"worker {worker.worker_id}: report of round {a.round} shard {a.shard}", log)
        log.info("worker %s: job %s round %d shard %d done in %.2fs (%d samples)", worker.worker_id,
                 a.job_id, a.round, a.shard, duration, result.samples)
        return self._samples_per_s(result, duration)

    def _samples_per_s(self, result: TrainResult, duration: float) -> float:
        """The samples per second a trained shard measured, its epochs counted."""
        return result.samples * max(1, int(self.a.env.get("EPOCHS") or 1)) / max(duration, 1e-6)
