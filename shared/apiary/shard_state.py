"""State that stays with a data shard between rounds (issue 41): what it may hold, and the checks it passes.

A training function receives its shard's state as `payload["state"]` (name -> tensor, empty in the shard's first
round) and may return a new one as `result["state"]`. Apiary stores it per job and shard in storage (never in the
database, never sent to another shard's worker) and hands it to whichever worker trains that shard next. Two
users of it are built in: SCAFFOLD's client control variate (`apiary.sdk.Scaffold`) and personal layers
(`distributed.personal_layers`, FedPer), kept under PERSONAL.

Pure: no I/O; names and shapes come as WeightSpec (apiary.weights), so the aggregator checks a stored state by its
header alone.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker's process reads the bound and must not import torch
    from apiary.weights import TensorSpec

# A shard's personal layers in its state: `personal.<tensor name>` (distributed.personal_layers).
PERSONAL = "personal."
# A contribution's tensors beside its weights that the strategy folds too (SCAFFOLD's control-variate delta):
# `control_delta.<tensor name>`, which the aggregator derives from the shard's new and previous state (nothing
# uploads them: the worker's upload is its weights, and its new state).
CONTROL_DELTA = "control_delta."
# SCAFFOLD's control variate of the shard, in its state (payload["state"] / result["state"]): `scaffold.c_i.<name>`.
SCAFFOLD_STATE = "scaffold.c_i."
# A state may take this many times the round's global weights (plus STATE_SLACK_BYTES): SCAFFOLD's control
# variate is one model, personal layers at most one, a personal model with its optimiser's moments three.
STATE_MODEL_FACTOR = 4
STATE_SLACK_BYTES = 1 << 20


def state_limit(weights_size: int) -> int:
    """The most bytes a shard's stored state may take, for a round whose global weights take `weights_size`."""
    return STATE_MODEL_FACTOR * max(0, weights_size) + STATE_SLACK_BYTES


def state_error(new: Mapping[str, TensorSpec], previous: Mapping[str, TensorSpec] | None, size: int,
                limit: int) -> str | None:
    """Why a shard's new state (its names' specs, `size` bytes stored) cannot replace its previous one, in one
    line; None if it can. Over `limit`, or other names, shapes or dtypes than last round's (a first state, or a
    shard whose previous state was empty, may take any shape)."""
    if size > limit:
        return f"shard state is {size} bytes, over the bound of {limit} (4x the model plus 1 MiB)"
    if not previous:
        return None
    missing, extra = sorted(previous.keys() - new.keys()), sorted(new.keys() - previous.keys())
    if missing or extra:
        return f"shard state names differ from last round's: missing {missing[:3]}, extra {extra[:3]}"
    for name in sorted(new):
        if new[name] != previous[name]:
            return (f"shard state tensor {name!r} is {new[name].describe()}, last round's was "
                    f"{previous[name].describe()}")
    return None


def personal_names(names: Iterable[str], globs: Sequence[str]) -> set[str]:
    """The tensor names that any of `globs` (fnmatch patterns, case-sensitive) matches."""
    return {name for name in names if any(fnmatch.fnmatchcase(name, glob) for glob in globs)}


def personal_layers_error(names: Iterable[str], globs: Sequence[str]) -> str | None:
    """Why `distributed.personal_layers` cannot apply to a model with these tensor names (they match none of
    them, or all of them: nothing would be shared), in one line; None if they split it."""
    if not globs:
        return None
    every = sorted(names)
    matched = personal_names(every, globs)
    if not matched:
        return (f"personal_layers {list(globs)} match no tensor of the model (its tensors: "
                f"{', '.join(every[:5])}{', …' if len(every) > 5 else ''})")
    if len(matched) == len(every):
        return f"personal_layers {list(globs)} match every tensor of the model: nothing would be aggregated"
    return None
