"""Differential privacy in a deployment: an aggregator killed mid-job resumes with the same clipping norm and ε,
a privacy budget ends the job before the round that would exceed it, and workers that clip before upload leave
the aggregator no unclipped update.

The toy's shard s adds s + 1 to every float weight: its update's norm is (s + 1) * sqrt(8).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from apiary.jobspec import JobSpec
from apiary.privacy import BUDGET_REACHED, DifferentialPrivacy, epsilon
from apiary.strategies.base import Contribution, create
from apiary.strategies.clipping import clip_for_upload, update_norm
from apiary.strategies.format import UpdateFormat
from apiary.strategies.private import EPSILON, NORM, DifferentiallyPrivate, seeded
from apiary.weights import loads as load_weights
from apiary.weights import spec_of_tensors
from services.scheduler.round_plan import worker_noise
from tests.faults.support import Faults, new_id, toy_job
from tests.toyjobs.toy import Gates, fl_init_weights

Record = Callable[[str, str, str, int], None]
Data = Callable[[int], Path]


def private_job(job_id: str, dataset: Path, privacy: dict[str, Any], **sizes: Any) -> dict[str, Any]:
    request = toy_job(job_id, dataset, **sizes)
    request["distributed"]["differential_privacy"] = privacy
    return request


def replayed(settings: DifferentialPrivacy, rows: list[dict[str, Any]], *, worker_clips: bool = False,
             ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The toy's final weights and each round's server state, as an undisturbed run computes them."""
    weights, state, states = fl_init_weights({}), {}, []
    for round_index in sorted({r["round"] for r in rows}):
        strategy = DifferentiallyPrivate(create("federated_averaging"), settings)
        strategy.load_state(state)
        strategy.begin(spec_of_tensors(weights), UpdateFormat.FULL, weights)
        for row in rows:
            if row["round"] == round_index and row["status"] == "accepted":
                returned = {k: v.clone().add_(row["shard"] + 1 if v.is_floating_point() else 1)
                            for k, v in weights.items()}
                if worker_clips:
                    returned, _ = clip_for_upload(returned, weights, settings.clipping_start)
                strategy.accept(Contribution(returned, row["samples"]))
        weights = strategy.finish().weights
        state = {k: v.clone() for k, v in strategy.state().items()}
        states.append(state)
    return weights, states


def round_metrics(faults: Faults, job_id: str) -> list[dict[str, float]]:
    return [json.loads(r["metrics"]) for r in faults.rounds(job_id) if r["status"] == "aggregated"]


def test_aggregator_killed_mid_job_resumes_with_the_same_clipping_norm_and_epsilon(
        faults: Faults, toy_data: Data, outcome: Record, tmp_path: Path) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("kill-aggregator-dp")
    privacy = {"clipping": "adaptive", "noise_multiplier": 0.5, "clipped_count_stddev": 1.0,
               "initial_clipping_norm": 4.0, "clip_norm_lr": 0.5, "seed": 11}
    gates = Gates(tmp_path, opened=1)  # shard 0 held in round 2 until the aggregator is back
    cluster.publish_job(private_job(job_id, toy_data(15), privacy, rounds=4, min_workers=3, max_workers=3,
                                    config={"mode": "gated", "gate": gates.path, "fail_shards": [0]}))
    sizes = faults.shard_sizes(job_id)
    cluster.wait_for(lambda: faults.accepted(job_id).get((2, 1)), 120, "a contribution of round 2 to be recorded")

    cluster.kill("aggregator", signal.SIGKILL)
    at_kill = faults.aggregations(job_id)[1]["status"]
    cluster.start_service("aggregator")
    gates.open_through(4)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert at_kill == "open", "the kill came mid-round 2 (shard 0 held at its gate)"
    assert faults.accepted(job_id) == {(r, 1): sizes for r in (1, 2, 3, 4)}
    settings = DifferentialPrivacy.model_validate(privacy).resolved(3)
    final, states = replayed(settings, faults.contributions(job_id))
    stored = [load_weights(faults.object(a["state_key"])) for a in faults.aggregations(job_id)]
    norms = [float(s["dp.clipping_norm"]) for s in stored]
    assert norms == [float(s["dp.clipping_norm"]) for s in states]
    assert len(set(norms)) == 4, "the adaptive norm moved every round"
    assert [int(s["dp.releases"]) for s in stored] == [1, 2, 3, 4]
    metrics = round_metrics(faults, job_id)
    assert [m[EPSILON] for m in metrics] == [epsilon(0.5, r, 1e-5) for r in (1, 2, 3, 4)]
    assert [m[NORM] for m in metrics] == [4.0, *norms[:3]]
    weights = faults.final_weights(job_id)
    assert all(torch.equal(weights[name], final[name]) for name in final), (weights, final)
    _, text = faults.status_cli(job_id)
    assert f"differential privacy: ε {metrics[-1][EPSILON]:.4g} at δ 1e-05 after round 4" in text
    double = faults.double_counted(job_id)
    assert double == 0
    outcome("aggregator kill -9 mid-job with adaptive differential privacy (seeded noise)",
            "restarted aggregator reloads round 1's clipping norm and releases; same norms, ε and weights",
            f"{job['status']}; clipping norms {[round(n, 4) for n in norms]}, ε {round(metrics[-1][EPSILON], 3)} "
            "equal to an undisturbed run's, final weights bit-identical", double)


