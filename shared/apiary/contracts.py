"""Bus messages: one pydantic model per routing key, msgpack on the wire, with a schema version."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from apiary.jobspec import FieldError, JobSpec
from apiary.jobspec_async import AsyncConfig
from apiary.policy import LIMITS
from apiary.privacy import DifferentialPrivacy
from apiary.strategies import DEFAULT_STRATEGY
from apiary.strategies.format import UpdateFormat

SCHEMA_VERSION = 1
JOB_ID_PATTERN = r"^[\w.\-]+$"  # a client-chosen job id: letters, digits, _ . -
MSGPACK = "application/msgpack"
JSON = "application/json"


class DecodeError(ValueError):
    """A message body that is not a valid event for its routing key."""


class Message(BaseModel):
    """Base of every bus message: its routing key, schema version and time of sending."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    routing_key: ClassVar[str] = ""

    v: int = SCHEMA_VERSION
    ts: float = Field(default_factory=time.time)


class Event(Message):
    """A message about a job: names it (and its round, where it has one) at the top level."""

    job_id: str


class RoundEvent(Event):
    """An event about one attempt of one round."""

    round: int
    attempt: int = 1


class ObjectRef(BaseModel):
    """A claim check: where bytes live in storage, how big they are and their sha256."""

    model_config = ConfigDict(frozen=True)

    key: str
    size: int
    sha256: str


class JobRequested(JobSpec):
    """`job.requested`: the public job request, optionally with a client-chosen job id."""

    routing_key: ClassVar[str] = "job.requested"

    v: int = Field(default=SCHEMA_VERSION, description="the message schema's version")
    job_id: str | None = Field(default=None, min_length=1, max_length=100, pattern=JOB_ID_PATTERN,
                               description="a job id of the client's choosing, echoed by every event of the job "
                               "(default: a new one)")


class JobAccepted(Event):
    """`job.accepted`: the scheduler accepted a job request; it will be split into `num_shards` shards."""

    routing_key: ClassVar[str] = "job.accepted"
    name: str
    num_rounds: int
    num_shards: int


class JobRejected(Event):
    """`job.rejected`: the scheduler refused a job request: `reason` in one line, `errors` one per bad field."""

    routing_key: ClassVar[str] = "job.rejected"
    reason: str
    errors: list[FieldError] = Field(default_factory=list)


# A registry id as text, as the services store it: a request's integer 42 travels as "42".
IdText = Annotated[str, BeforeValidator(lambda value: str(value) if isinstance(value, int) else value)]


class ShardRequested(Event):
    """`shard.requested`: the scheduler asks the sharder to split a job's dataset into `num_shards` shards."""

    routing_key: ClassVar[str] = "shard.requested"
    dataset: str | None = None
    dataset_id: IdText | None = None  # a registered dataset: "42" (older ones a hex string)
    num_shards: int
    strategy: str = "random"
    seed: int = 0
    alpha: float = 0.5
    group_key: str = "group"


class ShardInfo(ObjectRef):
    """One stored shard of a job's dataset."""

    index: int
    num_samples: int
    # How many of its samples carry each label (as text), where the dataset's samples have one.
    labels: dict[str, int] | None = None


class JobSharded(Event):
    """`job.sharded`: the sharder stored a job's shards (or says why it could not, in `error`)."""

    routing_key: ClassVar[str] = "job.sharded"
    dataset_id: IdText | None = None
    shards: list[ShardInfo] = Field(default_factory=list)
    error: str | None = None


