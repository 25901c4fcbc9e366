"""Experiment tracking fed by the tracker: the events it already receives, turned into runs, params and scalars for
MLflow and TensorBoard (services/tracker/experiment_sinks.py), written in the background.

A sink that fails (MLflow down, a full disk) never slows or fails a job: the tracker only appends to each sink's
backlog; a task per sink writes it in batches, and after a failure retries the same batch after a growing wait,
reporting the backlog as `apiary.exporter.backlog` (bounded: past MAX_BACKLOG the oldest records are dropped, and
the log says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from apiary import metrics
from apiary.backoff import Backoff
from apiary.contracts import JobCompleted, JobFailed, RoundAggregated, RoundEvaluated, WorkerDone

log = logging.getLogger("apiary.tracker.experiments")

MAX_BACKLOG = 100_000
BATCH = 500
RETRY = Backoff(base=1.0, cap=60.0)
PARAM_CHARS = 500  # a param's value is cut past this (MLflow limits them; a config can hold long lists)


@dataclass(frozen=True)
class RunStarted:
    """A job was requested: its run, named after it, with its config and distributed settings as params."""

    job_id: str
    name: str
    params: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Scalars:
    """Numbers of one job at one step (the round)."""

    job_id: str
    step: int
    values: Mapping[str, float]
    ts: float = 0.0


@dataclass(frozen=True)
class RunEnded:
    """A job ended: completed (with its final model's location), failed or cancelled."""

    job_id: str
    status: str
    final_model: str | None = None
    reason: str | None = None


Record = RunStarted | Scalars | RunEnded


class Sink(Protocol):
    """Where records go: `write` is called from a thread, one batch at a time, and raises if it could not write."""

    name: str

    def write(self, records: Sequence[Record]) -> None:
        """Write the records in order (a batch written again after a failure must do no harm)."""

    def close(self) -> None:
        """Flush and release what the sink holds."""


def _numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers among `values` (booleans are no metrics), their names prefixed."""
    return {f"{prefix}{k}": float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def _flat(value: Any, prefix: str) -> dict[str, str]:
    """A nested mapping as `prefix.key` params, each value as text."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return {prefix: text[:PARAM_CHARS]}


def records_of(key: str, event: Any, ts: float) -> list[Record]:
    """What an event the tracker applied means for experiment tracking (none for most events)."""
    if key == "job.requested" and isinstance(event, Mapping) and isinstance(event.get("job_id"), str):
        params = {**_flat(event.get("config") or {}, "config"), **_flat(event.get("distributed") or {}, "distributed")}
        return [RunStarted(event["job_id"], str(event.get("name") or event["job_id"]), params)]
    if isinstance(event, RoundAggregated):
        values = {**_numbers(event.metrics), "contributors": float(len(event.contributors))}
        return [Scalars(event.job_id, event.round, values, ts)]
    if isinstance(event, RoundEvaluated) and event.found and event.metrics:
        return [Scalars(event.job_id, event.round, _numbers(event.metrics, "eval/"), ts)]
    if isinstance(event, WorkerDone) and event.metrics:
        return [Scalars(event.job_id, event.round, _numbers(event.metrics, f"worker/{event.worker_id}/"), ts)]
    if isinstance(event, JobCompleted):
        return [RunEnded(event.job_id, "completed", event.final_model, event.reason)]
    if isinstance(event, JobFailed):
        return [RunEnded(event.job_id, "cancelled" if event.cancelled else "failed", None, event.reason)]
    return []


class Experiments:
    """The tracker's experiment sinks, each with its backlog and its writer task."""

    def __init__(self, sinks: Sequence[Sink], *, retry: Backoff = RETRY) -> None:
        self.sinks = list(sinks)
        self._retry = retry
        self._backlogs: dict[str, deque[Record]] = {s.name: deque(maxlen=MAX_BACKLOG) for s in self.sinks}
        self._wake = {s.name: asyncio.Event() for s in self.sinks}
        # A thread per sink, not the loop's default executor: a write hung on a dead server must not hold up
        # the process's exit (shutdown does not wait for these).
        self._threads = {s.name: ThreadPoolExecutor(1, thread_name_prefix=f"export-{s.name}") for s in self.sinks}
        self._tasks: list[asyncio.Task[None]] = []

    def backlog(self, sink: str) -> int:
        """How many records a sink has yet to write."""
        return len(self._backlogs[sink])

    def hear(self, key: str, event: Any, ts: float) -> None:
        """Queue what an applied event means for each sink (never waits)."""
        if not self.sinks:
            return
        records = records_of(key, event, ts)
        if not records:
            return
        for sink in self.sinks:
            backlog = self._backlogs[sink.name]
            if len(backlog) + len(records) > MAX_BACKLOG:
                log.error("%s exporter: backlog past %d records; the oldest are dropped", sink.name, MAX_BACKLOG)
            backlog.extend(records)
            metrics.exporter_backlog(sink.name, len(backlog))
            self._wake[sink.name].set()

    def start(self) -> None:
        """Start a writer task per sink."""
        self._tasks = [asyncio.create_task(self._run(s), name=f"tracker:export:{s.name}") for s in self.sinks]

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every backlog to be written; whether it was."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while any(self._backlogs.values()):  # noqa: ASYNC110 - a bounded wait on the writer tasks
                    await asyncio.sleep(0.02)
                return True
        return False

    async def close(self, timeout: float = 5.0) -> None:
        """Give the writers `timeout` seconds to finish their backlogs, then stop them and close the sinks."""
        if not await self.drain(timeout):
            for name, backlog in self._backlogs.items():
                if backlog:
                    log.warning("%s exporter: %d records not written before the tracker stopped", name, len(backlog))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(sink, sink.close), timeout)
            self._threads[sink.name].shutdown(wait=False, cancel_futures=True)

    def _call(self, sink: Sink, call: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._threads[sink.name], call, *args)

    async def _run(self, sink: Sink) -> None:
        backlog, wake, failures = self._backlogs[sink.name], self._wake[sink.name], 0
        while True:
            if not backlog:
                wake.clear()
                await wake.wait()
                continue
            batch = [backlog[i] for i in range(min(BATCH, len(backlog)))]
            try:
                await self._call(sink, sink.write, batch)
            except Exception as e:  # any failure of the sink's backend: the batch is written again later
                failures += 1
                metrics.exporter_failed(sink.name)
                wait = self._retry.delay(failures)
                if failures == 1 or self._retry.delay(failures - 1) < wait:
                    log.warning("%s exporter: %s: %s; %d records wait, retrying in up to %g s", sink.name,
                                type(e).__name__, str(e).splitlines()[0] if str(e) else "", len(backlog), wait)
                await asyncio.sleep(self._retry.wait(failures))
                continue
            if failures:
                log.info("%s exporter: writing again after %d failures", sink.name, failures)
            failures = 0
            for record in batch:  # those of the batch still queued (a full backlog may have dropped some)
                if backlog and backlog[0] is record:
                    backlog.popleft()
            metrics.exporter_backlog(sink.name, len(backlog))


__all__ = ["Experiments", "Record", "RunEnded", "RunStarted", "Scalars", "Sink", "records_of"]
