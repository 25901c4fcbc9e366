"""The causal-LM trainer's model: the base loaded from a Hugging Face folder or a GGUF file, its LoRA
targets (the family's attention projections unless the job names them) checked, wrapped with peft,
and the adapter's tensors read and set by the keys peft saves them under. torch, transformers and peft
are imported inside the functions: the config model and the trainer's registration stay light."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from apiary.filelock import exclusive
from apiary.trainers.base import TrainerError
from apiary.trainers.causal_lm_config import CausalLMConfig

# Families peft has no default for; the rest follow peft's own table.
_FALLBACK_TARGETS = ["q_proj", "v_proj"]
HF_SUFFIX = ".hf"  # a GGUF file's de-quantised Hugging Face folder, beside it
READY = ".ready"  # written into that folder last
LOCK = ".lock"  # beside that folder: held while one process converts the file


def offline() -> None:
    """Never reach a model hub: every model comes from the worker's cache or the registry."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_base(model_path: Path) -> tuple[Any, Any]:
    """The base model (float32, on the CPU) and its tokenizer; TrainerError in one line if it will not load.
    A GGUF file is read once and kept beside it as a Hugging Face folder (see `hf_folder`)."""
    offline()
    if model_path.is_file() and model_path.suffix == ".gguf":
        model_path = hf_folder(model_path)
    return _load(model_path)


def _load(model_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a worker's log gets lines, not progress bars

    folder, extra = (model_path.parent, {"gguf_file": model_path.name}) if model_path.is_file() else (model_path, {})
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **extra)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32", **extra)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainerError(f"base model {model_path.name} cannot be loaded: {first}") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def hf_folder(gguf: Path, load: Callable[[Path], tuple[Any, Any]] | None = None) -> Path:
    """`NAME.gguf.hf/` beside the GGUF file: its weights de-quantised to float32 safetensors with its config
    and tokenizer, written once (through a temporary folder renamed into place, so that processes sharing
    the folder never see half of one). Reading a GGUF file costs tens of seconds on a CPU, mostly parsing
    its metadata; the folder loads in about one. Workers sharing a model cache convert it once: the first
    holds a lock file beside it while the others wait, then load its folder."""
    folder = gguf.with_name(gguf.name + HF_SUFFIX)
    if (folder / READY).is_file():
        return folder
    with exclusive(gguf.with_name(folder.name + LOCK)):
        if not (folder / READY).is_file():
            _convert(gguf, folder, load)
    return folder


def _convert(gguf: Path, folder: Path, load: Callable[[Path], tuple[Any, Any]] | None) -> None:
    with _name_maps_built_once():
        model, tokenizer = (load or _load)(gguf)
    model.hf_quantizer = None  # transformers refuses to save a model it de-quantised from GGUF
    vars(model.config).pop("quantization_config", None)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=gguf.parent))
    partial.chmod(0o755)
    try:
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        (partial / READY).touch()
        for path in partial.iterdir():
            path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)  # shared by jobs: none may change them
        partial.rename(folder)
    except OSError:
        if not (folder / READY).is_file():  # another process renamed its own into place first: use that
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def _name_maps_built_once() -> Iterator[None]:
    """transformers builds gguf's tensor-name map of the whole architecture again for every module of the model
    (397 times for SmolLM2-135M, about a third of reading the file); the map depends only on the architecture
    and depth, so while a GGUF file is read each one is built once."""
    try:
        import gguf
    except ImportError:  # transformers says what is missing when it reads the file
        yield
        return
    built = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(built)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = built


def config_object(hf_config: dict[str, Any]) -> Any:
    """The transformers config for a registered model's `hf_config` dict."""
    offline()
    from transformers import AutoConfig

    rest = {k: v for k, v in hf_config.items() if k != "model_type"}
    return AutoConfig.for_model(hf_config["model_type"], **rest)


def target_modules(cfg: CausalLMConfig, model_type: str) -> list[str]:
    """The modules LoRA wraps: the job's, else the family's attention projections."""
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets

    return list(targets.get(model_type, _FALLBACK_TARGETS))


def check_targets(model: Any, targets: list[str]) -> None:
    """TrainerError naming the targets that match no module of the model (peft matches by name suffix)."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise TrainerError(f"lora_target_modules {missing} match no module of this {model.config.model_type} "
                           f"model (its linear layers: {', '.join(linear)})")


def lora_config(cfg: CausalLMConfig, targets: list[str]) -> Any:
    """The peft LoraConfig for the job."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


def with_lora(model: Any, cfg: CausalLMConfig) -> Any:
    """The model wrapped with the job's LoRA adapter (its targets checked first)."""
    from peft import get_peft_model

    targets = target_modules(cfg, model.config.model_type)
    check_targets(model, targets)
    return get_peft_model(model, lora_config(cfg, targets))


def adapter_tensors(model: Any) -> dict[str, Any]:
    """The adapter's tensors, under the keys peft saves them with (adapter_model.safetensors)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}


def adapter_key(parameter: str) -> str:
    """An adapter parameter's name as `adapter_tensors` keys it (peft drops the adapter's name, `default`)."""
    return parameter.replace(".default.", ".")


def full_tensors(model: Any) -> dict[str, Any]:
    """All the model's weights; tied ones copied apart (safetensors stores no shared storage)."""
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}


def set_weights(model: Any, tensors: dict[str, Any], *, adapter: bool) -> None:
    """Load the round's global weights into the model; TrainerError if their keys are not the model's."""
    expected = set(adapter_tensors(model) if adapter else model.state_dict())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise TrainerError(f"global weights do not fit this model: missing {missing[:3]}, unexpected {extra[:3]}")
    if adapter:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, tensors)
    else:
        model.load_state_dict(tensors, strict=True)
