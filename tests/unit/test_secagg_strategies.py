"""Secure aggregation under the weighted-sum strategies and with differential privacy: the round's one unmasked
contribution (apiary.secagg.aggregate) gives what the plain contributions give, within the quantisation bound."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from safetensors.torch import save

from apiary.privacy import DifferentialPrivacy
from apiary.secagg import crypto
from apiary.secagg.aggregate import contribution_of_mean
from apiary.secagg.protocol import Collector, Participant
from apiary.secagg.settings import SecureAggregation
from apiary.secagg.updates import read_tensors, update_vector
from apiary.strategies import base
from apiary.strategies.base import Contribution, Strategy
from apiary.strategies.clipping import clip_for_upload
from apiary.strategies.format import UpdateFormat
from apiary.strategies.private import DifferentiallyPrivate
from apiary.weights import spec_of_tensors

K = 4
CONTEXT = b"job/1/0"


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(16, 8, generator=g), "fc.bias": torch.randn(16, generator=g),
            "steps": torch.tensor(3 + seed, dtype=torch.int64)}


def contributions(global_weights: Mapping[str, torch.Tensor]) -> list[Contribution]:
    out = []
    for i in range(K):
        g = torch.Generator().manual_seed(100 + i)
        weights = {name: (t + 0.05 * torch.randn(t.shape, generator=g)) if t.is_floating_point() else t + i
                   for name, t in global_weights.items()}
        out.append(Contribution(weights, samples=50 * (i + 1)))
    return out


def secure_round(plain: list[Contribution], global_weights: Mapping[str, torch.Tensor]) -> tuple[Contribution, float]:
    """The round through the protocol: each worker's update vector masked, the sum unmasked (one dropped after
    masking, recovered from shares), as the strategy's one contribution; and the bound it is within."""
    params = SecureAggregation(num_shares=1, reconstruction_threshold=2).resolved(K)
    signing = {n: crypto.new_signing_key() for n in range(1, K + 1)}
    verify = {n: crypto.verify_key(key) for n, key in signing.items()}
    base_np = {name: t.numpy() for name, t in global_weights.items()}
    vectors = [update_vector({name: t.numpy() for name, t in c.weights.items()}, base_np) for c in plain]
    workers = {n: Participant(n, CONTEXT, params, signing[n], verify) for n in signing}
    collector = Collector(CONTEXT, params, verify, vectors[0].size)
    for w in workers.values():
        collector.take_advertisement(w.advertise())
    roster = collector.roster_list()
    for n, w in workers.items():
        collector.take_shares(n, w.share_keys(roster))
    collector.close_shares()
    for n, w in workers.items():
        collector.take_masked(n, w.masked_input(collector.forwarded(n), vectors[n - 1], plain[n - 1].samples)[0])
    survivors = collector.fix_survivors(collector.contributed)
    for n in (1, 2, 3):  # node 4 dropped after masking
        collector.take_check(n, workers[n].check(survivors))
    for n in (1, 2, 3):
        collector.take_reveal(workers[n].unmask(collector.unmask_request(n)))
    mean, total, contributors = collector.finish()
    return contribution_of_mean(mean, global_weights, total), params.error_bound(contributors, total)


def run(strategy: Strategy, given: list[Contribution], global_weights: Mapping[str, torch.Tensor]
        ) -> dict[str, torch.Tensor]:
    strategy.begin(spec_of_tensors(global_weights), UpdateFormat.FULL, global_weights)
    for c in given:
        strategy.accept(c)
    return strategy.finish(global_weights).weights


@pytest.mark.parametrize(("name", "params", "scale"), [
    ("federated_averaging", {}, 1.0), ("fedprox", {"proximal_mu": 0.1}, 1.0),
    ("fedavgm", {"server_learning_rate": 1.0, "server_momentum": 0.9}, 1.0),
    ("fedadam", {}, None), ("fedyogi", {}, None), ("fedadagrad", {}, None),
])
def test_weighted_sum_strategies_give_the_plain_result_within_the_bound(name: str, params: dict, scale: float | None
                                                                        ) -> None:
    global_weights = model(0)
    plain = contributions(global_weights)
    one, bound = secure_round(plain, global_weights)

    expected = run(base.create(name, params), plain, global_weights)
    got = run(base.create(name, params), [one], global_weights)

    assert one.samples == sum(c.samples for c in plain)
    assert torch.equal(got["steps"], expected["steps"])
    for tensor in ("fc.weight", "fc.bias"):
        diff = (got[tensor].double() - expected[tensor].double()).abs().max().item()
        if scale is not None:  # linear in the mean: the bound, plus one float32 rounding
            assert diff <= scale * bound + 4e-7, (tensor, diff, bound)
        else:  # FedOpt's step is eta * m / (sqrt(v) + tau): a quantisation error moves it by at most eta
            assert diff <= 1e-3, (tensor, diff)


def test_differential_privacy_clipped_on_workers_composes_with_the_masked_sum() -> None:
    global_weights = model(1)
    settings = DifferentialPrivacy(noise_multiplier=1.0, clipping_norm=0.5, clip_on="worker", seed=7,
                                   num_sampled_clients=K)
    clipped = [Contribution(clip_for_upload(c.weights, global_weights, 0.5)[0], c.samples)
               for c in contributions(global_weights)]
    one, bound = secure_round(clipped, global_weights)

    expected = run(DifferentiallyPrivate(base.create("federated_averaging", {}), settings), clipped, global_weights)
    got = run(DifferentiallyPrivate(base.create("federated_averaging", {}), settings), [one], global_weights)

    for tensor in ("fc.weight", "fc.bias"):
        diff = (got[tensor].double() - expected[tensor].double()).abs().max().item()
        assert diff <= bound + 4e-7, (tensor, diff, bound)
    # The noise is there: the private result is not the plain mean.
    plain = run(base.create("federated_averaging", {}), clipped, global_weights)
    assert (got["fc.weight"] - plain["fc.weight"]).abs().max() > 0.01


def test_a_vector_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than the round's tensors"):
        contribution_of_mean(np.zeros(3), model(0), 10)


def test_the_worker_reads_every_safetensors_dtype_for_masking_bfloat16_widened_exactly() -> None:
    # The worker masks without torch; safetensors' own numpy reader refuses bfloat16, which failed the shard.
    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "f16": torch.randn(4).to(torch.float16),
               "f32": torch.randn(2, 2), "f64": torch.randn(3, dtype=torch.float64),
               "i64": torch.arange(6).reshape(2, 3), "u8": torch.arange(4, dtype=torch.uint8),
               "flag": torch.tensor([True, False])}
    read = read_tensors(save(tensors))
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        expected = tensor.float() if tensor.dtype == torch.bfloat16 else tensor
        assert read[name].shape == tuple(tensor.shape)
        assert np.array_equal(read[name], expected.numpy()), name
    assert read["bf16"].dtype == np.float32
