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

    home: Path = Path(".apiary")
    bus_url: str = "memory://"
    database_url: str = ""
    storage_url: str = ""
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    exchange: str = "apiary"
    # This process's own broker user and password (from `apiary broker setup`), in place of APIARY_BUS_URL's.
    bus_user: str | None = None
    bus_password: str | None = None
    prefetch: int = Field(default=16, ge=1)
    # RabbitMQ only: `quorum` declares every durable queue as a quorum queue (replicated across a cluster's
    # nodes), where a message delivered more than `queue_delivery_limit` times is dead-lettered.
    queue_type: Literal["classic", "quorum"] = "classic"
    queue_delivery_limit: int = Field(default=20, ge=1)
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-worker")
    worker_prefetch: int = Field(default=1, ge=1)
    gpu: int | None = None
    heartbeat_interval: float = Field(default=5.0, gt=0)
    progress_interval: float = Field(default=1.0, ge=0)
    worker_offline_after: float = Field(default=20.0, gt=0)
    # The heartbeats a second the whole fleet sends at most: past it, workers beat less often (apiary.pace).
    presence_rate: float = Field(default=50.0, gt=0)
    code_path: list[str] = Field(default_factory=list)
    worker_kind: Literal["own", "platform"] | None = None  # declared in worker.online (mixed selection)
    # Base models a worker keeps across jobs (default: under its work folder), cleaned past the limit.
    model_cache: Path | None = None
    model_cache_limit_gb: float = Field(default=50.0, gt=0)
    # A worker's cache of jobs' code bundles (unpacked; the least recently used dropped past the limit).
    code_cache_limit_gb: float = Field(default=2.0, gt=0)
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    http_body_limit: int = Field(
        default=LIMITS.request_bytes, ge=1, le=64 * 2**20,
        description="The most bytes a request body to the HTTP API may have (413 past it, before it is read "
                    "whole); code bundles (POST /api/v1/code) have their own 64 MiB, registered files none.")
    # `/healthz` and `/readyz` for an orchestrator's probes (services/app/health.py); off when unset.
    health_port: int | None = Field(default=None, ge=0, le=65535)
    health_host: str = "0.0.0.0"
    # How long an assignment's presigned URLs outlive its deadline (a round's aggregation_timeout, a task's
    # timeout): a margin for clock skew and an upload still running at the deadline, kept short so that a URL a
    # worker leaks is soon worth nothing. A URL is presigned for the whole of (deadline - now) plus this.
    presign_ttl: int = Field(default=15 * 60, ge=60)
    # While a dependency is away, work waiting on it is retried after a random wait of up to retry_initial s,
    # that ceiling doubling up to retry_cap s: a small cap, so that work resumes within seconds of the
    # dependency's return.
    retry_initial: float = Field(default=0.25, gt=0)
    retry_cap: float = Field(default=4.0, gt=0)
    # What job requests may reach (apiary.policy): entrypoints matching these globs (besides built-in trainers
    # and code bundles), and local dataset/model paths under these folders (none: the current folder).
    allowed_entrypoints: list[str] = Field(default_factory=lambda: ["examples.*"])
    data_roots: list[Path] = Field(default_factory=list)
    # Operational metrics (apiary.metrics, docs/metrics.md): `prometheus` (GET /metrics: the tracker's on its HTTP
    # API, any other process's on metrics_host:metrics_port), `otlp` (OTEL_EXPORTER_OTLP_*), both, or none.
    metrics: str = ""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    # Experiment tracking, fed by the tracker from the events it receives (services/tracker/experiments.py): an
    # MLflow run per job (`pip install 'apiary[mlflow]'`), TensorBoard event files per job (`apiary[tensorboard]`)
    # under tensorboard_dir/<job_id> (default: the job's folder in local storage, else APIARY_HOME/tensorboard).
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "apiary"
    tensorboard: bool = False
    tensorboard_dir: Path | None = None

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
