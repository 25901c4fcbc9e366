"""The job request: what a user or another system asks Apiary to train."""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from apiary.bundle import requirement_error
from apiary.early_stopping import BUILT_IN_METRICS, EarlyStopping
from apiary.jobspec_async import AsyncConfig, Mode, async_errors
from apiary.jobspec_builtin import built_in_errors, did_you_mean, merged_errors
from apiary.policy import Policy, job_errors
from apiary.privacy import PRIVACY_EXTRA, DifferentialPrivacy, accounting_available, epsilon, rounds_within_budget
from apiary.secagg.settings import SecureAggregation, job_error
from apiary.strategies import DEFAULT_STRATEGY
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.wire_settings import TransferSettings

ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
DEFAULT_FUNCTION = "fl_train_model"
FEDPROX = "fedprox"  # the strategy whose parameter the training loop needs (env PROXIMAL_MU)
SCAFFOLD = "scaffold"  # the strategy whose control-variate update the training loop makes (env SCAFFOLD)
CAUSAL_LM = "causal_lm"  # the built-in trainer a job without an entrypoint runs
LEGACY_ID_PATTERN = r"^[A-Za-z0-9_\-]{1,64}$"  # the hex ids datasets had before ids were integers
LEGACY_ID_RE = re.compile(LEGACY_ID_PATTERN)
INT64_MAX = 2**63 - 1  # the largest id or count a database column holds


