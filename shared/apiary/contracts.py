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
from apiary.secagg.settings import SecureAggregation
from apiary.strategies import DEFAULT_STRATEGY
from apiary.strategies.format import UpdateFormat
from apiary.wire_settings import TransferSettings

SCHEMA_VERSION = 1
JOB_ID_PATTERN = r"^[\w.\-]+$"  # a client-chosen job id: letters, digits, _ . -
MSGPACK = "application/msgpack"
JSON = "application/json"


class DecodeError(ValueError):
    """A message body that is not a valid event for its routing key."""


class Message(BaseModel):
    """Base of every bus message: its routing key, schema version and time of sending."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)
    routing_key: ClassVar[str] = ""

    v: int = SCHEMA_VERSION
    """The message schema's version (now 1): a consumer refuses a body of another version."""
    ts: float = Field(default_factory=time.time)
    """When the sender made the message: Unix time in seconds, by the sender's clock."""


class Event(Message):
    """A message about a job: names it (and its round, where it has one) at the top level."""

    job_id: str
    """The job it is about: the id its request chose, else the one the scheduler gave it on `job.requested`."""


class RoundEvent(Event):
    """An event about one attempt of one round."""

    round: int
    """The round, from 1; 0 for the tasks before the first (init, the starting model's evaluation)."""
    attempt: int = 1
    """Which try of the round or task: 1, one more each time the scheduler retries it after a failure."""