class RoundStart(RoundEvent):
    """`round.start`: a round (attempt) begins from `weights`, over `shards`, due at `deadline`."""

    routing_key: ClassVar[str] = "round.start"
    num_rounds: int
    shards: list[int]
    min_workers: int
    weights: ObjectRef
    deadline: float
    update_format: UpdateFormat = UpdateFormat.FULL
    # The aggregation strategy by registered name, and its parameters (checked by the strategy).
    strategy: str = DEFAULT_STRATEGY
    strategy_params: dict[str, Any] = Field(default_factory=dict)
    # Central differential privacy around the strategy (resolved: num_sampled_clients set), if the job asks for it.
    differential_privacy: DifferentialPrivacy | None = None
    # Per shard, the sha256 of its assignment's one-time secret and of the progress token derived from it
    # (apiary.proof): a report proves it comes from the assignment's worker by presenting what hashes to them.
    secret_digests: dict[int, str] = Field(default_factory=dict)
    progress_digests: dict[int, str] = Field(default_factory=dict)
    # Mode async (FedBuff): the round is a version's buffer, closed at `buffer_size` updates, whichever tasks
    # they come from (each announced by `round.assigned`); None: a synchronous round.
    asynchronous: AsyncConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_use_peft(cls, data: Any) -> Any:
        # Before update_format, adapter-only rounds said `use_peft: true`; such messages still decode.
        if isinstance(data, dict) and "use_peft" in data and "update_format" not in data:
            data = {**data, "update_format": UpdateFormat.of(adapter_only=bool(data["use_peft"]))}
        return data


class ModelRef(BaseModel):
    """A registered base model a built-in trainer starts from: where a worker fetches it (presigned), how to
    check it, and what it is (`hf`: a zipped Hugging Face model folder; `gguf`: one GGUF file)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_id: int
    url: str
    sha256: str
    size: int
    format: Literal["hf", "gguf", "safetensors"]
    filename: str


# What an assignment asks of its worker: train a shard for a round, make the job's initial weights
# (`fl_init_weights`, or a built-in job's base weights) or evaluate a round's global weights (`fl_evaluate_model`),
# or merge a built-in job's final adapter into its base model. User code and base models load only on workers.
TaskKind = Literal["train", "init", "evaluate", "merge"]
TRAIN: Literal["train"] = "train"
INIT: Literal["init"] = "init"
EVALUATE: Literal["evaluate"] = "evaluate"
MERGE: Literal["merge"] = "merge"


class CodeBundle(BaseModel):
    """A job's code bundle as an assignment carries it: its key, sha256 and size, and a presigned GET URL."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    key: str
    sha256: str
    size: int
    url: str


class Assignment(RoundEvent):
    """`assign.pool`, `assign.worker.<id>` or `assign.prefer.<id>`: train one shard for one round (or, by
    `task`, make the job's initial weights, evaluate a round's global weights or merge the final adapter into
    the base model; those name no shard)."""

    routing_key: ClassVar[str] = "assign.pool"
    task: TaskKind = TRAIN
    job_name: str
    num_rounds: int
    shard: int = 0
    num_shards: int = 0
    shard_num_samples: int = 0
    shard_url: str = ""
    shard_sha256: str = ""
    weights_url: str = ""  # evaluate: the weights to evaluate; merge: the adapter to merge; init: none
    weights_sha256: str = ""
    upload_url: str = ""  # init: where the initial weights go; merge: the merged model's zip; evaluate: none
    result_key: str = ""
    files_upload_url: str | None = None
    entrypoint: str | None = None  # None: the job runs a built-in trainer (see `trainer`)
    trainer: str | None = None  # the built-in trainer's name, for a job without an entrypoint
    base_model: ModelRef | None = None  # what a built-in trainer starts from
    env: dict[str, Any]
    deadline: float
    pinned_worker: str | None = None
    issued_at: float | None = None  # when the round started (the scheduler's clock)
    # The job's end marker (keys.job_ended), for a worker that may have missed the job's end.
    ended_url: str | None = None
    # The job's code bundle (first on the training child's sys.path), and the requirements the worker must
    # meet (None: the bundle's requirements.txt, if any).
    code: CodeBundle | None = None
    requirements: list[str] | None = None
    # The one-time secret its worker.done / worker.failed must present (only ever in the assignment itself).
    secret: str | None = None
    # Seconds between the worker's heartbeats, stretched for a large fleet (apiary.pace); None: its own setting.
    heartbeat_interval: float | None = Field(default=None, gt=0)
    # Differential privacy with clip_on worker: the L2 norm the worker clips its update to before upload.
    clipping_norm: float | None = Field(default=None, gt=0)