def _registry_id(value: Any) -> Any:
    """A registry id: a JSON integer or a string of digits is the integer (from 1 to INT64_MAX, as the id
    tables number them); an older hex id stays a string."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= INT64_MAX:
        raise ValueError(f"expected an id from 1 to {INT64_MAX}, got {value}")
    if isinstance(value, str) and not LEGACY_ID_RE.match(value):
        raise ValueError("expected an integer id (or a string of digits)")
    return value


# A registered dataset's or model's id (see `_registry_id`); the schema says what it accepts.
RegistryId = Annotated[int | str, BeforeValidator(_registry_id), WithJsonSchema(
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": INT64_MAX},
               {"type": "string", "pattern": LEGACY_ID_PATTERN}]})]


def parse_entrypoint(entrypoint: str) -> tuple[str, str]:
    """`pkg.module:function` as (module, function); the function defaults to fl_train_model."""
    module, _, function = entrypoint.partition(":")
    return module, function or DEFAULT_FUNCTION


class DistributedConfig(BaseModel):
    """How rounds run: how many, on how many workers, and how failures are tolerated."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    enabled: bool = Field(default=True, description="false: one ordinary training on a single worker over the "
                          "whole dataset (one shard), whatever sizes the request names")
    num_rounds: int = Field(default=1, ge=1, le=100_000, description="rounds of train-then-aggregate")
    steps_per_round: int | None = Field(default=None, ge=1, le=INT64_MAX, description="passed to the training "
                                        "function as env STEPS_PER_ROUND (the built-in trainer's steps a round)")
    min_workers: int = Field(default=1, ge=1, le=10_000, description="fewest valid contributions a round may be "
                             "aggregated from (at its timeout), and workers online before a round starts")
    max_workers: int = Field(default=1, ge=1, le=10_000, description="shards per round: the dataset is split into "
                             "this many shards")
    aggregation_timeout: float = Field(default=600.0, gt=0, le=7 * 24 * 3600, description="seconds a round waits "
                                       "for its shards before aggregating what it has (or failing)")
    fault_tolerance: int = Field(default=1, ge=0, le=10_000, description="consecutive failed rounds tolerated "
                                 "before the job fails")
    # Checked against the strategy registry by `strategy_errors`, where the strategies are loaded (the
    # scheduler): the tracker validates requests too and must not load torch.
    strategy: str = Field(default=DEFAULT_STRATEGY, min_length=1, max_length=100, description="the aggregation "
                          "strategy, by name (federated_averaging, fedprox, fedadam, krum, ...)")
    strategy_params: dict[str, Any] = Field(default_factory=dict, description="the strategy's parameters (names "
                                            "and defaults as Flower's)")
    evaluate_every: int = Field(default=1, ge=0, le=100_000, description="evaluate the global model (the module's "
                                "fl_evaluate_model, on a worker) after every N-th round and after the last; 0: "
                                "only after the last")
    early_stopping: EarlyStopping | None = Field(default=None, description="end the job once a metric stops "
                                                 "improving")
    differential_privacy: DifferentialPrivacy | None = Field(default=None, description="central differential "
                                                             "privacy around the strategy: clipping, noise and an "
                                                             "accountant (docs/privacy.md)")
    secure_aggregation: SecureAggregation | None = Field(default=None, description="SecAgg+: workers upload "
                                                         "masked, quantised updates whose sum alone the aggregator "
                                                         "learns (docs/security.md)")
    transfer: TransferSettings = Field(default_factory=TransferSettings, description="how weights travel: "
                                       "download precision, upload encoding (delta, half precision, int8 "
                                       "blockwise) and whether contributions are kept (docs/large-models.md)")

    personal_layers: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default_factory=list, max_length=1000, description="glob patterns (fnmatch) of tensor names that stay with "
        "each shard and are never aggregated (FedPer): they travel as the shard's state; refused when they match "
        "no tensor or every tensor of the initial weights (docs/how-to/shard-state.md)")
    mode: Mode = Field(default="sync", description="sync: rounds wait for their shards; async: buffered "
                       "asynchronous aggregation (FedBuff): workers train continuously and every buffer_size "
                       "updates make a new version (num_rounds counts versions; docs/how-to/async.md)")
    async_: AsyncConfig | None = Field(default=None, alias="async", description="mode async: the buffer size, "
                                       "concurrency, staleness weight and server step")

    @property
    def buffered(self) -> AsyncConfig | None:
        """The resolved async settings of a job in mode async (defaults from its sizes), else None."""
        if self.mode != "async":
            return None
        return (self.async_ or AsyncConfig()).resolved(self.max_workers)

    @model_validator(mode="after")
    def _min_le_max(self) -> DistributedConfig:
        if not self.enabled:
            # Not federated: one worker trains the one shard, whatever sizes the request names.
            self.min_workers = self.max_workers = 1
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) must not exceed max_workers ({self.max_workers})"
            )
        if self.differential_privacy is not None:
            if not accounting_available():
                raise ValueError(f"differential_privacy needs the dp-accounting package: {PRIVACY_EXTRA}")
            try:
                self.differential_privacy = self.differential_privacy.resolved(self.max_workers)
            except ValueError as e:
                raise ValueError(f"differential_privacy: {e}") from None
        if self.secure_aggregation is not None:
            dp = self.differential_privacy
            error = job_error(self.secure_aggregation, self.strategy, self.max_workers,
                              None if dp is None else dp.clip_on == "worker")
            if error:
                raise ValueError(f"secure_aggregation: {error}")
            noise_std = 0.0 if dp is None else dp.worker_noise_std
            if 4 * noise_std > self.secure_aggregation.clipping_range:
                raise ValueError(f"secure_aggregation: clipping_range {self.secure_aggregation.clipping_range:g} "
                                 f"would clip the workers' noise (differential_privacy noise_on worker: std "
                                 f"{noise_std:.4g} per value) before quantisation: raise clipping_range above "
                                 f"{4 * noise_std:.4g} or noise on the server")
            if self.transfer.upload != "fp32" or self.transfer.delta:
                raise ValueError("secure_aggregation: workers upload masked vectors of their own encoding; leave "
                                 "transfer.upload at fp32 and transfer.delta false")
            if self.personal_layers:
                raise ValueError("secure_aggregation: masks every tensor of the model; personal_layers keep some "
                                 "out of the sum: use one or the other")
        return self