def test_a_privacy_budget_completes_the_job_before_the_round_that_would_exceed_it(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=2)
    job_id = new_id("privacy-budget")
    # ε at δ 1e-5 with noise multiplier 2: 2.17 after one round, 3.19 after two, 4.01 after three.
    privacy = {"noise_multiplier": 2.0, "clipping_norm": 10.0, "max_epsilon": 3.5}
    cluster.publish_job(private_job(job_id, toy_data(12), privacy, rounds=5, max_workers=2))
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    assert job["reason"].startswith(BUDGET_REACHED), job["reason"]
    assert [(a["round"], a["status"]) for a in faults.aggregations(job_id)] == [(1, "aggregated"), (2, "aggregated")]
    assert [m[EPSILON] for m in round_metrics(faults, job_id)] == [epsilon(2.0, r, 1e-5) for r in (1, 2)]
    outcome("max_epsilon 3.5 with noise multiplier 2 over 5 rounds",
            f"completed after round 2 with reason '{BUDGET_REACHED}'", f"{job['status']}: {job['reason']}", 0)


def test_workers_clip_before_upload_and_the_aggregator_holds_no_unclipped_update(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("privacy-worker-clip")
    privacy = {"clip_on": "worker", "noise_multiplier": 0.0, "clipping_norm": 5.0}
    request = private_job(job_id, toy_data(15), privacy, rounds=2, max_workers=3)
    request["distributed"]["transfer"] = {"keep_contributions": True}  # round 1's are read below
    cluster.publish_job(request)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    rows = faults.contributions(job_id)
    starts = {1: fl_init_weights({}), 2: faults.global_weights(job_id, 1)}
    norms = [update_norm(load_weights(faults.object(r["result_key"])), starts[r["round"]])
             for r in rows if r["status"] == "accepted"]
    assert len(norms) == 6 and max(norms) <= 5.0
    assert min(norms) < 5.0 * (1 - 1e-3), "shard 0's update (norm 2.83) fits as it is"
    settings = DifferentialPrivacy.model_validate(privacy).resolved(3)
    final, _ = replayed(settings, rows, worker_clips=True)
    weights = faults.final_weights(job_id)
    assert all(torch.equal(weights[name], final[name]) for name in final)
    outcome("clip_on worker, clipping norm 5 (the toy's updates: 2.83, 5.66, 8.49)",
            "every stored update within the norm; the average of the clipped updates",
            f"{job['status']}; stored update norms <= {max(norms):.6f}", 0)


def test_workers_noise_their_clipped_updates_and_the_aggregator_adds_none(
        faults: Faults, toy_data: Data, outcome: Record) -> None:
    cluster = faults.cluster
    cluster.start(workers=3)
    job_id = new_id("privacy-worker-noise")
    privacy = {"clip_on": "worker", "noise_on": "worker", "noise_multiplier": 1.0, "clipping_norm": 5.0, "seed": 5}
    request = private_job(job_id, toy_data(15), privacy, rounds=2, max_workers=3)
    request["distributed"]["transfer"] = {"keep_contributions": True}  # round 1's are read below
    cluster.publish_job(request)
    job = cluster.wait_job(job_id)

    assert job["status"] == "completed", job["reason"]
    spec = JobSpec.model_validate({k: v for k, v in request.items() if k != "job_id"})
    sigma = 5.0 / 3 ** 0.5  # z C / sqrt(m)
    starts = {1: fl_init_weights({}), 2: faults.global_weights(job_id, 1)}
    rows = [r for r in faults.contributions(job_id) if r["status"] == "accepted"]
    assert len(rows) == 6
    for r in rows:
        start = starts[r["round"]]
        stored = load_weights(faults.object(r["result_key"]))
        returned = {k: v.clone().add_(r["shard"] + 1 if v.is_floating_point() else 1) for k, v in start.items()}
        clipped, _ = clip_for_upload(returned, start, 5.0)
        seed = worker_noise(spec, r["round"], r["attempt"], r["shard"])["noise_seed"]
        for name, tensor in stored.items():
            if tensor.is_floating_point():  # the task's own seeded draws on its clipped update
                noise = torch.from_numpy(seeded(seed, 0, name).normal(0.0, sigma, tuple(tensor.shape)))
                torch.testing.assert_close(tensor.double(), clipped[name].double() + noise, rtol=0, atol=1e-5)
    # The aggregator adds nothing: round 2's result is the sample-weighted mean of round 2's stored contributions.
    final, total = faults.final_weights(job_id), sum(r["samples"] for r in rows if r["round"] == 2)
    for name, tensor in final.items():
        if tensor.is_floating_point():
            mean = sum(r["samples"] * load_weights(faults.object(r["result_key"]))[name].double()
                       for r in rows if r["round"] == 2) / total
            torch.testing.assert_close(tensor.double(), mean, rtol=0, atol=1e-5)
    metrics = round_metrics(faults, job_id)
    assert [m[EPSILON] for m in metrics] == [epsilon(1.0, r, 1e-5) for r in (1, 2)]
    outcome("noise_on worker, noise multiplier 1, clipping norm 5, seeded",
            "each stored update is the worker's clipped update plus its own noise; the mean carries no more",
            f"{job['status']}; ε {metrics[-1][EPSILON]:.3f} after round 2", 0)
