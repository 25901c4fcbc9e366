"""The HTTP API's response bodies, as pydantic models so /openapi.json documents them."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from apiary.contracts import JOB_ID_PATTERN, SecAggSummary
from apiary.jobspec import FieldError
from services.tracker.api_path import PREFIX


class Problem(BaseModel):
    """An error: one line for people, and one entry per bad field where the request had any."""

    detail: str
    errors: list[FieldError] = Field(default_factory=list)


Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {404: {"model": Problem, "description": "no such job"}}
# Every API route answers 401 without a valid token and 422 to a bad parameter; a route that changes anything
# 403 to a viewer's token, and 413 to a body past its limit (services.tracker.body_limit).
API_ERRORS: Responses = {401: {"model": Problem, "description": "no token, or one that no one holds"},
                           422: {"model": Problem, "description": "each bad parameter, named"}}
# A route with a JSON body answers 400 to one that is no JSON text at all (not UTF-8, nested too deep).
UNPARSED: Responses = {400: {"model": Problem, "description": "the body could not be parsed"}}
CHANGES: Responses = {403: {"model": Problem, "description": "the token's role may not do this"},
                      413: {"model": Problem, "description": "the body is over the route's size limit"}}
# A job id as a request names it (see apiary.contracts.JobRequested): anything else is no job's.
JOB_ID = Path(min_length=1, max_length=100, pattern=JOB_ID_PATTERN, description="the job's id")


def no_job(job_id: str) -> HTTPException:
    """The 404 for a job id the tracker does not know."""
    return HTTPException(404, f"no job {job_id!r}: list jobs at {PREFIX}/training-jobs")


class JobSubmitted(BaseModel):
    """A job request the tracker published; follow it at `url`, live at `events_url`."""

    job_id: str
    status: str
    url: str
    events_url: str


class JobChecked(BaseModel):
    """A request checked with `dry_run`: it would be accepted as it stands (nothing was submitted)."""

    valid: bool = True
    request: dict[str, Any] = Field(description="the request as it would be published")


class CancelJob(BaseModel):
    """Why a job is cancelled (shown with its status)."""

    reason: str = "cancelled by user"


class CancelRequested(BaseModel):
    """A cancellation on its way to the scheduler; the job ends as `cancelled`."""

    job_id: str
    status: str = Field(description="cancelling, or unknown: no such job yet, and if its request comes it will not"
                        " start (only with `ahead=true`)")


class JobSummary(BaseModel):
    """One job in the jobs list."""

    job_id: str
    name: str | None
    status: str = Field(description="requested, sharding, running, completed, failed, cancelled or rejected")
    round: int = Field(description="the current round (1-based; 0 before the first round starts)")
    attempt: int
    num_rounds: int | None
    num_shards: int | None
    reason: str | None = Field(description="why the job failed, was rejected or cancelled")
    final_model: str | None = Field(description="where the final model is, once the job completed")
    metrics: dict[str, float] = Field(description="final metrics, once the job completed")
    last_round_metrics: dict[str, float] = Field(description="aggregated metrics of the latest round")
    created_at: float
    updated_at: float


class RoundView(BaseModel):
    """One attempt of one round and its aggregated metrics."""

    round: int
    attempt: int
    status: str = Field(description="running, aggregated, failed, cancelled (its job was cancelled first), or "
                                    "initial (round 0: a built-in job's starting model, evaluated)")
    metrics: dict[str, float]
    reason: str | None
    started_at: float | None
    ended_at: float | None
    evaluation: dict[str, float] | None = Field(
        default=None, description="the round's global model evaluated on a worker (fl_evaluate_model, or the "
                                  "built-in trainer on eval_dataset_id), if it was")
    evaluation_error: str | None = Field(default=None, description="why the round's evaluation failed, if it did")
    secure_aggregation: SecAggSummary | None = Field(
        default=None, description="what secure aggregation did in the round (the stage reached, who took part at "
                                  "each stage, the threshold); null for a round aggregated in the clear")
    evaluation_shards: dict[int, dict[str, float]] | None = Field(
        default=None, description="a personal-layers job: each shard's personalised model (the global model with "
                                  "its personal layers) scored on its own held-out data; `evaluation` is their "
                                  "num_samples-weighted mean")


class ShardProgress(BaseModel):
    """One shard of the current round: which worker has it and how far it got."""

    shard: int
    worker_id: str | None
    state: str = Field(
        description="assigned, training, reported, failed, rejected, offline, or stopped (the job ended first)")
    step: int | None
    metrics: dict[str, float] = Field(description="the latest metrics the worker reported")
    error: str | None
    updated_at: float


class DataShard(BaseModel):
    """What one shard of the job's dataset holds, as the sharder split it."""

    shard: int
    num_samples: int
    labels: dict[str, int] | None = Field(description="samples per label, where the dataset's samples have one")


