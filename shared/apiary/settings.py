"""Process settings, read from `APIARY_*` environment variables."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from apiary.backoff import Backoff
from apiary.metrics import exporters as metric_exporters
from apiary.policy import LIMITS


class Settings(BaseSettings):
    """Where the bus, database and storage are, and how a process behaves."""

    model_config = SettingsConfigDict(env_prefix="APIARY_", extra="ignore")

    home: Path = Field(default=Path(".apiary"), description="The embedded mode's folder: the SQLite database, "
                       "the storage folder, logs and the run's token, unless the URLs below say otherwise.")
    bus_url: str = Field(default="memory://", description="The message bus: memory:// (in-process, apiary run) or "
                         "amqp://user:pass@host:5672/ (RabbitMQ).")
    database_url: str = Field(default="", description="sqlite:///PATH or postgresql://user@host/db (empty: a "
                              "SQLite file under APIARY_HOME).")
    storage_url: str = Field(default="", description="file://FOLDER or s3://bucket/prefix (empty: a folder under "
                             "APIARY_HOME).")
    s3_endpoint_url: str | None = Field(default=None, description="An S3-compatible endpoint (MinIO, moto) in place "
                                       "of AWS's.")
    s3_region: str = Field(default="us-east-1", description="The S3 region presigned URLs are signed for.")
    exchange: str = Field(default="apiary", description="The topic exchange every message goes through; queues are "
                          "named after it.")
    bus_user: str | None = Field(default=None, description="This process's own broker user (from apiary broker "
                                 "setup), in place of APIARY_BUS_URL's.")
    bus_password: str | None = Field(default=None, description="The password of APIARY_BUS_USER.")
    prefetch: int = Field(default=16, ge=1, description="Messages a service takes from its queue before acking.")
    queue_type: Literal["classic", "quorum"] = Field(
        default="classic", description="RabbitMQ only: quorum declares every durable queue as a quorum queue "
        "(replicated across a cluster's nodes). Every process of a deployment must agree.")
    queue_delivery_limit: int = Field(default=20, ge=1, description="Quorum queues: deliveries before the broker "
                                      "dead-letters a message (a consumer crash loop).")
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-worker",
                           description="This worker's id (default: the host name with -worker).")
    worker_prefetch: int = Field(default=1, ge=1, description="Assignments a worker holds at once.")
    gpu: int | None = Field(default=None, description="The GPU this worker trains on (nvidia-smi's index); none: "
                            "the CPU, or the first GPU visible.")
    heartbeat_interval: float = Field(default=5.0, gt=0, description="Seconds between a worker's heartbeats while "
                                      "the fleet is small (apiary.pace stretches it for large fleets).")
    progress_interval: float = Field(default=1.0, ge=0, description="Seconds between a worker's progress reports "
                                     "while it trains.")
    worker_offline_after: float = Field(default=20.0, gt=0, description="Seconds of silence after which a worker is "
                                        "taken as offline (stretched with the heartbeat interval).")
    presence_rate: float = Field(default=50.0, gt=0, description="The heartbeats a second the whole fleet sends at "
                                 "most: past it, workers beat less often (apiary.pace).")
    code_path: list[str] = Field(default_factory=list, description="Folders put first on the training process's "
                                 "sys.path (JSON list), for entrypoints installed nowhere else.")
    worker_kind: Literal["own", "platform"] | None = Field(default=None, description="What this worker is, "
                                                           "declared in worker.online, for mixed worker selection.")
    model_cache: Path | None = Field(default=None, description="The folder where a worker keeps base models across "
                                     "jobs (default: under its work folder); workers of one machine may share it.")
    model_cache_limit_gb: float = Field(default=50.0, gt=0, description="Gigabytes of base models a worker keeps; "
                                        "the least recently used are removed past it.")
    code_cache_limit_gb: float = Field(default=2.0, gt=0, description="Gigabytes of unpacked code bundles a worker "
                                       "keeps; the least recently used are removed past it.")
    http_host: str = Field(default="127.0.0.1", description="The address the tracker's HTTP API and dashboard "
                           "listen on.")
    http_port: int = Field(default=8080, description="The port of the tracker's HTTP API and dashboard (0: a free "
                           "one).")
    http_body_limit: int = Field(
        default=LIMITS.request_bytes, ge=1, le=64 * 2**20,
        description="The most bytes a request body to the HTTP API may have (413 past it, before it is read "
                    "whole); code bundles (POST /api/v1/code) have their own 64 MiB, registered files none.")
    health_port: int | None = Field(default=None, ge=0, le=65535, description="The port of /healthz and /readyz "
                                    "for an orchestrator's probes; off when unset.")
    health_host: str = Field(default="0.0.0.0", description="The address the health probes listen on.")
    # A margin for clock skew and an upload still running at the deadline, kept short so that a URL a worker
    # leaks is soon worth nothing.
    presign_ttl: int = Field(default=15 * 60, ge=60, description="Seconds an assignment's presigned URLs outlive "
                             "its deadline (a round's aggregation_timeout, a task's timeout).")
    # A small cap, so that work resumes within seconds of the dependency's return.
    retry_initial: float = Field(default=0.25, gt=0, description="While a dependency is away, work waiting on it "
                                 "is retried after a random wait of up to this many seconds, the ceiling doubling.")
    retry_cap: float = Field(default=4.0, gt=0, description="The largest ceiling, in seconds, of the wait between "
                             "retries while a dependency is away.")
    allowed_entrypoints: list[str] = Field(default_factory=lambda: ["examples.*"], description="Globs over "
                                           "module:function or module (JSON list) a job's entrypoint must match; "
                                           "built-in trainers and code bundles need none.")
    data_roots: list[Path] = Field(default_factory=list, description="Folders (JSON list) local dataset and model "
                                   "paths must resolve under (none: the current folder).")
    metrics: str = Field(default="", description="Operational metrics (docs/metrics.md): `prometheus` (GET /metrics: "
                         "the tracker's on its HTTP API, any other process's on metrics_host:metrics_port), `otlp` "
                         "(OTEL_EXPORTER_OTLP_*), both comma-separated, or none (empty).")
    metrics_host: str = Field(default="0.0.0.0", description="The address a process other than the tracker serves "
                              "/metrics on.")
    metrics_port: int = Field(default=9464, ge=0, le=65535, description="The port a process other than the tracker "
                              "serves /metrics on (the tracker's is its HTTP API's).")
    mlflow_tracking_uri: str | None = Field(default=None, description="Where the tracker logs an MLflow run per job "
                                            "(e.g. sqlite:///mlflow.db or http://mlflow:5000; needs "
                                            "`pip install 'apiary[mlflow]'`); off when unset.")
    mlflow_experiment: str = Field(default="apiary", description="The MLflow experiment the jobs' runs go in.")
    tensorboard: bool = Field(default=False, description="Write TensorBoard event files per job (needs "
                              "`pip install 'apiary[tensorboard]'`).")
    tensorboard_dir: Path | None = Field(default=None, description="Where the event files go, under <dir>/<job_id> "
                                         "(default: the job's folder in local storage, else APIARY_HOME/tensorboard).")

    @field_validator("metrics")
    @classmethod
    def _known_exporters(cls, value: str) -> str:
        metric_exporters(value)  # a ValueError naming the bad exporter
        return value

    def dependency_backoff(self) -> Backoff:
        """How long work waits between tries while a dependency is away (no limit on tries)."""
        return Backoff(base=self.retry_initial, cap=max(self.retry_cap, self.retry_initial))

    def resolved_bus_url(self) -> str:
        """The bus URL, logged in as APIARY_BUS_USER / APIARY_BUS_PASSWORD where they are set."""
        if not self.bus_user or self.bus_url.startswith("memory:"):
            return self.bus_url
        from urllib.parse import quote, urlsplit, urlunsplit

        parts = urlsplit(self.bus_url)
        host = parts.hostname or "localhost"
        host = f"[{host}]" if ":" in host else host
        login = quote(self.bus_user, safe="") + (f":{quote(self.bus_password, safe='')}" if self.bus_password else "")
        netloc = f"{login}@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to a SQLite file under `home`."""
        return self.database_url or f"sqlite:///{(self.home / 'apiary.db').resolve()}"

    def resolved_storage_url(self) -> str:
        """The storage URL, defaulting to a folder under `home`."""
        return self.storage_url or f"file://{(self.home / 'storage').resolve()}"
