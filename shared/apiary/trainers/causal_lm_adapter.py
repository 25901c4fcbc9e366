"""What the scheduler needs of the causal-LM trainer, without the base model's weights where it can:
round 0's adapter built from the model's config alone (on the meta device), round 0's full weights for
a job without peft, and the final artifacts (a PEFT adapter folder, a merged model folder)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.causal_lm_model import config_object, full_tensors, load_base, with_lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def initial_adapter(hf_config: dict[str, Any], cfg: CausalLMConfig) -> dict[str, Any]:
    """Round 0's adapter: the LoRA tensors peft would create for this model (A uniform as peft's kaiming
    init, seeded with cfg.seed; B zeros), found on a weightless meta-device model."""
    import torch

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config_object(hf_config))
        shapes = {k: tuple(v.shape) for k, v in adapter_tensors_meta(with_lora(model, cfg)).items()}
    generator = torch.Generator().manual_seed(cfg.seed)
    tensors: dict[str, Any] = {}
    for key, shape in shapes.items():
        tensor = torch.zeros(shape)
        if ".lora_A." in key:
            torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        tensors[key] = tensor
    return tensors


def adapter_tensors_meta(model: Any) -> dict[str, Any]:
    """The adapter's tensors as they are (meta ones included), under peft's saved keys."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def initial_full_weights(model_path: Path) -> dict[str, Any]:
    """Round 0 for a job without peft: the base model's own weights (this loads them)."""
    model, _ = load_base(model_path)
    return full_tensors(model)


def write_adapter_folder(tensors: dict[str, Any], hf_config: dict[str, Any], cfg: CausalLMConfig,
                         folder: Path, base_model_name: str | None = None) -> None:
    """A PEFT adapter folder (adapter_model.safetensors, adapter_config.json) that
    `PeftModel.from_pretrained(base, folder)` loads as is."""
    from safetensors.torch import save_file

    from apiary.trainers.causal_lm_model import lora_config, target_modules

    folder.mkdir(parents=True, exist_ok=True)
    config = lora_config(cfg, target_modules(cfg, hf_config["model_type"]))
    config.base_model_name_or_path = base_model_name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config.to_dict(), indent=2, default=_jsonable))


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, set) else str(value)


def merge_adapter_folder(base_path: Path, adapter_folder: Path, out: Path) -> None:
    """A Hugging Face model folder with the adapter merged into the base's weights (loads the base)."""
    from peft import PeftModel

    model, tokenizer = load_base(base_path)
    merged = PeftModel.from_pretrained(model, str(adapter_folder)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
