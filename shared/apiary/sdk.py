"""Helpers for the user's training function: move weights between a model and Apiary."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from apiary.shard_state import SCAFFOLD_STATE


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


# The server control variate c in payload["server_state"] (apiary.strategies.scaffold.CONTROL).
SCAFFOLD_SERVER = "control."


class Scaffold:
    """SCAFFOLD's client side (`distributed.strategy: scaffold`; Karimireddy et al., 2020, Algorithm 1): corrects
    each step's gradients to `g - c_i + c` and returns the shard's new control variate with the result. In a job of
    any other strategy every call does nothing, so a training loop may always use it::

        scaffold = Scaffold(model, payload, lr=lr)   # lr: the local SGD step (eta_l); None for another optimiser
        for batch in batches:
            loss.backward()
            scaffold.correct()                       # between backward() and optimizer.step()
            optimizer.step()
        return scaffold.finish({"weights": get_weights(model), "samples": n})

    c_i comes from the shard's state (zero in its first round), c from the round's server state (zero in round 1).
    The update of c_i is the job's `control_variate_update` (env SCAFFOLD): II (default) is
    `c_i - c + (x - y_i) / (K * lr)` over the K corrected steps, which assumes plain SGD at `lr`; with `lr=None`
    it takes the mean of the K raw gradients instead (what II equals under SGD), for any optimiser. I is the
    gradient at the global weights x: that of the first step's batch (the paper's full-data gradient, estimated).
    """

    def __init__(self, model: torch.nn.Module, payload: Mapping[str, Any], lr: float | None = None,
                 names: Callable[[str], str] | None = None) -> None:
        """`names` maps a parameter's name to its tensor's name in the update, where they differ (a PEFT model's
        `...lora_A.default.weight` travels as `...lora_A.weight`)."""
        env = payload.get("env") or {}
        self.option = str(env.get("SCAFFOLD") or "")
        self.active = self.option in ("I", "II")
        self.lr, self.steps = lr, 0
        key = names or (lambda name: name)
        self._params = {key(n): p for n, p in model.named_parameters() if p.requires_grad} if self.active else {}
        state, server = payload.get("state") or {}, payload.get("server_state") or {}
        self._c_i: dict[str, torch.Tensor] = {}
        self._correction: dict[str, torch.Tensor] = {}
        self._start: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}  # option I: the first gradient; lr None: the raw gradients' sum
        for name, param in self._params.items():
            like = param.detach()
            c_i = _control(state, SCAFFOLD_STATE + name, like)
            c = _control(server, SCAFFOLD_SERVER + name, like)
            self._c_i[name], self._correction[name] = c_i, c - c_i
            self._start[name] = like.clone()

    @torch.no_grad()
    def correct(self) -> None:
        """Turn each parameter's gradient g into `g - c_i + c` (call once per step, before the optimiser's step)."""
        if not self.active:
            return
        for name, param in self._params.items():
            if param.grad is None:
                continue
            if self.option == "I":
                if self.steps == 0:
                    self._grads[name] = param.grad.detach().clone()
            elif self.lr is None:
                total = self._grads.get(name)
                self._grads[name] = param.grad.detach().clone() if total is None else total.add_(param.grad)
            param.grad.add_(self._correction[name])
        self.steps += 1

    @torch.no_grad()
    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """The training function's result with the shard's new control variate in its `state` (the aggregator
        derives the change `Δc_i` it folds from this and the shard's previous state); the result unchanged when
        SCAFFOLD is off."""
        if not self.active:
            return result
        state = dict(result.get("state") or {})
        for name, param in self._params.items():
            state[SCAFFOLD_STATE + name] = self._new_control(name, param.detach(), self._c_i[name]).to("cpu")
        return {**result, "state": state}

    def _new_control(self, name: str, current: torch.Tensor, c_i: torch.Tensor) -> torch.Tensor:
        if self.steps == 0:
            return c_i.clone()
        if self.option == "I":
            return self._grads.get(name, c_i).clone()
        if self.lr is None:
            total = self._grads.get(name)
            return c_i.clone() if total is None else total / self.steps
        # c_i - c + (x - y) / (K * lr), with c - c_i the correction applied at every step.
        return (self._start[name] - current).div_(self.steps * self.lr).sub_(self._correction[name])


def _control(tensors: Mapping[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
    """A control variate's tensor for a parameter like `like` (zeros where the map has none), on its device."""
    tensor = tensors.get(key)
    if tensor is None:
        return torch.zeros_like(like)
    if tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{key} is {list(tensor.shape)}, its parameter {list(like.shape)}")
    return tensor.to(device=like.device, dtype=like.dtype)
