"""SCAFFOLD (issue 41): the `scaffold` strategy with apiary.sdk.Scaffold in the training loop gives what a direct
implementation of the paper's Algorithm 1 gives (Karimireddy et al., 2020), round after round, to 1e-6."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from apiary import weights as w
from apiary.sdk import Scaffold, get_weights
from apiary.shard_state import CONTROL_DELTA
from apiary.strategies.base import Contribution, create
from apiary.strategies.format import UpdateFormat
from apiary.strategies.scaffold import control_deltas, control_of
from apiary.strategies.validation import InvalidContribution

N, K, LR = 4, 5, 0.05  # clients (shards), local steps, local step size
SAMPLED = [[0, 1, 2, 3], [0, 2, 3], [1, 2], [3, 1, 0]]  # the clients S of each round


def client_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each client's regression data, drawn so that their optima differ (the drift SCAFFOLD corrects)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(N):
        x = torch.randn(16, 3, generator=g) + i
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) * (1 + i) + torch.randn(16, 1, generator=g) * 0.1
        out.append((x, y))
    return out


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return torch.nn.functional.mse_loss(model(x), y)


def gradient(params: Mapping[str, torch.Tensor], data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full-batch gradient of the client's loss at `params` (plain autograd, no Apiary code)."""
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    x, y = data
    loss = torch.nn.functional.mse_loss(x @ leaves["weight"].T + leaves["bias"], y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {n: g.detach() for n, g in zip(leaves, grads, strict=True)}


def algorithm_1(x0: Mapping[str, torch.Tensor], data: list, option: str, eta_g: float) -> tuple[dict, dict]:
    """The paper's Algorithm 1, written out directly: the global x and c after the rounds of SAMPLED."""
    x = {n: t.clone() for n, t in x0.items()}
    c = {n: torch.zeros_like(t) for n, t in x.items()}
    c_i = [{n: torch.zeros_like(t) for n, t in x.items()} for _ in range(N)]
    for clients in SAMPLED:
        dy, dc = [], []
        for i in clients:
            y = {n: t.clone() for n, t in x.items()}
            for _ in range(K):
                g = gradient(y, data[i])
                y = {n: y[n] - LR * (g[n] - c_i[i][n] + c[n]) for n in y}
            if option == "I":
                new = gradient(x, data[i])
            else:
                new = {n: c_i[i][n] - c[n] + (x[n] - y[n]) / (K * LR) for n in x}
            dy.append({n: y[n] - x[n] for n in x})
            dc.append({n: new[n] - c_i[i][n] for n in x})
            c_i[i] = new
        s = len(clients)
        x = {n: x[n] + eta_g * sum(d[n] for d in dy) / s for n in x}
        c = {n: c[n] + s / N * (sum(d[n] for d in dc) / s) for n in x}
    return x, c


def with_apiary(x0: Mapping[str, torch.Tensor], data: list, option: str, eta_g: float) -> tuple[dict, dict]:
    """The same rounds through Apiary's pieces: the training loop with apiary.sdk.Scaffold, each shard's state and
    the server state as stored bytes, and a fresh `scaffold` strategy per round that loads the server state."""
    x = {n: t.clone() for n, t in x0.items()}
    server_state = b""
    states: dict[int, bytes] = {}
    for clients in SAMPLED:
        contributions = []
        for i in clients:
            model = torch.nn.Linear(3, 1).double()
            model.load_state_dict(x)
            payload = {"env": {"SCAFFOLD": option}, "state": w.loads(states[i]) if i in states else {},
                       "server_state": w.loads(server_state) if server_state else {}}
            scaffold = Scaffold(model, payload, lr=LR)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for _ in range(K):
                optimizer.zero_grad()
                loss_of(model, data[i]).backward()
                scaffold.correct()
                optimizer.step()
            result = scaffold.finish({"weights": get_weights(model), "samples": 16})
            previous, states[i] = w.loads(states[i]) if i in states else {}, w.dumps(result["state"])
            # The worker uploads its weights and its new state; the aggregator derives Δc_i from the states.
            assert "control_delta" not in result
            deltas = control_deltas(w.loads(states[i]), previous)
            contributions.append(Contribution({**w.loads(w.dumps(result["weights"])), **deltas}, result["samples"]))
        strategy = create("scaffold", {"server_learning_rate": eta_g, "control_variate_update": option})
        strategy.population(N)
        strategy.load_state(w.loads(server_state) if server_state else {})
        strategy.begin(w.spec_of_tensors(x), UpdateFormat.FULL)
        for contribution in contributions:
            strategy.accept(contribution)
        x = strategy.finish(x if strategy.wants_global_weights() else None).weights
        server_state = w.dumps(strategy.state())
    return x, control_of(w.loads(server_state))


@pytest.mark.parametrize(("option", "eta_g"), [("II", 1.0), ("II", 0.7), ("I", 1.0)])
def test_rounds_match_a_direct_implementation_of_algorithm_1(option: str, eta_g: float) -> None:
    torch.manual_seed(0)
    x0 = {n: t.double() for n, t in torch.nn.Linear(3, 1).state_dict().items()}
    data = [(x.double(), y.double()) for x, y in client_data()]

    want_x, want_c = algorithm_1(x0, data, option, eta_g)
    got_x, got_c = with_apiary(x0, data, option, eta_g)

    for name in want_x:
        assert torch.allclose(got_x[name], want_x[name], rtol=0, atol=1e-6), name
        assert torch.allclose(got_c[name], want_c[name], rtol=0, atol=1e-6), name
    assert any(float(t.abs().max()) > 1e-3 for t in want_c.values())  # the control variate did move


def test_in_a_job_of_another_strategy_the_helper_changes_nothing() -> None:
    model = torch.nn.Linear(2, 1)
    scaffold = Scaffold(model, {"env": {}, "state": {}, "server_state": {}}, lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()

    scaffold.correct()

    assert torch.equal(model.weight.grad, before)
    assert scaffold.finish({"weights": {}, "samples": 1}) == {"weights": {}, "samples": 1}


def test_a_contribution_with_a_bad_control_delta_is_refused_and_leaves_the_round_usable() -> None:
    spec = {"w": w.TensorSpec(torch.float32, (2,))}
    strategy = create("scaffold")
    strategy.population(2)
    strategy.begin(spec, UpdateFormat.FULL)
    strategy.accept(Contribution({"w": torch.ones(2), CONTROL_DELTA + "w": torch.ones(2)}, 3))

    for bad in ({"w": torch.ones(2), CONTROL_DELTA + "w": torch.tensor([1.0, float("nan")])},
                {"w": torch.ones(2), CONTROL_DELTA + "w": torch.ones(3)},
                {"w": torch.ones(2), CONTROL_DELTA + "v": torch.ones(2)},
                {"w": torch.ones(2)}):
        with pytest.raises(InvalidContribution):
            strategy.accept(Contribution(bad, 3))
    strategy.accept(Contribution({"w": torch.full((2,), 3.0), CONTROL_DELTA + "w": torch.full((2,), 3.0)}, 1))

    result = strategy.finish()
    assert torch.equal(result.weights["w"], torch.full((2,), 2.0))  # unweighted, as the paper's mean
    assert torch.equal(control_of(strategy.state())["w"], torch.full((2,), 2.0))  # |S| / N = 1


def test_a_round_refolded_after_a_restart_in_another_order_gives_the_same_bits() -> None:
    # Prepare: a round's contributions, and c from the round before (as the aggregator stores it)
    gen = torch.Generator().manual_seed(3)
    spec = {"w": w.TensorSpec(torch.float32, (64,)), "n": w.TensorSpec(torch.int64, ())}
    contributions = [Contribution({"w": torch.randn(64, generator=gen), "n": torch.tensor(i),
                                   CONTROL_DELTA + "w": torch.randn(64, generator=gen)}, 1 + i) for i in range(5)]
    previous = {"control.w": torch.randn(64, generator=gen)}

    def aggregate(order: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        strategy = create("scaffold", {"server_learning_rate": 0.5})  # a fresh aggregator: state from storage
        strategy.population(8)
        strategy.load_state(w.loads(w.dumps(previous)))
        strategy.begin(spec, UpdateFormat.FULL)
        for i in order:
            strategy.accept(contributions[i])
        result = strategy.finish({"w": torch.zeros(64), "n": torch.tensor(0)})
        return result.weights, strategy.state()

    # Execute
    weights, state = aggregate([0, 1, 2, 3, 4])
    again, again_state = aggregate([3, 1, 4, 0, 2])

    # Assert
    assert torch.equal(weights["w"], again["w"]) and torch.equal(state["control.w"], again_state["control.w"])
    assert not torch.equal(state["control.w"], previous["control.w"])
