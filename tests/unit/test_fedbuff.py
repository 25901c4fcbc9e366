"""Mode async's pure parts against a direct FedBuff re-implementation (tests/fixtures/fedbuff.py): the staleness
weights, the buffer's fold and server step over several versions, the FedOpt server optimisers, the job
settings' one-line refusals and how tasks pick shards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from pydantic import ValidationError

from apiary.jobspec import JobSpec, field_errors
from apiary.jobspec_async import AsyncConfig
from apiary.strategies.base import Contribution, create
from apiary.strategies.buffered import Buffer, inner_strategy, staleness_weight
from apiary.strategies.format import UpdateFormat
from apiary.strategies.validation import InvalidContribution
from apiary.weights import spec_of_tensors
from services.scheduler.async_rounds import next_shards
from tests.fixtures import fedbuff


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
@pytest.mark.parametrize("staleness", [0, 1, 2, 4, 5, 9, 40])
def test_staleness_weight_is_flsims(kind: str, staleness: int) -> None:
    settings = AsyncConfig(staleness_weight=kind, staleness_exponent=0.7, hinge_a=2.0, hinge_b=4)

    got = staleness_weight(settings, staleness)

    assert got == pytest.approx(fedbuff.weight(kind, staleness, 0.7, 2.0, 4), rel=1e-12)
    assert 0 < got <= 1


def test_staleness_weight_values() -> None:
    assert staleness_weight(AsyncConfig(staleness_weight="polynomial"), 3) == pytest.approx(0.5)  # (1+3)^-0.5
    assert staleness_weight(AsyncConfig(staleness_weight="hinge", hinge_a=1, hinge_b=2), 4) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="negative"):
        staleness_weight(AsyncConfig(), -1)


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=gen), "a.bias": torch.randn(3, generator=gen),
            "steps": torch.tensor(seed, dtype=torch.int64)}


def _run(settings: AsyncConfig, strategy: str, plan: list[list[tuple[int, int, int]]],
         params: dict[str, float] | None = None) -> tuple[list[dict[str, torch.Tensor]], list[list[fedbuff.Update]]]:
    """Versions made by Buffer from a plan of (start version, samples, seed) per update, and the updates."""
    made = [_model(0)]
    inner = inner_strategy(strategy, params or {}, settings)
    state: dict[str, torch.Tensor] = {}
    versions: list[list[fedbuff.Update]] = []
    for index, updates in enumerate(plan, start=1):
        buffer = Buffer(inner_strategy(strategy, params or {}, settings), settings)
        buffer.load_state(state)
        buffer.begin(spec_of_tensors(made[-1]), UpdateFormat.FULL, made[-1])
        folded = []
        for start_version, samples, seed in updates:
            start = made[start_version]
            trained = {k: (v + 0.1 * _model(seed)[k] if v.is_floating_point() else v + 1) for k, v in start.items()}
            staleness = index - 1 - start_version
            buffer.accept(Contribution(trained, samples), start, staleness)
            folded.append(fedbuff.Update(trained, start, samples, staleness))
        result = buffer.finish()
        state = {k: v.clone() for k, v in buffer.state().items()}
        made.append(result.weights)
        versions.append(folded)
    del inner
    return made[1:], versions


PLAN = [[(0, 5, 1), (0, 3, 2)], [(0, 4, 3), (1, 6, 4), (1, 2, 5)], [(1, 5, 6), (2, 5, 7)], [(0, 9, 8), (3, 1, 9)]]


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
@pytest.mark.parametrize(("lr", "momentum"), [(1.0, 0.0), (0.7, 0.0), (1.3, 0.9)])
def test_buffer_versions_are_fedbuffs(kind: str, lr: float, momentum: float) -> None:
    settings = AsyncConfig(staleness_weight=kind, hinge_a=3.0, hinge_b=1, server_learning_rate=lr,
                           server_momentum=momentum).resolved(4)

    made, versions = _run(settings, "federated_averaging", PLAN)
    expected = fedbuff.fedbuff(_model(0), versions, g=lambda s: fedbuff.weight(kind, s, 0.5, 3.0, 1), lr=lr,
                               momentum=momentum)

    for got, want in zip(made, expected, strict=True):
        for name, tensor in want.items():
            torch.testing.assert_close(got[name].double(), tensor, rtol=1e-5, atol=1e-5)


def test_server_momentum_is_torch_sgd_as_flsims_server_optimiser() -> None:
    # FLSim steps its global model with torch.optim.SGD on the negated buffered delta as the gradient.
    settings = AsyncConfig(staleness_weight="polynomial", server_learning_rate=0.5, server_momentum=0.8).resolved(4)
    made, versions = _run(settings, "federated_averaging", PLAN)
    model = torch.nn.Parameter(_model(0)["a.weight"].double().clone())
    optimiser = torch.optim.SGD([model], lr=0.5, momentum=0.8)

    for got, updates in zip(made, versions, strict=True):
        total = sum(u.samples for u in updates)
        delta = sum(u.samples * fedbuff.weight("polynomial", u.staleness) * (u.weights["a.weight"].double()
                    - u.start["a.weight"].double()) for u in updates) / total
        optimiser.zero_grad()
        model.grad = -delta
        optimiser.step()
        torch.testing.assert_close(got["a.weight"].double(), model.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["fedadam", "fedyogi", "fedadagrad"])
def test_fedopt_server_optimisers_step_on_fedbuffs_buffered_delta(strategy: str) -> None:
    # The optimiser sees the mean x + D: the same step as the synchronous strategy given that mean.
    settings = AsyncConfig(staleness_weight="polynomial").resolved(4)
    made, versions = _run(settings, strategy, PLAN[:2], {"eta": 0.05})
    reference = create(strategy, {"eta": 0.05})
    current = _model(0)
    for got, updates in zip(made, versions, strict=True):
        total = sum(u.samples for u in updates)
        mean = {k: (v.double() + sum(u.samples * fedbuff.weight("polynomial", u.staleness) * (
            u.weights[k].double() - u.start[k].double()) for u in updates) / total).float()
            if v.is_floating_point() else updates[-1].weights[k] for k, v in current.items()}
        reference.begin(spec_of_tensors(current), UpdateFormat.FULL, current)
        reference.accept(Contribution(mean, 1))
        want = reference.finish(current).weights
        for name in ("a.weight", "a.bias"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        current = got


def test_buffer_refuses_a_bad_update_before_folding_it() -> None:
    settings = AsyncConfig().resolved(4)
    buffer = Buffer(inner_strategy("federated_averaging", {}, settings), settings)
    x = _model(0)
    buffer.begin(spec_of_tensors(x), UpdateFormat.FULL, x)
    nan = {**x, "a.bias": torch.full((3,), float("nan"))}
    shape = {**x, "a.bias": torch.zeros(4)}

    with pytest.raises(InvalidContribution, match="NaN"):
        buffer.accept(Contribution(nan, 3), x, 0)
    with pytest.raises(InvalidContribution, match=r"a\.bias"):
        buffer.accept(Contribution(shape, 3), x, 0)
    assert buffer.count == 0 and buffer.spoiled is None


def _errors(distributed: dict[str, object]) -> list[str]:
    request = {"name": "n", "dataset": "d", "entrypoint": "m:f", "distributed": distributed}
    try:
        JobSpec.model_validate(request)
    except ValidationError as e:
        return [f"{f.field}: {f.message}" for f in field_errors(e, request)]
    return []


@pytest.mark.parametrize(("distributed", "message"), [
    ({"mode": "async", "strategy": "krum"}, "strategy 'krum' has no asynchronous form"),
    ({"mode": "async", "strategy": "fedmedian"}, "has no asynchronous form"),
    ({"async": {"buffer_size": 3}}, "'async' settings are for mode 'async'"),
    ({"mode": "async", "enabled": False}, "needs federated training"),
    ({"mode": "async", "max_workers": 2, "async": {"concurrency": 3}}, "concurrency (3) exceeds the job's 2 shards"),
    ({"mode": "async", "strategy": "fedadam", "async": {"server_momentum": 0.9}}, "takes its own in strategy_params"),
    ({"mode": "async", "async": {"staleness_weight": "linear"}}, "distributed.async.staleness_weight"),
    ({"mode": "async", "async": {"buffer_size": 0}}, "distributed.async.buffer_size"),
    ({"mode": "async", "async": {"server_momentum": 1.0}}, "distributed.async.server_momentum"),
    ({"mode": "asynchronous"}, "distributed.mode"),
    ({"mode": "async", "max_workers": 4, "secure_aggregation": {"num_shares": 3, "reconstruction_threshold": 2}},
     "secure_aggregation is not available in mode 'async'"),
    ({"mode": "async", "personal_layers": ["fc.*"]}, "personal_layers are not available in mode 'async'"),
    ({"mode": "async", "transfer": {"upload": "int8_blockwise", "delta": True}},
     "transfer encodings are not available in mode 'async'"),
    ({"mode": "async", "transfer": {"download": "bf16"}}, "transfer encodings are not available in mode 'async'"),
])
def test_bad_async_settings_are_refused_in_one_line(distributed: dict[str, object], message: str) -> None:
    errors = _errors(distributed)

    assert len(errors) == 1 and message in errors[0], errors


def test_async_defaults_come_from_the_jobs_sizes() -> None:
    small = JobSpec.model_validate({"name": "n", "dataset": "d", "entrypoint": "m:f",
                                    "distributed": {"mode": "async", "max_workers": 4}})
    large = JobSpec.model_validate({"name": "n", "dataset": "d", "entrypoint": "m:f",
                                    "distributed": {"mode": "async", "max_workers": 40, "async": {"concurrency": 8}}})
    sync = JobSpec.model_validate({"name": "n", "dataset": "d", "entrypoint": "m:f"})

    assert (small.distributed.buffered.buffer_size, small.distributed.buffered.concurrency) == (4, 4)
    assert (large.distributed.buffered.buffer_size, large.distributed.buffered.concurrency) == (10, 8)
    assert sync.distributed.buffered is None and sync.distributed.mode == "sync"
    # The block round-trips under its wire name (`async`, a Python keyword).
    dumped = large.model_dump(mode="json")["distributed"]
    assert dumped["async"]["concurrency"] == 8 and "async_" not in dumped
    assert JobSpec.model_validate(large.model_dump(mode="json")) == large


def test_next_shards_round_robin() -> None:
    assert next_shards(4, [0, 1, 2, 3], set()) == [0, 1, 2, 3]
    assert next_shards(1, [0, 1, 2, 3], {0, 1}, after=1) == [2]
    assert next_shards(1, [0, 1, 2, 3], {0, 2, 3}, after=1) == [1]  # its own shard when no other waits
    assert next_shards(1, [0, 1, 2, 3], {2}, after=3) == [0]
    assert next_shards(0, [0, 1], set(), after=0) == []


def test_the_buffer_keeps_nothing_of_an_update_once_folded() -> None:
    # Memory does not grow with the buffer size: a folded update (and its rebased copy) is not held anywhere.
    settings = AsyncConfig(buffer_size=50, server_momentum=0.5).resolved(4)
    buffer = Buffer(inner_strategy("federated_averaging", {}, settings), settings)
    x = _model(0)
    buffer.begin(spec_of_tensors(x), UpdateFormat.FULL, x)
    refs = []
    for seed in range(50):
        update = {k: (v + _model(seed + 1)[k] if v.is_floating_point() else v.clone()) for k, v in x.items()}
        refs.append(weakref.ref(update["a.weight"]))
        buffer.accept(Contribution(update, 3), x, seed % 4)
        del update
    gc.collect()

    assert buffer.count == 50
    assert all(ref() is None for ref in refs)
