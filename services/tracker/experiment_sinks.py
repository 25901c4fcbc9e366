"""The experiment sinks: an MLflow run per job and TensorBoard event files per job, chosen by settings
(`APIARY_MLFLOW_TRACKING_URI`, `APIARY_TENSORBOARD`). Each is called from a thread, one batch at a time."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apiary import keys
from apiary.settings import Settings
from apiary.storage import Storage
from apiary.storage.local import LocalStorage
from services.tracker.experiments import Record, RunEnded, RunStarted, Scalars, Sink

JOB_TAG = "apiary.job_id"
_MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
_UNSAFE = re.compile(r"[^\w\-. /]")  # what MLflow refuses in a metric or param name


class MissingExtra(RuntimeError):
    """An exporter was asked for but its package is not installed."""


class MlflowSink:
    """One MLflow run per job in one experiment: tags name the job, params its request, metrics its rounds."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str = "apiary") -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise MissingExtra("APIARY_MLFLOW_TRACKING_URI is set but MLflow is not installed: "
                               "pip install 'apiary[mlflow]'") from e
        # The exporter retries on its own, in the background: MLflow's client should fail fast rather than retry
        # a dead server for minutes inside one call.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._experiment_name = experiment
        self._experiment_id: str | None = None
        self._runs: dict[str, str] = {}  # job id -> run id

    def write(self, records: Sequence[Record]) -> None:
        """Write each record to its job's run (made on first need, found again by its tag after a restart)."""
        for record in records:
            run_id = self._run(record.job_id, record.name if isinstance(record, RunStarted) else record.job_id)
            if isinstance(record, RunStarted):
                self._params(run_id, record)
            elif isinstance(record, Scalars):
                self._metrics(run_id, record)
            else:
                self._end(run_id, record)

    def close(self) -> None:
        """Nothing is held open (each call is its own request)."""

    def _experiment(self) -> str:
        if self._experiment_id is None:
            found = self._client.get_experiment_by_name(self._experiment_name)
            self._experiment_id = (found.experiment_id if found is not None
                                   else self._client.create_experiment(self._experiment_name))
        return self._experiment_id

    def _run(self, job_id: str, name: str) -> str:
        run_id = self._runs.get(job_id)
        if run_id is None:
            runs = self._client.search_runs([self._experiment()], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'",
                                            max_results=1)
            run_id = runs[0].info.run_id if runs else self._client.create_run(
                self._experiment(), tags={JOB_TAG: job_id, "apiary.job_name": name}, run_name=name).info.run_id
            self._runs[job_id] = run_id
        return run_id

    def _params(self, run_id: str, record: RunStarted) -> None:
        from mlflow.entities import Param

        self._client.set_tag(run_id, "apiary.job_name", record.name)
        logged = self._client.get_run(run_id).data.params
        params = [Param(_UNSAFE.sub("_", k), v) for k, v in sorted(record.params.items())
                  if _UNSAFE.sub("_", k) not in logged]  # params cannot change: a retried batch skips them
        for start in range(0, len(params), 100):
            self._client.log_batch(run_id, params=params[start:start + 100])

    def _metrics(self, run_id: str, record: Scalars) -> None:
        from mlflow.entities import Metric

        stamp = int((record.ts or time.time()) * 1000)
        self._client.log_batch(run_id, metrics=[Metric(_UNSAFE.sub("_", k), v, stamp, record.step)
                                                for k, v in sorted(record.values.items())])

    def _end(self, run_id: str, record: RunEnded) -> None:
        if record.final_model:
            self._client.set_tag(run_id, "apiary.final_model", record.final_model)
            # A reference, not the bytes: the model stays where Apiary stored it.
            self._client.log_dict(run_id, {"job_id": record.job_id, "final_model": record.final_model},
                                  "apiary/final_model.json")
        if record.reason:
            self._client.set_tag(run_id, "apiary.reason", record.reason[:5000])
        self._client.set_terminated(run_id, _MLFLOW_STATUS.get(record.status, "FINISHED"))
        self._runs.pop(record.job_id, None)


class TensorBoardSink:
    """TensorBoard event files, one folder per job (`tensorboard --logdir` on the folder above shows them all)."""

    name = "tensorboard"

    def __init__(self, folder_of: Any) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise MissingExtra("APIARY_TENSORBOARD is on but tensorboardX is not installed: "
                               "pip install 'apiary[tensorboard]'") from e
        self._writer_class = SummaryWriter
        self._folder_of = folder_of  # job id -> Path
        self._writers: dict[str, Any] = {}

    def _writer(self, job_id: str) -> Any:
        writer = self._writers.get(job_id)
        if writer is None:
            folder = Path(self._folder_of(job_id))
            folder.mkdir(parents=True, exist_ok=True)
            writer = self._writers[job_id] = self._writer_class(logdir=str(folder), flush_secs=30)
        return writer

    def write(self, records: Sequence[Record]) -> None:
        """Append the records to their jobs' event files, and flush them."""
        touched = set()
        for record in records:
            writer = self._writer(record.job_id)
            touched.add(record.job_id)
            if isinstance(record, RunStarted):
                writer.add_text("apiary/request", "```\n" + json.dumps(dict(record.params), indent=1) + "\n```")
            elif isinstance(record, Scalars):
                for tag, value in sorted(record.values.items()):
                    writer.add_scalar(tag, value, global_step=record.step, walltime=record.ts or None)
            else:
                writer.add_text("apiary/end", f"{record.status}: {record.final_model or record.reason or ''}")
        for job_id in touched:
            self._writers[job_id].flush()
        for record in records:
            if isinstance(record, RunEnded) and record.job_id in self._writers:
                self._writers.pop(record.job_id).close()

    def close(self) -> None:
        """Close every open event file."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def tensorboard_folder(settings: Settings, storage: Storage) -> Any:
    """Where a job's event files go: under APIARY_TENSORBOARD_DIR, else in the job's folder of local storage,
    else under APIARY_HOME/tensorboard."""

    def folder_of(job_id: str) -> Path:
        if settings.tensorboard_dir is not None:
            return settings.tensorboard_dir / job_id
        if isinstance(storage, LocalStorage):
            return storage.root / keys.job_prefix(job_id) / "tensorboard"
        return settings.home / "tensorboard" / job_id

    return folder_of


def sinks_of(settings: Settings, storage: Storage) -> list[Sink]:
    """The sinks the settings ask for (MissingExtra, one line, where a package is missing)."""
    sinks: list[Sink] = []
    if settings.mlflow_tracking_uri:
        sinks.append(MlflowSink(settings.mlflow_tracking_uri, settings.mlflow_experiment))
    if settings.tensorboard:
        sinks.append(TensorBoardSink(tensorboard_folder(settings, storage)))
    return sinks


__all__ = ["MissingExtra", "MlflowSink", "TensorBoardSink", "sinks_of", "tensorboard_folder"]