class ForgedReport(BaseModel):
    """A worker report that did not come from the shard's assigned worker: recorded, never applied."""

    round: int | None
    attempt: int | None
    shard: int | None
    worker_id: str | None = Field(description="the worker the report claims to come from")
    routing_key: str
    reason: str = Field(description="why it is forged: a wrong or missing secret, another worker's broker user")
    ts: float


class CodeView(BaseModel):
    """A job's code bundle, as its request named it."""

    key: str | None = Field(description="code/<sha256>.zip in storage")
    sha256: str | None
    size: int | None = Field(description="the zip's bytes, where the request gave them")
    entrypoint: str | None = Field(description="module:function, resolved inside the bundle")


class ShardStateView(BaseModel):
    """What a job keeps between rounds besides its weights: each shard's state and the server state workers get."""

    bytes_per_shard: dict[int, int] = Field(description="each shard's latest stored state, in bytes")
    total_bytes: int = Field(description="the shards' latest states together, in bytes")
    server_state_bytes: int | None = Field(description="the strategy's state every worker downloads each round "
                                           "(SCAFFOLD's control variate), in bytes; null if none")
class StalenessCount(BaseModel):
    """How many folded updates were this many versions stale."""

    staleness: int = Field(description="versions made between an update's start and its fold")
    count: int = Field(description="updates folded with that staleness")


class WorkerRate(BaseModel):
    """One worker's updates in an async job."""

    worker_id: str = Field(description="the worker")
    updates: int = Field(description="its updates folded into versions")
    per_minute: float = Field(description="its updates per minute over the job's folding time")
    mean_staleness: float = Field(description="the mean staleness of its updates")


class AsyncTask(BaseModel):
    """A training task of an async job that is out now."""

    round: int = Field(description="the version open when it went out (it trains from version round - 1)")
    attempt: int = Field(description="the task's number within the job")
    shard: int = Field(description="the shard it trains")
    worker_id: str | None = Field(description="the worker training it, once one took it")
    state: str = Field(description="assigned or training")
    updated_at: float = Field(description="when its state last changed")


class AsyncView(BaseModel):
    """An async (FedBuff) job's versions at a glance."""

    buffer_size: int = Field(description="updates folded into each version (K)")
    concurrency: int = Field(description="shards training at once")
    staleness_weight: str = Field(description="constant, polynomial or hinge")
    max_staleness: int | None = Field(description="updates staler than this are rejected (none: no limit)")
    versions: int = Field(description="versions made so far")
    updates: int = Field(description="updates folded so far")
    staleness_histogram: list[StalenessCount] = Field(description="the folded updates by staleness")
    workers: list[WorkerRate] = Field(description="each worker's update rate")
    tasks: list[AsyncTask] = Field(description="the training tasks out now, newest first (at most 100)")