class SplitConfig(BaseModel):
    """How the sharder splits the dataset: random (default), label skew, quantity skew or by group."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["random", "label_skew", "quantity_skew", "group"] = Field(
        default="random", description="random: equal shares; label_skew: each label spread in Dirichlet(alpha) "
        "proportions; quantity_skew: sizes from one Dirichlet(alpha) draw; group: whole groups per shard")
    seed: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX, description="seed of the split")
    alpha: float = Field(default=0.5, gt=0, description="Dirichlet concentration for label_skew and quantity_skew")
    key: str = Field(default="group", description="sample field that names the group, for group")


CODE_KEY_RE = r"^code/[\w.\-]{1,200}\.zip$"


def _code_ref(value: Any) -> Any:
    """`code` over the bus or the API references a stored bundle; a local path is for job files only."""
    if isinstance(value, str):
        raise ValueError(f"{value!r} is a local path: apiary run and apiary submit pack and upload it; over the "
                         "bus or the API give {key, sha256} of a bundle stored with POST /api/v1/code")
    return value


class CodeRef(BaseModel):
    """A stored code bundle the job's entrypoint is resolved in: its storage key (under code/) and sha256."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(description="code/<sha256>.zip, as POST /api/v1/code answers")
    sha256: str = Field(description="the bundle's sha256, 64 lowercase hex digits")
    size: int | None = Field(default=None, ge=0, le=INT64_MAX, description="its bytes (filled in where it is checked)")

    @field_validator("key")
    @classmethod
    def _under_code(cls, value: str) -> str:
        if not re.match(CODE_KEY_RE, value):
            raise ValueError(f"{value!r} is not a code bundle's key: expected code/<sha256>.zip, as POST "
                             "/api/v1/code answers")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        if not re.match(r"^[0-9a-f]{64}$", value):
            raise ValueError("expected 64 lowercase hex digits")
        return value


OWN, PLATFORM = "own", "platform"  # the kinds a worker declares: the user's machine, or ours


