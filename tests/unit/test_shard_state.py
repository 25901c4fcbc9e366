"""Shard state's pure rules (issue 41): the bound and the shape check, personal layers' globs, the worker's split of
a training result into upload and state, and the `shard state:` line of apiary status."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apiary import weights as w
from apiary.shard_state import (
    CONTROL_DELTA,
    PERSONAL,
    SCAFFOLD_STATE,
    personal_layers_error,
    state_error,
    state_limit,
)
from apiary.strategies.scaffold import control_deltas
from apiary.trainers import TrainCall
from apiary.trainers.shard_state import Carried, ShardStateError
from services.app.render import shard_state_text

SPEC = {"c": w.TensorSpec(torch.float32, (3,))}


def test_a_state_may_take_any_shape_first_then_keeps_it_and_stays_within_the_bound() -> None:
    assert state_limit(1000) == 4000 + 2**20
    assert state_error(SPEC, None, 10, 100) is None and state_error(SPEC, {}, 10, 100) is None
    assert state_error(SPEC, dict(SPEC), 10, 100) is None
    assert state_error(SPEC, SPEC, 101, 100) == (
        "shard state is 101 bytes, over the bound of 100 (4x the model plus 1 MiB)")
    assert state_error(SPEC, {"c": w.TensorSpec(torch.float32, (4,))}, 10, 100) == (
        "shard state tensor 'c' is float32[3], last round's was float32[4]")
    assert state_error(SPEC, {"d": SPEC["c"]}, 10, 100) == (
        "shard state names differ from last round's: missing ['d'], extra ['c']")


def test_personal_layers_must_split_the_model() -> None:
    names = ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    assert personal_layers_error(names, ["fc.*"]) is None
    assert "match no tensor of the model" in (personal_layers_error(names, ["head.*"]) or "")
    assert "match every tensor of the model: nothing would be aggregated" in (personal_layers_error(names, ["*"]) or "")
    assert personal_layers_error(names, []) is None


def _call(tmp_path: Path, personal: list[str]) -> TrainCall:
    return TrainCall(module="m", function="fl_train_model", weights_path="", result_path="", out_dir="", env={},
                     dataset={}, round={}, job={}, state_result_path=str(tmp_path / "state.safetensors"),
                     state_limit=10_000, personal_layers=personal)


def test_the_worker_keeps_personal_layers_out_of_its_upload_and_writes_the_state(tmp_path: Path) -> None:
    # Prepare: the shard's previous state holds its own head
    carried = Carried(_call(tmp_path, ["fc.*"]), state={PERSONAL + "fc.w": torch.full((2,), 7.0),
                                                        "mine": torch.zeros(1)})
    initial = carried.personalise({"conv.w": torch.zeros(2), "fc.w": torch.zeros(2)})

    # Execute
    upload, out = carried.split("fl_train_model", {
        "weights": {"conv.w": torch.ones(2), "fc.w": torch.full((2,), 8.0)}, "samples": 1,
        "state": {"mine": torch.ones(1)}})

    # Assert
    assert torch.equal(initial["fc.w"], torch.full((2,), 7.0)) and carried.user_state().keys() == {"mine"}
    assert set(upload) == {"conv.w"}
    kept = w.loads((tmp_path / "state.safetensors").read_bytes())
    assert set(kept) == {"mine", PERSONAL + "fc.w"} and torch.equal(kept[PERSONAL + "fc.w"], torch.full((2,), 8.0))
    assert out["state_size"] == (tmp_path / "state.safetensors").stat().st_size


def test_scaffolds_control_deltas_are_derived_from_the_shards_new_and_previous_state() -> None:
    new = {SCAFFOLD_STATE + "w": torch.tensor([3.0, 5.0]), SCAFFOLD_STATE + "b": torch.ones(1), "mine": torch.ones(1)}
    previous = {SCAFFOLD_STATE + "w": torch.tensor([1.0, 1.0])}

    deltas = control_deltas(new, previous)

    # Δc_i = c_i⁺ - c_i; c_i is zero where the shard had none (its first round, as its worker took it).
    assert set(deltas) == {CONTROL_DELTA + "w", CONTROL_DELTA + "b"}
    assert torch.equal(deltas[CONTROL_DELTA + "w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(deltas[CONTROL_DELTA + "b"], torch.ones(1))


def test_a_state_over_the_bound_or_not_tensors_fails_the_shard_in_one_line(tmp_path: Path) -> None:
    carried = Carried(_call(tmp_path, []))
    with pytest.raises(ShardStateError, match=r"^shard state is \d+ bytes, over the bound of 10000"):
        carried.split("f", {"weights": {}, "samples": 1, "state": {"big": torch.zeros(5000)}})
    with pytest.raises(ShardStateError, match=r"^f returned 'state' that is not a name -> tensor mapping$"):
        carried.split("f", {"weights": {}, "samples": 1, "state": {"x": 3}})
    assert not (tmp_path / "state.safetensors").exists()


def test_status_says_what_each_shard_keeps() -> None:
    assert shard_state_text(None) is None
    assert shard_state_text({"bytes_per_shard": {0: 80_000, 1: 80_000}, "total_bytes": 160_000,
                             "server_state_bytes": 59_280}) == (
        "shard state: 2 shards, 80.0 kB each (160.0 kB in all); server state 59.3 kB a round to each worker")


@pytest.mark.parametrize(("distributed", "what"), [
    ({"strategy": "scaffold"}, "strategy 'scaffold'"),
    ({"personal_layers": ["head.*"]}, "personal_layers"),
])
@pytest.mark.parametrize("transfer", [{"delta": True}, {"upload": "int8_blockwise"}])
def test_state_carrying_uploads_refuse_an_encoded_upload_in_one_line(distributed: dict[str, object], what: str,
                                                                    transfer: dict[str, object]) -> None:
    from apiary.jobspec import JobSpec, strategy_errors

    spec = JobSpec.model_validate({"name": "s", "entrypoint": "pkg.train", "dataset": "data",
                                   "distributed": {"max_workers": 2, **distributed, "transfer": transfer}})
    errors = strategy_errors(spec)

    assert [e.field for e in errors] == ["distributed.transfer"]
    assert errors[0].message.startswith(f"{what} uploads tensors the global weights do not hold")
