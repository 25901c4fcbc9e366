"""The causal-LM trainer's round, run in the training child: load the base from the worker's cache, wrap
it with LoRA (or train all weights), start from the round's global weights, train on the shard with
autocast on the worker's device, and write back only what travels (the adapter, or all weights)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from apiary.trainers import causal_lm_data as data
from apiary.trainers import causal_lm_model as lm
from apiary.trainers.base import TrainCall, TrainerError
from apiary.trainers.causal_lm_config import CausalLMConfig

CONFIG_FIELDS = tuple(CausalLMConfig.model_fields)


def config_from_env(env: dict[str, Any]) -> CausalLMConfig:
    """The job's trainer config from its env (config keys arrive upper-cased); TrainerError if invalid."""
    values = {k.lower(): v for k, v in env.items() if k.lower() in CONFIG_FIELDS}
    try:
        return CausalLMConfig.model_validate(values)
    except ValueError as e:
        raise TrainerError(f"config is not valid for the causal_lm trainer: {str(e).splitlines()[0]}") from e


def precision(device: str, mixed_precision: str) -> Any:
    """The autocast dtype for `mixed_precision` on `device` (None for `no`); TrainerError if it cannot."""
    import torch

    if mixed_precision == "no":
        return None
    if mixed_precision == "fp16" and device == "cpu":
        raise TrainerError("mixed_precision fp16 is not supported on this worker's CPU: use bf16 or no")
    if mixed_precision == "bf16" and device != "cpu" and not torch.cuda.is_bf16_supported():
        raise TrainerError(f"mixed_precision bf16 is not supported on this worker's GPU ({device}): use fp16 or no")
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float16


@dataclass
class RoundInputs:
    """What a round's call works on: the job's config, the autocast dtype, the shard's (or the held-out
    dataset's) records, and the model set to the round's global weights, with its tokenizer."""

    cfg: CausalLMConfig
    dtype: Any
    records: list[dict[str, Any]]
    model: Any
    tokenizer: Any


def round_inputs(call: TrainCall, device: str) -> RoundInputs:
    """The call's config, records and model (kept from the last call, reset to the call's global weights)."""
    from apiary.trainers import shard_state

    if not call.model_path:
        raise TrainerError("the causal_lm trainer needs the job's base model, and none was given")
    cfg = config_from_env(call.env)
    dtype = precision(device, cfg.mixed_precision)
    records = data.read_records(Path(call.dataset["data_root"]))
    model, tokenizer = _warm_model(Path(call.model_path), cfg)
    from apiary.wire_codec import load_downloaded  # global weights downloaded halved come back in their dtypes

    # The shard's personal layers (distributed.personal_layers), where it has trained them before, over the global ones.
    weights = shard_state.load(call).personalise(load_downloaded(Path(call.weights_path).read_bytes()))
    lm.set_weights(model, weights, adapter=cfg.use_peft)
    return RoundInputs(cfg, dtype, records, model.to(device), tokenizer)


@contextlib.contextmanager
def out_of_memory_said(device: str, cfg: CausalLMConfig) -> Iterator[None]:
    """A device out of memory as one TrainerError line saying what to lower."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":
            raise TrainerError(f"out of GPU memory on {device} (batch_size {cfg.batch_size}, max_seq_length "
                               f"{cfg.max_seq_length}): lower them or use a larger GPU") from e
        raise


def run_round(call: TrainCall, device: str, log_metrics: Callable[..., None]) -> tuple[dict[str, Any], int,
                                                                                         dict[str, float]]:
    """Train one round; the tensors that travel, the training records' count and {loss, val_loss}."""
    result, samples, metrics = run_round_with_state(call, device, log_metrics, {})
    return result["weights"], samples, metrics


def run_round_with_state(call: TrainCall, device: str, log_metrics: Callable[..., None],
                         carried: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, float]]:
    """Train one round from the shard's state and the server state (`carried`); the result (`weights`, and
    with SCAFFOLD the shard's new `state` and its `control_delta`), the training records' count and metrics."""
    from apiary.sdk import Scaffold

    inputs = round_inputs(call, device)
    cfg, model, tokenizer = inputs.cfg, inputs.model, inputs.tokenizer
    # AdamW: the control variate's update takes the mean raw gradient (Scaffold with lr=None).
    scaffold = Scaffold(model, {"env": call.env, **(carried or {})}, lr=None,
                        names=lm.adapter_key if cfg.use_peft else None)
    examples = [data.encode(r, tokenizer, cfg.max_seq_length) for r in inputs.records]
    train_idx, val_idx = data.split_validation(len(examples), cfg.validation_split, cfg.seed)
    steps = call.env.get("STEPS_PER_ROUND")
    total = data.micro_batches(len(train_idx), cfg.batch_size, cfg.epochs, int(steps) if steps else None,
                               cfg.gradient_accumulation_steps)
    loop = _Loop(model, cfg, device, inputs.dtype, tokenizer.pad_token_id, scaffold=scaffold)
    seed = cfg.seed + int(call.round.get("index", 0))
    with out_of_memory_said(device, cfg):
        loss = loop.train([examples[i] for i in train_idx], total, seed, log_metrics)
        metrics = {"loss": loss}
        if val_idx:
            metrics["val_loss"] = loop.evaluate([examples[i] for i in val_idx])
    tensors = lm.adapter_tensors(model) if cfg.use_peft else lm.full_tensors(model)
    return scaffold.finish({"weights": tensors}), len(train_idx), metrics


