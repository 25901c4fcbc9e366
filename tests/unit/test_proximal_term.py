"""FedProx's proximal term for user code: mu/2 * sum ||w - w_global||^2 over trainable parameters."""

from __future__ import annotations

import pytest
import torch

from apiary.sdk import get_weights, proximal_term


def test_the_term_is_zero_at_the_global_weights_and_grows_with_the_squared_distance() -> None:
    model = torch.nn.Linear(2, 1)
    anchor = get_weights(model)
    with torch.no_grad():
        model.weight.add_(1.0)  # 2 entries off by 1; the bias unchanged

    assert proximal_term(torch.nn.Linear(2, 1).requires_grad_(False), anchor, 0.5) == 0
    assert proximal_term(model, anchor, 0.5).item() == pytest.approx(0.5 / 2 * 2.0)


def test_frozen_parameters_are_left_out_and_the_term_has_a_gradient() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    anchor = {name: torch.zeros_like(t) for name, t in get_weights(model).items()}
    model[0].requires_grad_(False)

    term = proximal_term(model, anchor, 2.0)
    term.backward()

    expected = sum(float(p.detach().pow(2).sum()) for p in model[1].parameters())
    assert term.item() == pytest.approx(expected)
    assert model[1].weight.grad is not None and torch.allclose(model[1].weight.grad, 2.0 * model[1].weight.detach())