class WorkerProgress(RoundEvent):
    """`worker.progress`: a worker's live metrics while it trains a shard."""

    routing_key: ClassVar[str] = "worker.progress"
    worker_id: str
    shard: int
    metrics: dict[str, float] = Field(default_factory=dict)
    step: int | None = None
    samples_per_s: float | None = None
    token: str = ""  # the assignment's progress token (apiary.proof.progress_token)


class WorkerDone(RoundEvent):
    """`worker.done`: a worker trained its shard; `result` is the claim check of its weights."""

    routing_key: ClassVar[str] = "worker.done"
    worker_id: str
    shard: int
    result: ObjectRef
    samples: int
    metrics: dict[str, float] = Field(default_factory=dict)
    duration_s: float = 0.0
    secret: str = ""  # the assignment's one-time secret


class WorkerFailed(RoundEvent):
    """`worker.failed`: a worker could not train its shard; `error` says why in one line."""

    routing_key: ClassVar[str] = "worker.failed"
    worker_id: str
    shard: int
    error: str
    secret: str = ""  # the assignment's one-time secret


class RoundTimeout(RoundEvent):
    """`round.timeout` (delayed): a round's deadline; the aggregator closes it with what it has."""

    routing_key: ClassVar[str] = "round.timeout"


class FoldedUpdate(BaseModel):
    """One update a version of an async job folded: its task, its worker, and how stale it was."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    shard: int
    round: int  # the task's round: it trained from version round - 1
    attempt: int  # the task's number within the job
    worker_id: str
    samples: int
    staleness: int  # versions made between its start and its fold
    weight: float  # its staleness weight g(staleness)
    duration_s: float = 0.0  # its worker's training time


class RoundAssigned(RoundEvent):
    """`round.assigned`: mode async: one training task was handed out (its shard trains from version round - 1;
    `attempt` numbers the job's tasks); the aggregator judges the task's report by the secret's digest here."""

    routing_key: ClassVar[str] = "round.assigned"
    shard: int
    weights: ObjectRef  # the global version the task trains from
    secret_digest: str
    progress_digest: str = ""


class RoundAggregated(RoundEvent):
    """`round.aggregated`: the aggregator folded a round's contributions into new global `weights`."""

    routing_key: ClassVar[str] = "round.aggregated"
    weights: ObjectRef
    contributors: list[int]
    total_samples: int
    metrics: dict[str, float] = Field(default_factory=dict)
    rejected: dict[str, str] = Field(default_factory=dict)
    # Which worker trained each accepted shard: the next round prefers it for that shard.
    trained_by: dict[int, str] = Field(default_factory=dict)
    # Mode async: each update the version folded, in folding order (empty for a synchronous round), and the W3C
    # traceparent of the next version, opened with this one's close (its round span: the scheduler records it).
    folded: list[FoldedUpdate] = Field(default_factory=list)
    next_traceparent: str | None = None


class RoundFailed(RoundEvent):
    """`round.failed`: a round could not be aggregated (too few valid contributions by its deadline)."""

    routing_key: ClassVar[str] = "round.failed"
    reason: str
    reported: int = 0
    required: int = 0


class WeightsInitialized(Event):
    """`worker.initialized`: a worker ran the job's `fl_init_weights` (an init assignment); its weights, stored,
    are round 1's. `found` False: the module defines no fl_init_weights; `error`: the user's code failed."""

    routing_key: ClassVar[str] = "worker.initialized"
    attempt: int = 1
    worker_id: str
    weights: ObjectRef | None = None
    found: bool = True
    error: str | None = None
    secret: str = ""  # the init assignment's one-time secret


class RoundEvaluated(RoundEvent):
    """`round.evaluated`: the scheduler recorded a round's evaluation, from the `worker.evaluated` of the worker
    its evaluate assignment went to; its metrics are the round's evaluation metrics. `error`: the user's code
    failed (the round still counts); `found` False: the module defines no fl_evaluate_model (the job's rounds
    are not evaluated)."""

    routing_key: ClassVar[str] = "round.evaluated"
    worker_id: str
    metrics: dict[str, float] = Field(default_factory=dict)
    found: bool = True
    error: str | None = None


class WorkerEvaluated(RoundEvaluated):
    """`worker.evaluated`: a worker evaluated a round's global weights (`fl_evaluate_model`, an evaluate
    assignment); the scheduler checks that it comes from the assignment's worker, then announces `round.evaluated`."""

    routing_key: ClassVar[str] = "worker.evaluated"
    secret: str = ""  # the evaluate assignment's one-time secret


class ReportForged(Event):
    """`report.forged`: the scheduler refused a worker's task report (`report`, its routing key) as not from the
    worker the task was assigned to; recorded, never applied."""

    routing_key: ClassVar[str] = "report.forged"
    round: int | None = None
    attempt: int | None = None
    worker_id: str
    report: str
    reason: str


class AdapterMerged(RoundEvent):
    """`worker.merged`: a worker merged a built-in job's final adapter (round `round`'s) into the base model (a
    merge assignment); `merged` is the zipped Hugging Face model folder it uploaded, `error` why it could not."""

    routing_key: ClassVar[str] = "worker.merged"
    worker_id: str
    merged: ObjectRef | None = None
    error: str | None = None
    secret: str = ""  # the merge assignment's one-time secret


class TaskTimeout(RoundEvent):
    """`task.timeout` (delayed): an init, evaluate or merge assignment's time is up; if it has not reported, the
    scheduler stops waiting for it."""

    routing_key: ClassVar[str] = "task.timeout"
    task: TaskKind = EVALUATE


class JobCompleted(Event):
    """`job.completed`: a job ended with its final model (after its last round, or stopped early)."""

    routing_key: ClassVar[str] = "job.completed"
    rounds_completed: int
    final_model: str
    metrics: dict[str, float] = Field(default_factory=dict)
    reason: str | None = None  # why it ended before its last round (early stopping), or an evaluation error
    best_round: int | None = None  # the round whose weights are the final model (keep_best), if not the last


class JobFailed(Event):
    """`job.failed`: a job ended without completing: failed (`reason`), or cancelled."""

    routing_key: ClassVar[str] = "job.failed"
    reason: str
    round: int | None = None
    cancelled: bool = False  # it ended because someone cancelled it, not because something failed


class JobWaiting(Event):
    """`job.waiting`: a round cannot start yet (too few workers online); the job waits."""

    routing_key: ClassVar[str] = "job.waiting"
    reason: str
    round: int
    online: int
    required: int


class JobCancelRequested(Event):
    """`job.cancel`: stop a job; no further round starts and its workers stop training it."""

    routing_key: ClassVar[str] = "job.cancel"
    reason: str = "cancelled by user"


class WorkerPresence(Message):
    """Base of a worker's presence events; they name no job."""

    worker_id: str


class WorkerOnline(WorkerPresence):
    """`worker.online`: a worker started and takes assignments."""

    routing_key: ClassVar[str] = "worker.online"
    hostname: str = ""
    gpu: dict[str, Any] | None = None
    kind: str | None = None  # "own" (the user's machine) or "platform" (ours); None: undeclared


class WorkerHeartbeat(WorkerPresence):
    """`worker.heartbeat`: a worker is alive, and what it is doing."""

    routing_key: ClassVar[str] = "worker.heartbeat"
    state: str = "idle"
    job_id: str | None = None
    round: int | None = None
    shard: int | None = None
    gpu: dict[str, Any] | None = None
    samples_per_s: float | None = None
    kind: str | None = None  # as declared in worker.online
    token: str | None = None  # the progress token of the assignment it trains, if any
    interval: float | None = None  # seconds until its next beat (apiary.pace); None: the services' setting


class WorkerOffline(WorkerPresence):
    """`worker.offline`: a worker stopped (or was taken as gone)."""

    routing_key: ClassVar[str] = "worker.offline"
    reason: str = "stopped"


class PresencePace(Message):
    """`presence.pace`: how often workers beat now, for the fleet online (apiary.pace): every `interval` seconds,
    offline after `offline_after`; sent by the scheduler to every worker when the pace changes."""

    routing_key: ClassVar[str] = "presence.pace"
    factor: float = Field(ge=1.0)
    interval: float = Field(gt=0)
    offline_after: float = Field(gt=0)
    workers: int = Field(ge=0)


def pace_key(worker_id: str) -> str:
    """The routing key of the pace told to one worker that beats faster than the fleet's pace (it joined after the
    announcement, or missed it): `presence.pace.<worker id>`, bound by that worker's control queue alone."""
    return f"{PresencePace.routing_key}.{worker_id}"


AnyEvent = Event | WorkerPresence | JobRequested
E = TypeVar("E", bound=BaseModel)

EVENT_TYPES: dict[str, type[BaseModel]] = {
    cls.routing_key: cls
    for cls in (
        JobRequested, JobAccepted, JobRejected, ShardRequested, JobSharded, RoundStart,
        WorkerProgress, WorkerDone, WorkerFailed, RoundTimeout, RoundAggregated, RoundFailed,
        JobCompleted, JobFailed, JobWaiting, JobCancelRequested, WorkerOnline, WorkerHeartbeat, WorkerOffline,
        WeightsInitialized, RoundEvaluated, WorkerEvaluated, ReportForged, AdapterMerged, TaskTimeout,
        PresencePace,
    )
}
EVENT_TYPES[RoundAssigned.routing_key] = RoundAssigned  # mode async's task announcements


def model_for(routing_key: str) -> type[BaseModel]:
    """The model for a routing key (`assign.*` keys all carry an Assignment, `presence.pace.*` a PresencePace)."""
    if routing_key.startswith("assign."):
        return Assignment
    if routing_key.startswith(f"{PresencePace.routing_key}."):
        return PresencePace
    try:
        return EVENT_TYPES[routing_key]
    except KeyError:
        raise DecodeError(f"no message type for routing key {routing_key!r}") from None


def encode(event: BaseModel) -> bytes:
    """Serialise an event to msgpack."""
    return msgpack.packb(event.model_dump(mode="json"), use_bin_type=True)


def decode_body(body: bytes, content_type: str | None = MSGPACK) -> dict[str, Any]:
    """Decode a msgpack or JSON body into a dict, or raise DecodeError."""
    if len(body) > LIMITS.message_bytes:
        raise DecodeError(f"body is {len(body)} bytes, over the limit of {LIMITS.message_bytes} (weights and data"
                          " travel by storage key, never on the bus)")
    try:
        if content_type and "json" in content_type:
            data = json.loads(body)
        else:
            data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise DecodeError(f"body is not valid {content_type or MSGPACK}: {e}") from e
    if not isinstance(data, dict):
        raise DecodeError(f"body must be a map, got {type(data).__name__}")
    version = data.get("v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DecodeError(f"schema version {version!r} is not supported (expected {SCHEMA_VERSION})")
    return data


def validate(routing_key: str, data: dict[str, Any]) -> BaseModel:
    """The model its routing key names, from a decoded body (`decode_body`), or raise DecodeError."""
    cls = model_for(routing_key)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise DecodeError(f"{routing_key} message is malformed: {e.errors()[0]['msg']} "
                          f"at {'.'.join(map(str, e.errors()[0]['loc']))}") from e


def decode(routing_key: str, body: bytes, content_type: str | None = MSGPACK) -> BaseModel:
    """Decode a message into the model its routing key names, or raise DecodeError."""
    model_for(routing_key)  # a key no model has is refused before its body is read
    return validate(routing_key, decode_body(body, content_type))
