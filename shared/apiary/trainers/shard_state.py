"""The training child's side of shard state (apiary.shard_state): the state handed into the training function, its
personal layers put into the initial weights, and what the function returned split into the upload (weights and
control deltas) and the shard's new state, written and checked before anything leaves the worker."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from apiary import weights as w
from apiary.shard_state import PERSONAL, personal_names, state_error
from apiary.trainers.base import TrainCall, TrainerError


class ShardStateError(TrainerError):
    """The state a training function returned cannot be kept (one line: what and why)."""


@dataclass
class Carried:
    """A call's shard state, server state and personal layers."""

    call: TrainCall
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    server_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def personalise(self, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The round's global weights with this shard's personal layers (from its state) in place."""
        for name in personal_names(initial, self.call.personal_layers):
            kept = self.state.get(PERSONAL + name)
            if kept is not None and kept.shape == initial[name].shape and kept.dtype == initial[name].dtype:
                initial[name] = kept
        return initial

    def user_state(self) -> dict[str, torch.Tensor]:
        """`payload["state"]`: the shard's state without its personal layers (those are in the weights)."""
        return {k: v for k, v in self.state.items() if not k.startswith(PERSONAL)}

    def split(self, function: str, result: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tensors to upload (the weights without personal layers), and the result's fields of the shard's new
        state (`state_size`, `state_sha256`; none if it returned none). SCAFFOLD's control-variate change is not
        uploaded: the aggregator derives it from the new state and the previous one."""
        weights = result["weights"]
        if not hasattr(weights, "items"):
            return weights, {}  # save_result says why
        returned = result.get("state") or {}
        if not hasattr(returned, "items") or not all(isinstance(t, torch.Tensor) for t in returned.values()):
            raise ShardStateError(f"{function} returned 'state' that is not a name -> tensor mapping")
        personal = personal_names(weights, self.call.personal_layers)
        new_state = {**returned, **{PERSONAL + name: weights[name] for name in sorted(personal)}}
        upload = {name: t for name, t in weights.items() if name not in personal}
        return upload, self._write(new_state)

    def _write(self, new_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        if not new_state:
            return {}
        if self.call.state_result_path is None:
            raise ShardStateError("this worker was given nowhere to store the shard's state (an older scheduler?)")
        try:
            data = w.dumps(new_state)
        except Exception as e:
            raise ShardStateError(f"the shard's state cannot be saved: {e}") from None
        limit = self.call.state_limit if self.call.state_limit is not None else len(data)
        why = state_error(w.spec_of(data), w.spec_of_tensors(self.state), len(data), limit)
        if why is not None:
            raise ShardStateError(why)
        path = Path(self.call.state_result_path)
        part = path.with_name(path.name + ".part")
        part.write_bytes(data)
        part.replace(path)
        return {"state_size": len(data), "state_sha256": hashlib.sha256(data).hexdigest()}


def load(call: TrainCall) -> Carried:
    """The call's shard state and server state, read from their files (empty where it has none)."""
    return Carried(call, _read(call.state_path), _read(call.server_state_path))


def _read(path: str | None) -> dict[str, torch.Tensor]:
    if not path or not Path(path).is_file():
        return {}
    return w.loads(Path(path).read_bytes())