class ObjectRef(BaseModel):
    """A claim check: where bytes live in storage, how big they are and their sha256."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    key: str
    """The object's key in the platform's storage (a job's objects under `jobs/JOB/`), not a URL."""
    size: int
    """The object's size in bytes."""
    sha256: str
    """The object's SHA-256 in hex: whoever fetches the bytes checks them against it."""
    # The object's ETag where it was uploaded in parts whose MD5 the store verified (S3's md5-of-md5s-N): a reader
    # that gets these bytes only while the object still has this ETag (If-Match) need not hash them again.
    etag: str | None = None
    """The object's ETag where it was uploaded in parts whose MD5 the store verified; a reader that gets the bytes
    under this ETag (If-Match) need not hash them again. None: a single PUT, checked by its sha256."""


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
    """The job's name, from its request."""
    num_rounds: int
    """How many rounds the job runs (its request's `distributed.num_rounds`)."""
    num_shards: int
    """How many shards its dataset is split into: one per pinned worker, else `distributed.max_workers`."""


class JobRejected(Event):
    """`job.rejected`: the scheduler refused a job request: `reason` in one line, `errors` one per bad field."""

    routing_key: ClassVar[str] = "job.rejected"
    reason: str
    """Why the request was refused, in one line."""
    errors: list[FieldError] = Field(default_factory=list)
    """One entry per bad field of the request; empty where the refusal is about no one field."""


# A registry id as text, as the services store it: a request's integer 42 travels as "42".
IdText = Annotated[str, BeforeValidator(lambda value: str(value) if isinstance(value, int) else value)]


class ShardRequested(Event):
    """`shard.requested`: the scheduler asks the sharder to split a job's dataset into `num_shards` shards."""

    routing_key: ClassVar[str] = "shard.requested"
    dataset: str | None = None
    """The request's dataset: a path or storage URI (folder, zip or JSONL); None: `dataset_id` names it."""
    dataset_id: IdText | None = None  # a registered dataset: "42" (older ones a hex string)
    """The request's registered dataset as text (`"42"`, older ones hex); None: `dataset` names it."""
    num_shards: int
    """How many shards to write: one per pinned worker, else `distributed.max_workers`."""
    strategy: str = "random"
    """How to split (the request's `split.strategy`): `random`, `label_skew`, `quantity_skew` or `group`."""
    seed: int = 0
    """The split's seed (the request's `split.seed`): the same seed splits the same dataset the same way."""
    alpha: float = 0.5
    """The Dirichlet concentration for `label_skew` and `quantity_skew` (the request's `split.alpha`)."""
    group_key: str = "group"
    """The sample field that names a sample's group, for `group` (the request's `split.key`)."""


class ShardInfo(ObjectRef):
    """One stored shard of a job's dataset."""

    index: int
    """The shard's number, from 0: assignments, `round.start` and reports name shards by it."""
    num_samples: int
    """How many samples the shard holds."""
    # How many of its samples carry each label (as text), where the dataset's samples have one.
    labels: dict[str, int] | None = None
    """How many of its samples carry each label (the label as text); None where the samples have no label."""


class JobSharded(Event):
    """`job.sharded`: the sharder stored a job's shards (or says why it could not, in `error`)."""

    routing_key: ClassVar[str] = "job.sharded"
    dataset_id: IdText | None = None
    """The registered dataset the shards come from, as text; None for a dataset given by path or URI."""
    shards: list[ShardInfo] = Field(default_factory=list)
    """The stored shards, in index order; empty when `error` says why there are none."""
    error: str | None = None
    """Why the dataset could not be split, in one line (the scheduler fails the job with it); None on success."""


class RoundStart(RoundEvent):
    """`round.start`: a round (attempt) begins from `weights`, over `shards`, due at `deadline`."""

    routing_key: ClassVar[str] = "round.start"
    num_rounds: int
    """How many rounds the job runs in all."""
    shards: list[int]
    """The shards this round trains, by index: the contributions the aggregator waits for."""
    min_workers: int
    """The fewest valid contributions the round may be aggregated from; with fewer it fails."""
    weights: ObjectRef
    """The global weights the round starts from; contributions are checked against their shapes."""
    deadline: float
    """When the round times out: Unix time in seconds, by the scheduler's clock."""
    update_format: UpdateFormat = UpdateFormat.FULL
    """What a contribution holds: the full weights, or only a built-in job's adapter weights."""
    # The aggregation strategy by registered name, and its parameters (checked by the strategy).
    strategy: str = DEFAULT_STRATEGY
    """The aggregation strategy, by registered name (the request's `distributed.strategy`)."""
    strategy_params: dict[str, Any] = Field(default_factory=dict)
    """The strategy's parameters (the request's `distributed.strategy_params`), checked by the strategy."""
    # Central differential privacy around the strategy (resolved: num_sampled_clients set), if the job asks for it.
    differential_privacy: DifferentialPrivacy | None = None
    """Central differential privacy the aggregator applies around the strategy; None: none."""
    # Per shard, the sha256 of its assignment's one-time secret and of the progress token derived from it
    # (apiary.proof): a report proves it comes from the assignment's worker by presenting what hashes to them.
    secret_digests: dict[int, str] = Field(default_factory=dict)
    """Per shard, the SHA-256 (hex) of its assignment's secret: a report's `secret` must hash to it."""
    progress_digests: dict[int, str] = Field(default_factory=dict)
    """Per shard, the SHA-256 (hex) of its progress token: a progress report's `token` must hash to it."""
    # Secure aggregation (apiary.secagg), if the job asks for it, and each shard's Ed25519 verify key (hex), which
    # the shard's worker signs its protocol keys with (its signing key derives from the assignment's secret).
    secure_aggregation: SecureAggregation | None = None
    """The job's secure aggregation settings (apiary.secagg); None: contributions are aggregated in the clear."""
    secagg_verify_keys: dict[int, str] = Field(default_factory=dict)
    """Per shard, the Ed25519 verify key (hex) its worker signs its protocol keys with; empty without secure
    aggregation."""
    # Mode async (FedBuff): the round is a version's buffer, closed at `buffer_size` updates, whichever tasks
    # they come from (each announced by `round.assigned`); None: a synchronous round.
    asynchronous: AsyncConfig | None = None
    """Mode async (FedBuff): the job's resolved async settings, the round being a version's buffer; None: a
    synchronous round."""

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

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    model_id: int
    """The model's id in the registry (`apiary model add`)."""
    url: str
    """A presigned GET URL of the stored model, valid until a while after the task's deadline."""
    sha256: str
    """The stored model's SHA-256 in hex: the worker checks the download against it."""
    size: int
    """The stored model's size in bytes."""
    format: Literal["hf", "gguf", "safetensors"]
    """How it is stored: `hf` a zipped Hugging Face folder, `gguf` or `safetensors` one such file."""
    filename: str
    """The file name it was registered with; the worker's model cache keeps it under that name."""


# What an assignment asks of its worker: train a shard for a round, make the job's initial weights
# (`fl_init_weights`, or a built-in job's base weights) or evaluate a round's global weights (`fl_evaluate_model`),
# or merge a built-in job's final adapter into its base model. User code and base models load only on workers.
TaskKind = Literal["train", "init", "evaluate", "merge"]
TRAIN: Literal["train"] = "train"
INIT: Literal["init"] = "init"
EVALUATE: Literal["evaluate"] = "evaluate"
MERGE: Literal["merge"] = "merge"
WAIT: Literal["wait"] = "wait"  # task.timeout only: a mode-async worker's wait for a due version is up


class CodeBundle(BaseModel):
    """A job's code bundle as an assignment carries it: its key, sha256 and size, and a presigned GET URL."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    key: str
    """The bundle's storage key (`code/SHA256.zip`: content-addressed, so the same code is stored once)."""
    sha256: str
    """The bundle's SHA-256 in hex: the worker checks the download against it, and caches bundles by it."""
    size: int
    """The bundle's size in bytes (0 where the request did not say)."""
    url: str
    """A presigned GET URL of the bundle, valid until a while after the assignment's deadline."""


class MultipartUpload(BaseModel):
    """A multipart upload the scheduler opened for an assignment's result, presigned part by part: the worker PUTs
    each part (with its Content-MD5, which the store verifies), lists what is already stored to resume, and
    completes it; the scheduler aborts what is left incomplete once the round ends."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    upload_id: str
    """The store's id of the multipart upload."""
    part_size: int = Field(gt=0)
    """Bytes per part (the last one may be shorter)."""
    part_urls: list[str]  # part N (from 1) at part_urls[N - 1]
    """Presigned PUT URL of each part: part N (from 1) at index N - 1."""
    complete_url: str  # POST: the parts' list completes the object
    """Presigned POST URL that completes the object from the list of its parts."""
    list_url: str  # GET: the parts stored so far (a resumed upload skips those whose MD5 matches)
    """Presigned GET URL listing the parts stored so far (a resumed upload skips those whose MD5 matches)."""


class Assignment(RoundEvent):
    """`assign.pool`, `assign.worker.<id>` or `assign.prefer.<id>`: train one shard for one round (or, by
    `task`, make the job's initial weights, evaluate a round's global weights or merge the final adapter into
    the base model; those name no shard)."""

    routing_key: ClassVar[str] = "assign.pool"
    task: TaskKind = TRAIN
    """What to do: `train` a shard, `init` the weights, `evaluate` a round's weights, `merge` the adapter."""
    job_name: str
    """The job's name, from its request: the user's code sees it (with the job id) as `job.name`."""
    num_rounds: int
    """How many rounds the job runs in all."""
    shard: int = 0
    """The shard to train, by index (0 for a task, which trains none)."""
    num_shards: int = 0
    """How many shards the job's dataset has (0 for a task): the user's code sees it with the shard's facts."""
    shard_num_samples: int = 0
    """How many samples the shard (a built-in evaluate: the held-out dataset) holds; else 0."""
    shard_url: str = ""
    """A presigned GET URL of the shard (a built-in evaluate: the held-out dataset); else empty."""
    shard_sha256: str = ""
    """The shard's SHA-256 in hex: the worker checks and caches the download by it; else empty."""
    weights_url: str = ""  # evaluate: the weights to evaluate; merge: the adapter to merge; init: none
    """A presigned GET URL of the weights to train from or evaluate, or the adapter to merge; init: empty."""
    weights_sha256: str = ""
    """The SHA-256 (hex) of the weights at `weights_url`: the worker checks the download against it."""
    weights_size: int = 0  # the weights' bytes (0: not said): a large object downloads by parallel ranged GETs
    """The global weights' size in bytes (0: not said); a large object downloads by parallel ranged GETs."""
    upload_url: str = ""  # init: where the initial weights go; merge: the merged model's zip; evaluate: none
    """A presigned PUT URL for the result: trained or initial weights, the merged zip; evaluate: empty."""
    result_key: str = ""
    """The storage key `upload_url` writes: the worker's report names it; empty for evaluate."""
    files_upload_url: str | None = None
    """A presigned PUT URL for a zip of what the training function wrote to `out_dir`; tasks: None."""
    entrypoint: str | None = None  # None: the job runs a built-in trainer (see `trainer`)
    """The user's training function (`module:function`); None: the job runs the built-in `trainer`."""
    trainer: str | None = None  # the built-in trainer's name, for a job without an entrypoint
    """The built-in trainer's name, for a job without an `entrypoint`; else None."""
    base_model: ModelRef | None = None  # what a built-in trainer starts from
    """The registered model a built-in trainer starts from, presigned; None for user code."""
    env: dict[str, Any]
    """The user's function's `env`: the request's `config` upper-cased, plus `ROUND`, `NUM_ROUNDS` and more."""
    deadline: float
    """When the scheduler stops waiting: Unix time in seconds (its clock); transfers give up then."""
    pinned_worker: str | None = None
    """The worker the request pins the shard or task to; None: any. Read by the scheduler only."""
    issued_at: float | None = None  # when the round started (the scheduler's clock)
    """When the round or task started: Unix time in seconds, by the scheduler's clock."""
    # The job's end marker (keys.job_ended), for a worker that may have missed the job's end.
    ended_url: str | None = None
    """A presigned GET URL of the job's end marker: a worker that may have missed the end reads it."""
    # The job's code bundle (first on the training child's sys.path), and the requirements the worker must
    # meet (None: the bundle's requirements.txt, if any).
    code: CodeBundle | None = None
    """The job's code bundle, first on the training child's `sys.path`; None: no bundle."""
    requirements: list[str] | None = None
    """Packages the worker's Python must provide (checked, not installed); None: the bundle's."""
    # The one-time secret its worker.done / worker.failed must present (only ever in the assignment itself).
    secret: str | None = None
    """The one-time secret the worker's report must present; only ever here (the event log drops it)."""
    # Seconds between the worker's heartbeats, stretched for a large fleet (apiary.pace); None: its own setting.
    heartbeat_interval: float | None = Field(default=None, gt=0)
    """Seconds between heartbeats, stretched for a large fleet (apiary.pace); None: its setting."""
    # Differential privacy with clip_on worker: the L2 norm the worker clips its update to before upload.
    clipping_norm: float | None = Field(default=None, gt=0)
    """The L2 norm the worker clips its update to before upload (DP `clip_on: worker`); else None."""
    # Differential privacy with noise_on worker: the std of the Gaussian noise the worker adds to its clipped update.
    noise_std: float | None = Field(default=None, gt=0)
    """The std of the Gaussian noise the worker adds to its clipped update (DP `noise_on: worker`); else None."""
    # The job's test-only DP seed, made the shard's own for this task (None: noise from the OS's entropy).
    noise_seed: int | None = Field(default=None, ge=0)
    """UNSAFE, tests only: the seed of the worker's noise, from the job's DP `seed`; None: the OS's entropy."""
    # Secure aggregation: the job's settings and every shard's verify key (hex), as round.start carries them.
    secure_aggregation: SecureAggregation | None = None
    """The job's secure aggregation settings (apiary.secagg); None: contributions are aggregated in the clear."""
    secagg_verify_keys: dict[int, str] = Field(default_factory=dict)
    """Per shard, the Ed25519 verify key (hex) its worker signs its protocol keys with; empty without secure
    aggregation."""
    # The job's `distributed.transfer` where it is not the default: how the worker encodes its upload (the global
    # weights' URL already points at their halved copy where the download is halved).
    transfer: TransferSettings | None = None
    """How the worker encodes its upload (delta, half precision, int8 blockwise); None: plain fp32."""
    # Where the result is large: a multipart upload to its result key, presigned part by part (None: one PUT).
    multipart: MultipartUpload | None = None
    """The result's multipart upload, presigned part by part, where the result is large; None: one PUT."""
    # The shard's state (apiary.shard_state), kept with the shard between rounds, and the strategy's shared state.
    state_url: str = Field(default="", description="the shard's latest state (presigned GET); empty in its first round")
    state_sha256: str = Field(default="", description="the sha256 of the shard's latest state")
    state_upload_url: str = Field(default="", description="where this round's state of the shard goes (presigned PUT)")
    state_key: str = Field(default="", description="the storage key state_upload_url writes")
    personal_layers: list[str] = Field(default_factory=list, description="globs of tensor names that stay with "
                                       "the shard (its state) and are never uploaded for aggregation")
    server_state_url: str = Field(default="", description="the strategy's state every worker needs (SCAFFOLD's control "
                                  "variate), presigned GET; empty where there is none")
    server_state_sha256: str = Field(default="", description="the sha256 of the server state")
    asynchronous: bool = False
    """The task belongs to a job in mode async: its report goes out as `worker.done.async` or
    `worker.failed.async` (the scheduler hands out the next task on it); else as `worker.done` / `worker.failed`."""

    @property
    def scores_shard(self) -> bool:
        """Whether this is an evaluate assignment of one shard's personalised model (a personal-layers job), which
        names the shard, its data and its state, rather than of the global model alone."""
        return self.task == EVALUATE and self.num_shards > 0


class WorkerProgress(RoundEvent):
    """`worker.progress`: a worker's live metrics while it trains a shard."""

    routing_key: ClassVar[str] = "worker.progress"
    worker_id: str
    """The worker that trains the shard."""
    shard: int
    """The shard it trains, by index."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The metrics the training function reported at `step` (loss, accuracy, ...), by name."""
    step: int | None = None
    """The training step the metrics are from, as the training function counts; None: it gave none."""
    samples_per_s: float | None = None
    """The worker's training throughput so far, in samples a second; None before it can tell."""
    token: str = ""  # the assignment's progress token (apiary.proof.progress_token)
    """The assignment's progress token (apiary.proof, from its secret): proves the sender; else empty."""


class WorkerDone(RoundEvent):
    """`worker.done` (`worker.done.async` for a task of a job in mode async): a worker trained its shard; `result`
    is the claim check of its weights."""

    routing_key: ClassVar[str] = "worker.done"
    async_routing_key: ClassVar[str] = "worker.done.async"  # a task of a job in mode async (Assignment.asynchronous)
    worker_id: str
    """The worker that trained the shard."""
    shard: int
    """The shard it trained, by index."""
    result: ObjectRef
    """Where its trained weights (the contribution) are stored: the assignment's `result_key`."""
    samples: int
    """How many samples it trained on: the contribution's weight in sample-weighted strategies (FedAvg)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The training function's final metrics by name; the aggregator averages them, weighted by `samples`."""
    duration_s: float = 0.0
    """Seconds the worker spent on the shard, from the start of its downloads to the end of its upload."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the report comes from its worker (the event log drops it)."""
    state: ObjectRef | None = Field(default=None, description="the shard's new state, at the assignment's "
                                    "state_key, if its training returned one")


class WorkerFailed(RoundEvent):
    """`worker.failed` (`worker.failed.async` for a task of a job in mode async): a worker could not train its
    shard; `error` says why in one line."""

    routing_key: ClassVar[str] = "worker.failed"
    async_routing_key: ClassVar[str] = "worker.failed.async"  # a task of a job in mode async
    worker_id: str
    """The worker that failed to train the shard."""
    shard: int
    """The shard it could not train, by index."""
    error: str
    """Why, in one line (the user's code raised, a download or upload failed, ...)."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the report comes from its worker (the event log drops it)."""


class SecAggKeys(RoundEvent):
    """`worker.secagg.keys`: secure aggregation's stage 1, a worker's two X25519 public keys (hex) for its shard,
    signed (Ed25519, hex) with its assignment's signing key."""

    routing_key: ClassVar[str] = "worker.secagg.keys"
    worker_id: str
    """The worker that trains the shard."""
    shard: int
    """The shard whose keys these are, by index."""
    c_public: str
    """X25519 public key (hex) for encrypting the shares sent to this shard."""
    s_public: str
    """X25519 public key (hex) for agreeing the pairwise mask seeds with the other shards."""
    signature: str
    """Ed25519 signature (hex) over the round, shard and both keys, by the shard's signing key."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the message comes from its worker (the event log drops it)."""


class SecAggShare(BaseModel):
    """One encrypted pair of Shamir shares between two shards' workers (hex AES-GCM ciphertext)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    source: int
    """The shard whose worker made and encrypted the shares."""
    destination: int
    """The shard whose worker holds them (only it can decrypt them)."""
    ciphertext: str
    """AES-GCM ciphertext (hex) of the source's shares of its self-mask seed and its mask key."""


class SecAggShares(RoundEvent):
    """`worker.secagg.shares`: secure aggregation's stage 2, a worker's shares for its neighbours, encrypted."""

    routing_key: ClassVar[str] = "worker.secagg.shares"
    worker_id: str
    """The worker that trains the shard."""
    shard: int
    """The shard that sends the shares, by index."""
    shares: list[SecAggShare] = Field(default_factory=list)
    """One encrypted share pair per neighbouring shard."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the message comes from its worker (the event log drops it)."""


class SecAggReveal(RoundEvent):
    """`worker.secagg.reveal`: secure aggregation's stage 5, a signing survivor's shares (hex) of its neighbours'
    self-mask seeds (`b_shares`, of the shards that sent masked vectors) and key (`s_shares`, of those that
    dropped)."""

    routing_key: ClassVar[str] = "worker.secagg.reveal"
    worker_id: str
    """The surviving worker that reveals the shares."""
    shard: int
    """The survivor's shard, by index."""
    b_shares: dict[int, str] = Field(default_factory=dict)
    """Per shard that sent a masked vector, this survivor's share (hex) of its self-mask seed."""
    s_shares: dict[int, str] = Field(default_factory=dict)
    """Per shard that dropped after masking began, this survivor's share (hex) of its mask key."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the message comes from its worker (the event log drops it)."""


class SecAggCheck(RoundEvent):
    """`worker.secagg.check`: secure aggregation's consistency check, a survivor's Ed25519 signature (hex) over
    the survivor set the aggregator told it (its `check` stage), by its shard's signing key."""

    routing_key: ClassVar[str] = "worker.secagg.check"
    worker_id: str
    """The surviving worker that signs."""
    shard: int
    """The survivor's shard, by index."""
    signature: str
    """Ed25519 signature (hex) over the round and the survivor set, by the shard's signing key."""
    secret: str = ""  # the assignment's one-time secret
    """The assignment's one-time secret, proving the message comes from its worker (the event log drops it)."""


class SecAggKeysOf(BaseModel):
    """One shard's advertised keys, as the aggregator relays them."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    shard: int
    """The shard whose keys these are, by index."""
    c_public: str
    """X25519 public key (hex) for encrypting shares sent to that shard."""
    s_public: str
    """X25519 public key (hex) for agreeing pairwise mask seeds with that shard."""
    signature: str
    """Its worker's Ed25519 signature (hex), checked against the shard's verify key in the assignment."""


class SecAggStage(RoundEvent):
    """`secagg.worker.<worker id>`: the aggregator's next step of secure aggregation for one shard's worker:
    `roster` (every shard's signed keys), `forward` (the shares sent to this shard), `check` (the survivor set
    to sign) or `unmask` (whose shares it must reveal, with the survivors' signatures)."""

    routing_key: ClassVar[str] = "secagg.worker"
    shard: int
    """The shard the step is for, by index."""
    stage: Literal["roster", "forward", "check", "unmask", "abort"]
    """Which step: the roster of keys, the forwarded shares, the survivor set to sign, the call to unmask, or an
    abort."""
    roster: list[SecAggKeysOf] = Field(default_factory=list)
    """`roster`: every shard's signed keys (the worker checks each signature)."""
    shares: list[SecAggShare] = Field(default_factory=list)
    """`forward`: the encrypted shares other shards sent to this one."""
    survivors: list[int] = Field(default_factory=list)
    """`check`: every shard whose masked vector the sum holds (the set to sign); `unmask`: those of them among
    this shard's neighbours (reveal their self-mask seed shares)."""
    dropped: list[int] = Field(default_factory=list)
    """`unmask`: the shards that dropped after the roster (reveal their mask key shares)."""
    signatures: dict[int, str] = Field(default_factory=dict)
    """`unmask`: per shard that signed it, its signature (hex) over the survivor set (the worker reveals only
    if at least the threshold of them verify over the set it signed)."""
    reason: str = ""  # abort: why the round cannot be aggregated securely
    """`abort`: why the round cannot be aggregated securely, in one line."""


def secagg_key(worker_id: str) -> str:
    """The routing key of the aggregator's secure-aggregation stages for one worker: `secagg.worker.<worker id>`,
    bound by that worker's control queue alone."""
    return f"{SecAggStage.routing_key}.{worker_id}"


class RoundTimeout(RoundEvent):
    """`round.timeout` (delayed): a round's deadline; the aggregator closes it with what it has."""

    routing_key: ClassVar[str] = "round.timeout"


class FoldedUpdate(BaseModel):
    """One update a version of an async job folded: its task, its worker, and how stale it was."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    shard: int
    """The shard the update trained."""
    round: int  # the task's round: it trained from version round - 1
    """The task's round: it trained from version round - 1."""
    attempt: int  # the task's number within the job
    """The task's number within the job."""
    worker_id: str
    """The worker that trained it."""
    samples: int
    """The samples it trained on."""
    staleness: int  # versions made between its start and its fold
    """Versions made between its start and its fold."""
    weight: float  # its staleness weight g(staleness)
    """Its staleness weight g(staleness), multiplying its samples in the buffer."""
    duration_s: float = 0.0  # its worker's training time
    """Its worker's training time, in seconds."""


class RoundAssigned(RoundEvent):
    """`round.assigned`: mode async: one training task was handed out (its shard trains from version round - 1;
    `attempt` numbers the job's tasks); the aggregator judges the task's report by the secret's digest here."""

    routing_key: ClassVar[str] = "round.assigned"
    shard: int
    """The shard the task trains."""
    weights: ObjectRef  # the global version the task trains from
    """The global version the task trains from (its update is the difference from these weights)."""
    secret_digest: str
    """The SHA-256 (hex) of the task's one-time secret: its report's `secret` must hash to it."""
    progress_digest: str = ""
    """The SHA-256 (hex) of the task's progress token, for its progress reports; empty: none."""


class SecAggSummary(BaseModel):
    """What secure aggregation did in one round: the stage it reached and who took part at each stage."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    stage: str
    """The last stage reached: keys, shares, masked, check, unmask, unmasked (the sum was unmasked) or aborted."""
    threshold: int
    """Shares needed to rebuild a worker's secrets (reconstruction_threshold, resolved)."""
    num_shares: int
    """How many workers each worker's secrets are shared among (itself included)."""
    participants: list[int] = Field(default_factory=list)
    """The shards that advertised keys (the roster)."""
    shared: list[int] = Field(default_factory=list)
    """The shards that sent their encrypted shares (their masks are in play)."""
    survivors: list[int] = Field(default_factory=list)
    """The shards whose masked vectors the sum holds."""
    signers: list[int] = Field(default_factory=list)
    """The survivors that signed the survivor set (the consistency check)."""
    revealed: list[int] = Field(default_factory=list)
    """The signers whose shares were in when the round closed."""
    dropped: list[int] = Field(default_factory=list)
    """The shards that shared keys but sent no masked vector: their masks were removed from the others' shares."""


class RoundAggregated(RoundEvent):
    """`round.aggregated`: the aggregator folded a round's contributions into new global `weights`."""

    routing_key: ClassVar[str] = "round.aggregated"
    weights: ObjectRef
    """Where the round's new global weights are stored: the next round starts from them."""
    contributors: list[int]
    """The shards whose contributions were accepted and aggregated, by index, in order."""
    total_samples: int
    """The samples of the accepted contributions, summed."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The accepted contributions' metrics averaged, weighted by samples (plus `dp_*` under DP)."""
    rejected: dict[str, str] = Field(default_factory=dict)
    """Per shard (its index as text), why its contribution was refused or failed; not in the average."""
    # Which worker trained each accepted shard: the next round prefers it for that shard.
    trained_by: dict[int, str] = Field(default_factory=dict)
    """Which worker trained each accepted shard: the next round prefers it for that shard."""
    shard_states: dict[int, ObjectRef] = Field(default_factory=dict, description="the new state of each accepted "
                                               "shard that returned one; the next round hands it to that shard")
    server_state: ObjectRef | None = Field(default=None, description="the strategy's state after the round where every "
                                           "worker needs it (SCAFFOLD's control variate); else null")
    # Mode async: each update the version folded, in folding order (empty for a synchronous round), and the W3C
    # traceparent of the next version, opened with this one's close (its round span: the scheduler records it).
    folded: list[FoldedUpdate] = Field(default_factory=list)
    """Mode async: each update the version folded, in folding order; empty for a synchronous round."""
    next_traceparent: str | None = None
    """Mode async: the W3C traceparent of the next version, opened as this one closed; else None."""
    secure_aggregation: SecAggSummary | None = None
    """Secure aggregation's stages in this round; None for a round aggregated in the clear."""


class RoundFailed(RoundEvent):
    """`round.failed`: a round could not be aggregated (too few valid contributions by its deadline)."""

    routing_key: ClassVar[str] = "round.failed"
    reason: str
    """Why, in one line (a timeout or too few valid contributions, or a strategy that could not aggregate them)."""
    reported: int = 0
    """How many valid contributions the round had when it closed."""
    required: int = 0
    """How many it needed: the job's `distributed.min_workers`."""
    secure_aggregation: SecAggSummary | None = None
    """Secure aggregation's stages in this round, as far as they went; None for a round in the clear."""


class WeightsInitialized(Event):
    """`worker.initialized`: a worker ran the job's `fl_init_weights` (an init assignment); its weights, stored,
    are round 1's. `found` False: the module defines no fl_init_weights; `error`: the user's code failed."""

    routing_key: ClassVar[str] = "worker.initialized"
    attempt: int = 1
    """Which try of the init task this reports on (the assignment's `attempt`)."""
    worker_id: str
    """The worker that ran the init task."""
    weights: ObjectRef | None = None
    """Where the initial weights are stored (the assignment's `result_key`); else None."""
    found: bool = True
    """False: the job's module defines no `fl_init_weights` (the scheduler fails the job)."""
    error: str | None = None
    """Why the init failed, in one line (the user's code raised, the upload failed); None on success."""
    secret: str = ""  # the init assignment's one-time secret
    """The init assignment's one-time secret: proves the sender (the event log drops it)."""


class RoundEvaluated(RoundEvent):
    """`round.evaluated`: the scheduler recorded a round's evaluation, from the `worker.evaluated` of the worker
    its evaluate assignment went to; its metrics are the round's evaluation metrics. `error`: the user's code
    failed (the round still counts); `found` False: the module defines no fl_evaluate_model (the job's rounds
    are not evaluated)."""

    routing_key: ClassVar[str] = "round.evaluated"
    worker_id: str
    """The worker that evaluated the round's global weights."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The evaluation's metrics, by name, as `fl_evaluate_model` returned them; empty on `error`."""
    found: bool = True
    """False: the job's module defines no `fl_evaluate_model`, and its rounds are not evaluated."""
    error: str | None = None
    """Why the evaluation failed, in one line (the round still counts); None on success."""
    shard: int | None = None
    """`worker.evaluated` of a personal-layers job: the shard whose personalised model (the round's global model
    with the shard's personal layers) it scored on the shard's own held-out data; None: the global model."""
    shards: dict[int, dict[str, float]] = Field(default_factory=dict)
    """`round.evaluated` of a personal-layers job: each evaluated shard's metrics (its personalised model on its own
    held-out data); `metrics` is then their mean, weighted by each shard's `num_samples`. Empty otherwise."""


class WorkerEvaluated(RoundEvaluated):
    """`worker.evaluated`: a worker evaluated a round's global weights (`fl_evaluate_model`, an evaluate
    assignment); the scheduler checks that it comes from the assignment's worker, then announces `round.evaluated`."""

    routing_key: ClassVar[str] = "worker.evaluated"
    secret: str = ""  # the evaluate assignment's one-time secret
    """The evaluate assignment's one-time secret: proves the sender (the event log drops it)."""


class ReportForged(Event):
    """`report.forged`: the scheduler refused a worker's task report (`report`, its routing key) as not from the
    worker the task was assigned to; recorded, never applied."""

    routing_key: ClassVar[str] = "report.forged"
    round: int | None = None
    """The round of the refused report's task (0 for an init task)."""
    attempt: int | None = None
    """The attempt of the refused report's task."""
    worker_id: str
    """The worker the refused report claims to come from."""
    report: str
    """The refused report's routing key (`worker.initialized`, `worker.evaluated` or `worker.merged`)."""
    reason: str
    """Why it was refused, in one line (a wrong or missing secret, or another worker's broker user sent it)."""


class AdapterMerged(RoundEvent):
    """`worker.merged`: a worker merged a built-in job's final adapter (round `round`'s) into the base model (a
    merge assignment); `merged` is the zipped Hugging Face model folder it uploaded, `error` why it could not."""

    routing_key: ClassVar[str] = "worker.merged"
    worker_id: str
    """The worker that ran the merge task."""
    merged: ObjectRef | None = None
    """Where the merged model (a zipped Hugging Face model folder) is stored; None on `error`."""
    error: str | None = None
    """Why the merge failed, in one line (the scheduler fails the job, keeping the adapter); else None."""
    secret: str = ""  # the merge assignment's one-time secret
    """The merge assignment's one-time secret: proves the sender (the event log drops it)."""


class TaskTimeout(RoundEvent):
    """`task.timeout` (delayed): an init, evaluate or merge assignment's time is up, or a mode-async training
    task's; if it has not reported, the scheduler stops waiting for it (a training task's shard goes out again). Also
    the end of a mode-async worker's wait for a version that was due (`task: wait`)."""

    routing_key: ClassVar[str] = "task.timeout"
    task: TaskKind | Literal["wait"] = EVALUATE
    """Which task's time is up: `init`, `evaluate` or `merge` (with the event's round and attempt), `train` (a
    mode-async task: `attempt` is its task number), or `wait` (a mode-async worker that reported task `attempt` was
    held for a version due soon: if the version has not come, its next task goes out now)."""


class JobCompleted(Event):
    """`job.completed`: a job ended with its final model (after its last round, or stopped early)."""

    routing_key: ClassVar[str] = "job.completed"
    rounds_completed: int
    """How many rounds ran: the last round aggregated (fewer than `num_rounds` when stopped early)."""
    final_model: str
    """The storage URI of the final model (the kept round's weights, or a built-in job's merged model)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The job's final metrics: the kept round's aggregated training metrics, overlaid by its evaluation's."""
    reason: str | None = None  # why it ended before its last round (early stopping), or an evaluation error
    """Why it ended before its last round (early stopping), or an evaluation error; None: it ran every round."""
    best_round: int | None = None  # the round whose weights are the final model (keep_best), if not the last
    """The round whose weights are the final model (keep_best); None: the last round."""


class JobFailed(Event):
    """`job.failed`: a job ended without completing: failed (`reason`), or cancelled."""

    routing_key: ClassVar[str] = "job.failed"
    reason: str
    """Why, in one line: what failed, or the cancel request's reason."""
    round: int | None = None
    """The round the job was in when it ended (0: before its first round); None: not said."""
    cancelled: bool = False  # it ended because someone cancelled it, not because something failed
    """True: it ended because someone cancelled it (`job.cancel`), not because something failed."""


class JobTrainingEnded(Event):
    """`job.training_ended`: mode async: the job's last version is stored, so its training tasks still out are of
    no use; workers stop them and take no more (its evaluations still run). The job ends as usual after it."""

    routing_key: ClassVar[str] = "job.training_ended"
    version: int
    """The job's last version (round), whose weights are stored."""


class JobWaiting(Event):
    """`job.waiting`: a round cannot start yet (too few workers online); the job waits."""

    routing_key: ClassVar[str] = "job.waiting"
    reason: str
    """Why, in one line: how many workers are online, how many it needs, and listed workers of the wrong kind."""
    round: int
    """The round that waits to start."""
    online: int
    """How many workers online count for the job (a pinned job counts only its own)."""
    required: int
    """How many it needs: the job's `distributed.min_workers`."""


class JobCancelRequested(Event):
    """`job.cancel`: stop a job; no further round starts and its workers stop training it."""

    routing_key: ClassVar[str] = "job.cancel"
    reason: str = "cancelled by user"
    """Why, in one line: the reason `job.failed` carries and the job's record keeps."""


class WorkerPresence(Message):
    """Base of a worker's presence events; they name no job."""

    worker_id: str
    """The worker's id (`APIARY_WORKER_ID`, or one made from its host name)."""


class WorkerOnline(WorkerPresence):
    """`worker.online`: a worker started and takes assignments."""

    routing_key: ClassVar[str] = "worker.online"
    hostname: str = ""
    """The host name of the machine the worker runs on."""
    gpu: dict[str, Any] | None = None
    """Its GPU: `index`, `name`, `utilization` (%), `memory_used`, `memory_total` (bytes)...; None: no GPU/NVML."""
    kind: str | None = None  # "own" (the user's machine) or "platform" (ours); None: undeclared
    """`own` (the user's machine) or `platform` (the operator's), from APIARY_WORKER_KIND; None: undeclared."""


class WorkerHeartbeat(WorkerPresence):
    """`worker.heartbeat`: a worker is alive, and what it is doing."""

    routing_key: ClassVar[str] = "worker.heartbeat"
    state: str = "idle"
    """What it does: `idle`, `training`, or the task it runs (`init`, `evaluate`, `merge`)."""
    job_id: str | None = None
    """The job of the assignment it runs; None when idle."""
    round: int | None = None
    """The round of the assignment it runs; None when idle."""
    shard: int | None = None
    """The shard of the assignment it runs (0 for a task); None when idle."""
    gpu: dict[str, Any] | None = None
    """Its GPU's readings now, as in `worker.online`; None: no GPU, or no NVML to read it."""
    samples_per_s: float | None = None
    """Its training throughput, in samples a second; None when it has none to tell."""
    kind: str | None = None  # as declared in worker.online
    """What the worker is, as declared in `worker.online`."""
    token: str | None = None  # the progress token of the assignment it trains, if any
    """The progress token of the assignment it runs (apiary.proof): proves it took it; else None."""
    interval: float | None = None  # seconds until its next beat (apiary.pace); None: the services' setting
    """Seconds until its next beat (apiary.pace); None: the services' own heartbeat setting."""


class WorkerOffline(WorkerPresence):
    """`worker.offline`: a worker says it is stopping (one that vanishes sends nothing: the scheduler takes it as
    gone when its heartbeats stop)."""

    routing_key: ClassVar[str] = "worker.offline"
    reason: str = "stopped"
    """Why it went offline, in one line (`stopped` when it shuts down); the event log keeps it."""


class PresencePace(Message):
    """`presence.pace`: how often workers beat now, for the fleet online (apiary.pace): every `interval` seconds,
    offline after `offline_after`; sent by the scheduler to every worker when the pace changes."""

    routing_key: ClassVar[str] = "presence.pace"
    factor: float = Field(ge=1.0)
    """How many times slower than the base heartbeat interval the fleet beats (1: the base pace)."""
    interval: float = Field(gt=0)
    """Seconds between a worker's heartbeats: the base interval times `factor`."""
    offline_after: float = Field(gt=0)
    """Seconds without a heartbeat after which a worker is taken as offline: the base time times `factor`."""
    workers: int = Field(ge=0)
    """How many workers were online when the scheduler chose this pace."""


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
        JobCompleted, JobFailed, JobTrainingEnded, JobWaiting, JobCancelRequested, WorkerOnline, WorkerHeartbeat,
        WorkerOffline,
        WeightsInitialized, RoundEvaluated, WorkerEvaluated, ReportForged, AdapterMerged, TaskTimeout,
        PresencePace, SecAggKeys, SecAggShares, SecAggCheck, SecAggReveal,
    )
}
EVENT_TYPES[RoundAssigned.routing_key] = RoundAssigned  # mode async's task announcements
# Mode async's reports: the same messages under their own keys, which the scheduler hears as well as the aggregator
# (it hands out the next task at once); a synchronous round's reports reach the aggregator alone.
EVENT_TYPES[WorkerDone.async_routing_key] = WorkerDone
EVENT_TYPES[WorkerFailed.async_routing_key] = WorkerFailed


def report_key(report: WorkerDone | WorkerFailed, assignment: Assignment) -> str:
    """The routing key a worker's report of `assignment` goes out under: the report's own, or its mode-async key
    where the assignment is a task of a job in mode async."""
    return report.async_routing_key if assignment.asynchronous else report.routing_key


def model_for(routing_key: str) -> type[BaseModel]:
    """The model for a routing key (`assign.*` keys all carry an Assignment, `presence.pace.*` a PresencePace)."""
    if routing_key.startswith("assign."):
        return Assignment
    if routing_key.startswith(f"{PresencePace.routing_key}."):
        return PresencePace
    if routing_key.startswith(f"{SecAggStage.routing_key}."):
        return SecAggStage
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
