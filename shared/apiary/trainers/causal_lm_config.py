"""The built-in causal-LM trainer's config: the keys a job without an entrypoint may set, with their
defaults and ranges (pure pydantic, no torch, so the jobspec can validate a job anywhere)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MixedPrecision = Literal["bf16", "fp16", "no"]


class CausalLMConfig(BaseModel):
    """How a worker fine-tunes the registered model on its shard (LoRA through peft, or all weights)."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(4, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    mixed_precision: MixedPrecision = "no"
    use_peft: bool = True
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    # None: the model family's attention projections (trainers.causal_lm_targets).
    lora_target_modules: list[str] | None = None
    max_seq_length: int = Field(512, ge=8)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_steps: int = Field(0, ge=0)
    validation_split: float = Field(0.1, ge=0, lt=1)
    seed: int = 0
    merge_adapter: bool = False
    # A registered dataset of held-out records (its integer id): round 0's model (the base with the initial
    # adapter) and every evaluated round's global model are scored on it on a worker (exact match of the greedy
    # reply for prompt/completion and chat records, and the loss). None: the rounds are not evaluated.
    eval_dataset_id: int | None = Field(None, ge=1)
