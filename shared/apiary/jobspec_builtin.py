"""A built-in job's request checks: its config validated key by key against the built-in trainer's, as
errors located under `config`, merged with the request's own in its field order."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from apiary.trainers.causal_lm_config import CausalLMConfig


def did_you_mean(name: str, known: list[str]) -> str:
    """` (did you mean lora_r?)` for a name close to a known one, else ``."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def built_in_errors(data: Any) -> list[InitErrorDetails]:
    """A request without an entrypoint fine-tunes a registered model: without one either, the entrypoint is
    missing; with one, its config's errors for the built-in trainer, located under `config`."""
    if not isinstance(data, dict) or data.get("entrypoint") is not None:
        return []
    if not (data.get("model") or data.get("model_id")):
        # The one line a request naming neither code nor a model gets (a built-in job needs model_id).
        return [{"type": "missing", "loc": ("entrypoint",), "input": data}]
    errors = [by_path_error(data["model"])] if data.get("model") and data.get("model_id") is None else []
    if not isinstance(data.get("config", {}), dict):
        return errors
    try:
        CausalLMConfig.model_validate(data.get("config", {}))
    except ValidationError as e:
        return [*errors, *(config_error(item) for item in e.errors())]
    return errors


def by_path_error(model: Any) -> InitErrorDetails:
    """A built-in job naming its base model by path: the trainer fine-tunes registered models only, which
    workers fetch (and cache) by sha256 from storage, so the path is refused before the job is accepted."""
    error = PydanticCustomError("registered_model", "a built-in job fine-tunes a registered model: register "
                                "{model} with `apiary model add PATH` and give its integer model_id instead",
                                {"model": repr(model)})
    return {"type": error, "loc": ("model",), "input": model}


def config_error(item: Any) -> InitErrorDetails:
    """One of CausalLMConfig's errors, under `config`; an unknown key names the closest known one."""
    loc = ("config", *item["loc"])
    if item["type"] != "extra_forbidden":
        error = PydanticCustomError("config_value", "{msg}", {"msg": item["msg"].removeprefix("Value error, ")})
        return {"type": error, "loc": loc, "input": item["input"]}
    hint = did_you_mean(str(item["loc"][-1]), list(CausalLMConfig.model_fields))
    return {"type": PydanticCustomError("unknown_field", f"unknown field{hint}"), "loc": loc, "input": item["input"]}


def merged_errors(title: str, error: ValidationError, extra: list[InitErrorDetails],
                  fields: list[str]) -> ValidationError:
    """A request's own errors and its built-in config's, as one error."""
    own: list[InitErrorDetails] = [
        {"type": PydanticCustomError(item["type"], "{msg}", {"msg": item["msg"]}), "loc": item["loc"],
         "input": item["input"]}
        for item in error.errors()
    ]
    # In the request's field order, as pydantic reports its own errors.
    order = {name: i for i, name in enumerate(fields)}
    merged = sorted([*own, *extra], key=lambda item: order.get(str(item["loc"][0]) if item["loc"] else "", -1))
    return ValidationError.from_exception_data(title, merged)