# The child's model from its last round, by what built it: the next round of the job starts from the round's
# global weights, which set every weight that trains (the adapter, or all of them), so the base is loaded
# once per job rather than once per round.
_warm: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _warm_model(model_path: Path, cfg: CausalLMConfig) -> tuple[Any, Any]:
    """The base (wrapped with the job's LoRA adapter with `use_peft`) and its tokenizer, kept for the next
    round; a round of another model or adapter shape drops the kept one first."""
    key = (str(model_path), cfg.use_peft, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
           tuple(cfg.lora_target_modules or ()))
    if key not in _warm:
        _warm.clear()  # before loading: two base models need not fit at once
        model, tokenizer = lm.load_base(model_path)
        _warm[key] = (lm.with_lora(model, cfg) if cfg.use_peft else model), tokenizer
    return _warm[key]


class _Loop:
    """The optimizer's loop over batches, and the validation pass, under autocast."""

    def __init__(self, model: Any, cfg: CausalLMConfig, device: str, dtype: Any, pad_id: int,
                 scaffold: Any = None) -> None:
        import torch

        self.model, self.cfg, self.device, self.dtype, self.pad_id = model, cfg, device, dtype, pad_id
        self.scaffold = scaffold  # apiary.sdk.Scaffold: SCAFFOLD's gradient correction (a no-op for other strategies)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate)
        warmup = cfg.warmup_steps
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        # fp16 gradients underflow without scaling; bf16 and float32 need none.
        self.scaler = torch.amp.GradScaler(device.split(":")[0], enabled=dtype is torch.float16)

    def _loss(self, batch: list[data.Example]) -> Any:
        return batch_loss(self.model, batch, self.device, self.dtype, self.pad_id)

    def train(self, examples: list[data.Example], total: int, seed: int, log_metrics: Callable[..., None]) -> float:
        """Run `total` batches (an optimizer step every gradient_accumulation_steps); their mean loss."""
        import torch

        torch.manual_seed(seed)
        self.model.train()
        accumulation, losses = self.cfg.gradient_accumulation_steps, []
        order: Iterator[list[int]] = data.batches(list(range(len(examples))), self.cfg.batch_size, seed)
        for i in range(total):
            loss = self._loss([examples[j] for j in next(order)])
            self.scaler.scale(loss / accumulation).backward()
            losses.append(float(loss.detach()))
            if (i + 1) % accumulation == 0 or i + 1 == total:
                if self.scaffold is not None and self.scaffold.active:
                    self.scaler.unscale_(self.optimizer)  # the correction adds to true gradients, not scaled ones
                    self.scaffold.correct()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.schedule.step()
                log_metrics(step=math.ceil((i + 1) / accumulation), loss=losses[-1])
        return sum(losses) / len(losses)

    def evaluate(self, examples: list[data.Example]) -> float:
        """The mean loss over the held-out records, one batch at a time."""
        return mean_loss(self.model, examples, self.cfg.batch_size, self.device, self.dtype, self.pad_id)


def autocast(device: str, dtype: Any) -> Any:
    """Autocast to `dtype` on the device's kind (off for None: float32)."""
    import torch

    return torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None)


def batch_loss(model: Any, batch: list[data.Example], device: str, dtype: Any, pad_id: int) -> Any:
    """The model's loss on one batch, under autocast."""
    tensors = {k: v.to(device) for k, v in data.collate(batch, pad_id).items()}
    with autocast(device, dtype):
        return model(**tensors).loss


def mean_loss(model: Any, examples: list[data.Example], batch_size: int, device: str, dtype: Any,
              pad_id: int) -> float:
    """The mean loss over held-out examples, `batch_size` at a time, without gradients."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            losses.append(float(batch_loss(model, examples[start:start + batch_size], device, dtype, pad_id)))
    return sum(losses) / len(losses)


def run_train(call: TrainCall, conn: Connection) -> dict[str, Any]:
    """The child's `causal_lm.train` call: train, write the result file, and say what it holds."""
    from apiary.trainers import shard_state
    from apiary.trainers.child import ChildLogger, save_trained, training_device

    carried = shard_state.load(call)
    result, samples, metrics = run_round_with_state(call, training_device(conn), ChildLogger(conn).log_metrics,
                                                    {"state": carried.state, "server_state": carried.server_state})
    upload, state_out = carried.split("causal_lm", result)
    size, sha256 = save_trained(call, upload, "causal_lm")
    return {"samples": samples, "metrics": metrics, "size": size, "sha256": sha256, **state_out}
