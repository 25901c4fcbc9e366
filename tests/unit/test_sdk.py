"""The user-facing SDK: weights in and out of a model."""

from __future__ import annotations

import pytest
import torch

from apiary.sdk import get_weights, set_weights


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    return model


def test_get_then_set_restores_the_model() -> None:
    source, target = _model(), _model()

    set_weights(target, get_weights(source))

    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_trainable_only_returns_parameters_that_require_grad() -> None:
    assert set(get_weights(_model(), trainable_only=True)) == {"1.weight", "1.bias"}


def test_weights_are_detached_copies() -> None:
    model = _model()
    weights = get_weights(model)

    weights["1.bias"].add_(100)

    assert not torch.equal(weights["1.bias"], model.state_dict()["1.bias"])


def test_subset_needs_strict_false_and_unknown_names_are_refused() -> None:
    model = _model()
    subset = {"1.bias": torch.ones(1)}

    with pytest.raises(ValueError, match="lack tensors"):
        set_weights(model, subset)
    set_weights(model, subset, strict=False)
    with pytest.raises(ValueError, match="does not have"):
        set_weights(model, {"nope": torch.ones(1)}, strict=False)
    assert model.state_dict()["1.bias"].item() == 1.0
