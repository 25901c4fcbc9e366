"""The causal-LM trainer's two ends. On the scheduler, without the base model's weights: round 0's adapter
built from the model's config alone (on the meta device) and the final PEFT adapter folder. In a worker's
training child, with the base model from its cache: round 0's full weights for a job without peft (the
`causal_lm.init` call) and the final adapter merged into the base (`causal_lm.merge`, with merge_adapter)."""

from __future__ import annotations

import json
import math
import shutil
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from apiary.trainers.base import TrainCall
from apiary.trainers.causal_lm_config import CausalLMConfig
from apiary.trainers.causal_lm_model import config_object, full_tensors, load_base, set_weights, with_lora

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


def run_init(call: TrainCall, conn: Connection) -> dict[str, Any]:
    """The child's `causal_lm.init` call: the base model's weights (`call.model_path`, the worker's cache)
    written to `call.result_path` as round 0's."""
    from apiary.trainers.child import save_result

    size, sha256 = save_result(call.result_path, initial_full_weights(Path(str(call.model_path))), "causal_lm")
    return {"found": True, "size": size, "sha256": sha256}


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


def merge_adapter(base_path: Path, tensors: dict[str, Any], cfg: CausalLMConfig, out: Path) -> None:
    """A Hugging Face model folder at `out`: the base (loaded here) with the job's adapter merged into its
    weights, and its tokenizer; TrainerError in one line if the base will not load or the adapter does not fit."""
    model, tokenizer = load_base(base_path)
    adapted = with_lora(model, cfg)
    set_weights(adapted, tensors, adapter=True)
    merged = adapted.merge_and_unload()
    shutil.rmtree(out, ignore_errors=True)
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def run_merge(call: TrainCall, conn: Connection) -> dict[str, Any]:
    """The child's `causal_lm.merge` call: the adapter at `call.weights_path` merged into the base model
    (`call.model_path`), saved at `call.result_path`."""
    from apiary import weights as w
    from apiary.trainers.causal_lm_train import config_from_env

    tensors = w.loads(Path(call.weights_path).read_bytes())
    merge_adapter(Path(str(call.model_path)), tensors, config_from_env(call.env), Path(call.result_path))
    return {}