class JobDetail(BaseModel):
    """Everything known about one job."""

    job_id: str
    name: str | None
    status: str
    round: int
    attempt: int
    num_rounds: int | None
    num_shards: int | None
    reason: str | None
    errors: list[FieldError] = Field(description="each bad field, when the request was rejected")
    strategy: str | None = Field(description="the aggregation strategy, by its registered name")
    strategy_params: dict[str, Any] = Field(description="the strategy's parameters, as the request gave them")
    code: CodeView | None = Field(None, description="the job's code bundle, if it ships one")
    split: dict[str, Any] | None = Field(
        None, description="how the dataset is split (strategy random, label_skew, quantity_skew or group; seed, ...)")
    data_shards: list[DataShard] = Field(
        default_factory=list, description="each shard's sample count and label histogram, once the job is sharded")
    final_model: str | None
    metrics: dict[str, float]
    created_at: float
    updated_at: float
    rounds: list[RoundView]
    shards: list[ShardProgress] = Field(description="per-worker progress within the current round")
    progress: dict[str, int] = Field(description="how many shards of the current round are in each state")
    reported: list[str | None] = Field(description="workers that reported in the current round")
    training: list[str | None] = Field(description="workers still training in the current round")
    shard_state: ShardStateView | None = Field(None, description="state kept with each shard between rounds "
                                               "(SCAFFOLD, personal layers); null for a job that keeps none")
    forged: list[ForgedReport] = Field(default_factory=list,
                                       description="reports for this job refused as forged, the latest 100 first")
    asynchronous: AsyncView | None = Field(None, description="mode async: versions, staleness and update rates "
                                           "(rounds are versions; none for a synchronous job)")


class MetricPoint(BaseModel):
    """One reported value: x is seconds since the job was requested, y the value."""

    x: float
    y: float
    seq: int
    round: int
    attempt: int
    shard: int
    step: int | None


class WorkerSeries(BaseModel):
    """One worker's curve."""

    worker_id: str
    points: list[MetricPoint]


class RoundPoint(BaseModel):
    """The aggregated value after one round: x is the round."""

    x: int
    y: float
    attempt: int


class RoundMark(BaseModel):
    """When a round attempt started, on the per-worker curves' x axis."""

    round: int
    attempt: int
    x: float


class JobMetrics(BaseModel):
    """One metric of a job as chart series."""

    job_id: str
    metric: str
    names: list[str] = Field(description="every metric name the workers reported")
    cursor: int = Field(description="pass as `after` to get only later points")
    workers: list[WorkerSeries]
    rounds: list[RoundPoint]
    round_marks: list[RoundMark]
    evaluations: dict[str, list[RoundPoint]] = Field(
        default_factory=dict, description="each evaluation metric after each evaluated round (x = round)")


class Assignment(BaseModel):
    """What a worker is training now."""

    job_id: str
    round: int | None
    shard: int | None


class GpuReading(BaseModel):
    """A GPU's utilisation (percent) and memory (bytes), read through NVML on the worker."""

    model_config = ConfigDict(extra="allow")

    index: int | None = None
    name: str | None = None
    utilization: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    process_memory_used: int | None = Field(
        default=None, description="bytes the worker's training process holds on this GPU (None: unknown)")


class WorkerView(BaseModel):
    """One worker as the tracker last heard of it."""

    worker_id: str
    hostname: str | None
    kind: str | None = Field(default=None, description="own (the user's machine) or platform (ours), as the worker"
                             " declared it when it started; null: undeclared")
    status: str = Field(description="online or offline")
    state: str | None = Field(description="idle, training or stopped")
    last_heartbeat: float = Field(description="when the tracker last heard from the worker")
    seconds_since_heartbeat: float
    assignment: Assignment | None
    gpu: GpuReading | None = Field(description="null where the worker has no GPU (never faked)")
    samples_per_s: float | None = Field(description="training throughput of its latest shard")
    first_seen: float


def dump(model: type[BaseModel], value: Any) -> str:
    """Validate a view against its response model and return its JSON."""
    return model.model_validate(value).model_dump_json()
