"""Helpers for the user's training function: move weights between a model and Apiary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class MetricsLogger(Protocol):
    """The `logger` a training function receives."""

    def log_metrics(self, step: int | None = None, **metrics: Any) -> None:
        """Record numeric metrics (a point on this worker's live curves)."""

    def info(self, message: str, *args: Any) -> None:
        """A line for the worker's log."""


def get_weights(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights as CPU tensors, detached; with `trainable_only`, only parameters that
    require grad (e.g. a PEFT adapter), for jobs with `use_peft`."""
    if trainable_only:
        return {name: p.detach().to("cpu").clone() for name, p in model.named_parameters() if p.requires_grad}
    return {name: t.detach().to("cpu").clone() for name, t in model.state_dict().items()}


def set_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load weights into the model, on the model's device; with `strict=False` a subset (an adapter)
    may be given, but every name given must exist in the model."""
    own = model.state_dict()
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"weights name tensors the model does not have: {unknown[:3]}")
    if strict:
        missing = sorted(set(own) - set(weights))
        if missing:
            raise ValueError(f"weights lack tensors the model has: {missing[:3]} (pass strict=False for a subset)")
    model.load_state_dict(dict(weights), strict=False)


class NullLogger:
    """A logger that drops everything, for calling a training function outside Apiary."""

    def log_metrics(self, step: int | None = None, **metrics: Any) -> None:
        """Ignore metrics."""

    def info(self, message: str, *args: Any) -> None:
        """Ignore a log line."""


def proximal_term(model: torch.nn.Module, global_weights: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term, `mu / 2 * sum ||w - w_global||^2` over the trainable parameters: add it to
    the loss (with `mu` from env PROXIMAL_MU) to keep local training near the round's global weights."""
    total = torch.zeros(())
    for name, param in model.named_parameters():
        if param.requires_grad:
            anchor = global_weights[name].to(device=param.device, dtype=param.dtype)
            total = total.to(param.device) + (param - anchor).pow(2).sum()
    return mu / 2 * total