class WorkerSelection(BaseModel):
    """Where shards train: any worker from the pool, each shard on one named worker (`pinned`), or on the
    listed own and platform workers (`mixed`: one shard each, like pinned)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["pool", "pinned", "mixed"] = Field(
        default="pool", description="pool: any worker takes any shard; pinned: shard i trains on workers[i]; "
        "mixed: one shard each on the listed own and platform workers")
    workers: list[str] = Field(default_factory=list, description="pinned: the worker id for each shard")
    # mixed: integers name the workers whose id is that number.
    worker_ids: list[int | str] = Field(default_factory=list, description="mixed: workers started with --kind own")
    parsyn_worker_ids: list[int | str] = Field(default_factory=list, description="mixed: workers started with "
                                               "--kind platform")

    @model_validator(mode="after")
    def _pinned_needs_workers(self) -> WorkerSelection:
        if self.mode == "pinned" and not self.workers:
            raise ValueError("mode 'pinned' needs 'workers': the worker id for each shard")
        if self.mode == "mixed" and not (self.worker_ids or self.parsyn_worker_ids):
            raise ValueError("mode 'mixed' needs 'worker_ids' (own workers) or 'parsyn_worker_ids' (platform ones)")
        if self.mode != "mixed" and (self.worker_ids or self.parsyn_worker_ids):
            raise ValueError("'worker_ids' and 'parsyn_worker_ids' are for mode 'mixed'")
        named = self.pinned
        if len(set(named)) != len(named):
            raise ValueError(f"'{'workers' if self.mode == 'pinned' else 'worker_ids'}' names a worker twice")
        return self

    @property
    def pinned(self) -> list[str]:
        """The worker each shard trains on (own ones first in mixed mode), or [] in pool mode."""
        if self.mode == "mixed":
            return [str(w) for w in (*self.worker_ids, *self.parsyn_worker_ids)]
        return list(self.workers) if self.mode == "pinned" else []

    @property
    def kinds(self) -> dict[str, str]:
        """The kind each listed worker must have declared (mixed mode only; empty otherwise)."""
        own = {str(w): OWN for w in self.worker_ids}
        return {**own, **{str(w): PLATFORM for w in self.parsyn_worker_ids}}


class JobSpec(BaseModel):
    """A validated job request."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, description="a name for people")
    entrypoint: str | None = Field(default=None, description="module:function of the training function "
                                   "(function defaults to fl_train_model); none: the built-in trainer (causal_lm) "
                                   "fine-tunes the registered model")
    dataset: str | None = Field(default=None, description="a folder or zip with a manifest.json, or a JSONL file "
                                "(a path, storage key or URI)")
    dataset_id: RegistryId | None = Field(default=None, description="a registered dataset, in place of dataset")
    model: str | None = Field(default=None, description="path, storage key or URI of a safetensors checkpoint "
                              "for round 1 (else fl_init_weights(env) is run)")
    model_id: RegistryId | None = Field(default=None, description="a registered model (the built-in trainer's "
                                        "base model)")
    config: dict[str, Any] = Field(default_factory=dict, description="hyperparameters, passed to the training "
                                   "function as env with keys upper-cased; the built-in trainer's settings")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="how rounds run")
    worker_selection: WorkerSelection = Field(default_factory=WorkerSelection, description="where shards train")
    split: SplitConfig = Field(default_factory=SplitConfig, description="how the sharder splits the dataset")
    use_peft: bool = Field(default=False, description="only the adapter's weights travel each round")
    # Checked on the worker, never installed.
    code: Annotated[CodeRef | None, BeforeValidator(_code_ref)] = Field(
        default=None, description="the job's own code: a bundle stored with POST /api/v1/code (a job file may "
        "name a local folder or zip)")
    requirements: list[str] | None = Field(default=None, description="packages the workers' Python must provide "
                                           "(checked, never installed; none: the bundle's requirements.txt)")

    @model_validator(mode="wrap")
    @classmethod
    def _built_in_config(cls, data: Any, handler: ModelWrapValidatorHandler[JobSpec]) -> JobSpec:
        # A job without an entrypoint has its config checked key by key against the built-in trainer's,
        # reported beside the request's other errors (`config.lora_rr: unknown field (did you mean lora_r?)`).
        config_errors = built_in_errors(data)
        try:
            spec = handler(data)
        except ValidationError as e:
            if not config_errors:
                raise
            raise merged_errors(cls.__name__, e, config_errors, list(cls.model_fields)) from None
        if config_errors:
            raise ValidationError.from_exception_data(cls.__name__, config_errors)
        return spec

    @field_validator("name")
    @classmethod
    def _storable_name(cls, value: str) -> str:
        # PostgreSQL's text holds no NUL character: the name is stored as text by the tracker and the scheduler.
        if "\x00" in value:
            raise ValueError("must not contain a NUL character (\\u0000)")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str | None) -> str | None:
        if value is not None and not ENTRYPOINT_RE.match(value):
            raise ValueError("expected 'package.module:function' (function defaults to fl_train_model)")
        return value

    @field_validator("requirements")
    @classmethod
    def _requirements_parse(cls, value: list[str] | None) -> list[str] | None:
        for line in value or []:
            if (error := requirement_error(line)) is not None:
                raise ValueError(error)
        return value

    @field_validator("config")
    @classmethod
    def _config_scalars(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if not re.match(r"^[A-Za-z_]\w*$", key):
                raise ValueError(f"config key {key!r} must be an identifier (it becomes env[{key.upper()!r}])")
            if item is not None and not isinstance(item, str | int | float | bool | list | dict):
                raise ValueError(f"config value for {key!r} must be JSON-like")
        return value

    @model_validator(mode="after")
    def _dataset_given(self) -> JobSpec:
        if not self.dataset and not self.dataset_id:
            raise ValueError("give 'dataset' (a path or URI) or 'dataset_id'")
        if self.dataset and self.dataset_id:
            raise ValueError("give either 'dataset' or 'dataset_id', not both")
        if self.model and self.model_id:
            raise ValueError("give either 'model' or 'model_id', not both")
        if self.code is not None and self.entrypoint is None:
            raise ValueError("'code' needs an 'entrypoint' to run in it (a built-in job brings no code)")
        stopping = self.distributed.early_stopping
        if stopping is not None and self.entrypoint is None and stopping.metric not in BUILT_IN_METRICS:
            raise ValueError(f"distributed.early_stopping.metric {stopping.metric!r} is not a metric the built-in "
                             f"trainer reports: expected one of {', '.join(BUILT_IN_METRICS)}")
        pinned = self.worker_selection.pinned
        if pinned and len(pinned) < self.distributed.min_workers:
            raise ValueError(
                f"{len(pinned)} pinned workers cannot satisfy min_workers={self.distributed.min_workers}"
            )
        d = self.distributed
        why = async_errors(d.mode, d.async_, enabled=d.enabled, strategy=d.strategy, num_shards=self.num_shards,
                           privacy=d.differential_privacy is not None)
        if why is None and d.mode == "async":
            why = async_conflict(d)
        if why is not None:
            raise ValueError(f"distributed: {why}")
        return self

    @property
    def module(self) -> str:
        """The entrypoint's module path ("" for a built-in job)."""
        return parse_entrypoint(self.entrypoint or "")[0]

    @property
    def function(self) -> str:
        """The entrypoint's function name."""
        return parse_entrypoint(self.entrypoint or "")[1]

    @property
    def trainer(self) -> str | None:
        """The built-in trainer a job without an entrypoint runs; None for user code."""
        return CAUSAL_LM if self.entrypoint is None else None

    @property
    def built_in(self) -> CausalLMConfig | None:
        """The built-in trainer's config (validated already), or None for a user-code job."""
        return CausalLMConfig.model_validate(self.config) if self.entrypoint is None else None

    @property
    def adapter_only(self) -> bool:
        """Whether only adapter weights travel each round (`use_peft`, at the top or in a built-in config)."""
        built_in = self.built_in
        return self.use_peft or (built_in is not None and built_in.use_peft)

    @property
    def num_shards(self) -> int:
        """How many shards the dataset is split into: one per pinned worker, else max_workers."""
        return len(self.worker_selection.pinned) or self.distributed.max_workers

    def env(self, round_index: int) -> dict[str, Any]:
        """The env dict the user's function sees: config keys upper-cased plus round facts."""
        env = {key.upper(): value for key, value in self.config.items()}
        env["STEPS_PER_ROUND"] = self.distributed.steps_per_round
        env["ROUND"] = round_index
        env["NUM_ROUNDS"] = self.distributed.num_rounds
        if self.distributed.strategy == FEDPROX:
            # The proximal term lives in the training loop: the user's code (or the built-in trainer) reads it.
            env["PROXIMAL_MU"] = float(self.distributed.strategy_params.get("proximal_mu", 0.0))
        if self.distributed.strategy == SCAFFOLD:
            # The gradient correction lives in the training loop too (apiary.sdk.Scaffold reads which update).
            env["SCAFFOLD"] = str(self.distributed.strategy_params.get("control_variate_update", "II"))
        return env


class FieldError(BaseModel):
    """One bad field of a rejected request."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    field: str
    """The bad field, by its path in the request (`distributed.num_rounds`); `(request)`: the whole request."""
    message: str
    """What is wrong with it, in one line."""


def policy_errors(spec: JobSpec, policy: Policy) -> list[FieldError]:
    """What the operator's policy refuses in a valid request: an entrypoint it does not allow, a local
    dataset or model path outside its data roots (apiary.policy)."""
    request = spec.model_dump(include={"entrypoint", "dataset", "model", "code"})
    return [FieldError(field=field, message=why) for field, why in job_errors(request, policy)]


def field_errors(error: ValidationError, request: Any = None) -> list[FieldError]:
    """Turn a pydantic error into one line per bad field, in the request's own terms; given the `request`
    itself, also the rules across fields that pydantic skipped because a field in their block was bad."""
    out = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(request)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = unknown_field(item["loc"])
        out.append(FieldError(field=field, message=message))
    seen = {(e.field, e.message) for e in out}
    return out + [e for e in cross_field_errors(request) if (e.field, e.message) not in seen]


def cross_field_errors(request: Any) -> list[FieldError]:
    """The rules across fields, checked on the raw request: pydantic reaches them only when every field of
    their block is valid, and a user fixing one mistake should not meet the next only on the next try."""
    distributed = request.get("distributed") if isinstance(request, dict) else None
    if not isinstance(distributed, dict) or distributed.get("enabled") is False:
        return []
    low, high = distributed.get("min_workers", 1), distributed.get("max_workers", 1)
    if type(low) is int and type(high) is int and low > high:
        return [FieldError(field="distributed", message=f"min_workers ({low}) must not exceed max_workers ({high})")]
    return []


def unknown_field(loc: tuple[int | str, ...]) -> str:
    """The message for an unknown field of a request at `loc`: `unknown field (did you mean num_rounds?)`."""
    return f"unknown field{_did_you_mean(loc)}"


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """` (did you mean num_rounds?)` for an unknown field close to a known one of its block, else ``."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) or next(
            (f for f in model.model_fields.values() if f.alias == str(part)), None)  # `async`, a keyword
        annotation = _block(field.annotation) if field is not None else None
        if annotation is None:
            return ""
        model = annotation
    return did_you_mean(str(loc[-1]), list(model.model_fields)) if loc else ""


