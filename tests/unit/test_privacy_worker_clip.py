"""clip_on worker: the training child rewrites its saved result with the update clipped, so that the aggregator,
measuring it from the stored float32 weights, finds it within the norm; a result that does not fit the round's
weights fails in one line."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from apiary.strategies.clipping import update_norm
from apiary.strategies.private import seeded
from apiary.trainers.base import TrainCall
from apiary.trainers.child import UserCodeError, save_trained
from apiary.weights import dumps, loads


def call(tmp_path: Path, clipping_norm: float | None) -> TrainCall:
    return TrainCall(module="m", function="fl_train_model", weights_path=str(tmp_path / "global.safetensors"),
                     result_path=str(tmp_path / "result.safetensors"), out_dir=str(tmp_path / "out"), env={},
                     dataset={}, round={}, job={}, clipping_norm=clipping_norm)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])  # updates small and large next to the weights
def test_the_saved_update_is_within_the_norm_the_aggregator_measures(tmp_path: Path, scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(64, 32, generator=gen) * 10, "b": torch.randn(7, generator=gen),
             "steps": torch.tensor(3)}
    trained = {k: (v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1)
               for k, v in start.items()}
    (tmp_path / "global.safetensors").write_bytes(dumps(start))
    norm_bound = 0.5 * update_norm(trained, start)

    size, sha256 = save_trained(call(tmp_path, norm_bound), trained, "fl_train_model")

    data = (tmp_path / "result.safetensors").read_bytes()
    assert (size, sha256) == (len(data), hashlib.sha256(data).hexdigest())
    saved = loads(data)
    # Within the bound always; close under it (float32 rounding of `weights + update` limits how close when the
    # update is a thousandth of the weights).
    assert 0.99 * norm_bound <= update_norm(saved, start) <= norm_bound
    assert torch.equal(saved["steps"], trained["steps"])  # an integer counter is not clipped


def test_an_update_within_the_norm_is_saved_as_is(tmp_path: Path) -> None:
    start = {"a": torch.zeros(3)}
    (tmp_path / "global.safetensors").write_bytes(dumps(start))

    save_trained(call(tmp_path, 10.0), {"a": torch.ones(3)}, "fl_train_model")

    assert torch.equal(loads((tmp_path / "result.safetensors").read_bytes())["a"], torch.ones(3))


def test_a_result_that_does_not_fit_the_rounds_weights_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "global.safetensors").write_bytes(dumps({"a": torch.zeros(3)}))

    with pytest.raises(UserCodeError, match=r"^fl_train_model returned weights whose update cannot be clipped for "
                                            r"differential privacy: tensor 'a' is torch.float32 \(4,\)"):
        save_trained(call(tmp_path, 1.0), {"a": torch.ones(4)}, "fl_train_model")


def test_a_worker_that_noises_adds_gaussian_noise_of_its_std_in_float64_after_clipping(tmp_path: Path) -> None:
    start = {"a": torch.zeros(200, 500), "steps": torch.tensor(3)}
    trained = {"a": torch.full((200, 500), 0.01), "steps": torch.tensor(4)}
    (tmp_path / "global.safetensors").write_bytes(dumps(start))
    noised = replace(call(tmp_path, 0.5), noise_std=0.2, noise_seed=99)

    save_trained(noised, trained, "fl_train_model")
    saved = loads((tmp_path / "result.safetensors").read_bytes())
    save_trained(noised, trained, "fl_train_model")
    again = loads((tmp_path / "result.safetensors").read_bytes())
    save_trained(replace(noised, noise_seed=None), trained, "fl_train_model")
    unseeded = loads((tmp_path / "result.safetensors").read_bytes())

    clipped = torch.full((200, 500), 0.01) * (0.5 / update_norm(trained, start))  # clipped to 0.5 first
    noise = torch.from_numpy(seeded(99, 0, "a").normal(0.0, 0.2, (200, 500)))
    # The seed's draws on the clipped update (float32 rounding apart).
    assert torch.allclose(saved["a"].double(), clipped.double() + noise, rtol=0, atol=1e-6)
    assert float((saved["a"].double() - clipped.double()).std()) == pytest.approx(0.2, rel=0.01)
    assert torch.equal(saved["a"], again["a"]) and not torch.equal(saved["a"], unseeded["a"])
    assert torch.equal(saved["steps"], torch.tensor(4))  # an integer counter gets no noise