def _block(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested block (`Block` or `Block | None`), or None for any other field."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def describe_errors(errors: list[FieldError]) -> str:
    """One line naming each bad field (for a stored reason; people get one line per field)."""
    return "; ".join(f"{e.field}: {e.message}" for e in errors)


def async_conflict(d: DistributedConfig) -> str | None:
    """Why mode async cannot run with another of the job's settings (one line), or None."""
    if d.secure_aggregation is not None:
        return ("secure_aggregation is not available in mode 'async' (it unmasks one sum over a fixed roster of "
                "workers; async folds updates as they arrive)")
    if d.personal_layers:
        return ("personal_layers are not available in mode 'async' (a shard may train in two tasks at once, so its "
                "state has no single next holder)")
    if d.transfer.encodes_upload or d.transfer.download != "fp32":
        return ("transfer encodings are not available in mode 'async' (the aggregator takes each update against the "
                "version it started from, in fp32): leave download and upload at fp32 and delta false")
    return None


def strategy_errors(spec: JobSpec) -> list[FieldError]:
    """The job's strategy checked against the registry and the job's sizes: one error per bad field, none
    if it can run. Imports the strategies (and torch), so only the scheduler calls it."""
    from apiary.strategies import base

    distributed = spec.distributed
    try:
        base.lookup(distributed.strategy)
    except ValueError as e:
        return [FieldError(field="distributed.strategy", message=str(e))]
    try:
        strategy = base.create(distributed.strategy, distributed.strategy_params)
        strategy.check_job(spec.num_shards, distributed.min_workers)
    except ValueError as e:
        return [FieldError(field="distributed.strategy_params", message=str(e))]
    if strategy.shares_state and distributed.differential_privacy is not None:
        return [FieldError(field="distributed.differential_privacy",
                           message=f"strategy {distributed.strategy!r} hands its server state to every worker, which "
                                   "central differential privacy does not account for: use another strategy")]
    dp = distributed.differential_privacy
    if dp is not None and dp.noise_on == "worker" and not strategy.perturbs_mean:
        return [FieldError(field="distributed.differential_privacy.noise_on",
                           message=f"'worker' takes a strategy that averages the updates (the workers' noise adds "
                                   f"up to the calibrated std only in a weighted mean); strategy "
                                   f"{distributed.strategy!r} does not: use noise_on 'server'")]
    if (strategy.shares_state or distributed.personal_layers) and distributed.transfer.encodes_upload:
        what = f"strategy {distributed.strategy!r}" if strategy.shares_state else "personal_layers"
        return [FieldError(field="distributed.transfer",
                           message=f"{what} uploads tensors the global weights do not hold, which a delta or "
                                   "quantised upload cannot encode: leave transfer.upload at fp32 and delta false")]
    return privacy_errors(spec) or secure_aggregation_errors(spec)


def secure_aggregation_errors(spec: JobSpec) -> list[FieldError]:
    """Secure aggregation of an adapter-only job, which it does not take (its masked vector is every tensor)."""
    if spec.distributed.secure_aggregation is None or not spec.adapter_only:
        return []
    return [FieldError(field="distributed.secure_aggregation",
                       message="takes full-weight updates; an adapter-only job (use_peft, or the built-in LoRA "
                               "trainer) is not supported with secure aggregation")]


def privacy_errors(spec: JobSpec) -> list[FieldError]:
    """A privacy budget that not even one round fits (computing ε loads dp-accounting: the scheduler calls it)."""
    settings = spec.distributed.differential_privacy
    if settings is None or settings.max_epsilon is None or rounds_within_budget(settings, 1) > 0:
        return []
    one = epsilon(settings.noise_multiplier, 1, settings.target_delta)
    return [FieldError(field="distributed.differential_privacy.max_epsilon",
                       message=f"{settings.max_epsilon:g} is below the ε of a single round ({one:.4g} at target_delta "
                               f"{settings.target_delta:g}): raise max_epsilon or noise_multiplier")]
