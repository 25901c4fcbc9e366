"""A personal-layers job's evaluation, shard by shard, end to end on the embedded stack (issue 41): each round's
evaluation scores every shard's personalised model (the round's global model with the shard's personal layers) on
the shard's own held-out part, on a worker, and the round's metric is their sample-weighted mean, shown in the job's
view and `apiary status`."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from apiary import keys
from apiary.weights import loads
from examples.digits.train import fl_evaluate_model, load_dataset
from services.app.jobfile import load_job_file
from services.app.render import evaluation_text
from tests.fixtures.embedded import REPO, StackFactory

FRACTION = 0.25


def personal_request(data: Path) -> dict[str, object]:
    request = load_job_file(REPO / "examples/digits/job.yaml")
    request["dataset"] = str(data)
    request["config"] = {**request["config"], "heldout": str(REPO / "examples/digits/heldout"),
                         "shard_eval_fraction": FRACTION}
    request["distributed"] = {**request["distributed"], "num_rounds": 2, "min_workers": 3, "max_workers": 3,
                              "personal_layers": ["fc.*"]}
    request["split"] = {"strategy": "label_skew", "alpha": 0.3, "seed": 0}
    return request


async def test_each_shard_is_scored_with_its_personal_layers_on_its_own_held_out_part(
        embedded: StackFactory, digits_data: Path, tmp_path: Path) -> None:
    # Prepare
    request = personal_request(digits_data)

    # Execute
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=300)
        storage = stack.ports.storage
        final_global = loads(await storage.get_bytes(keys.global_weights(job_id, 2)))
        own = loads(await storage.get_bytes(keys.final_shard_state(job_id, 1)))
        shard_zip = await storage.get_bytes(keys.shard(job_id, 1))

    # Assert
    assert view["status"] == "completed", view.get("reason")
    evaluated = {r["round"]: r for r in view["rounds"] if r["status"] == "aggregated"}
    assert set(evaluated) == {1, 2}
    for r in evaluated.values():
        assert r["evaluation_error"] is None
        shards = r["evaluation_shards"]
        assert set(shards) == {"0", "1", "2"}  # JSON object keys
        # The round's metric is the shards' mean, weighted by the held-out samples each scored.
        total = sum(s["num_samples"] for s in shards.values())
        mean = sum(s["num_samples"] * s["accuracy"] for s in shards.values()) / total
        assert r["evaluation"]["accuracy"] == pytest.approx(mean)
        assert r["evaluation"]["num_samples"] == total
    # Shard 1's score, computed here: round 2's global model with shard 1's personal layers on its held-out part...
    folder = tmp_path / "shard-1"
    zipfile.ZipFile(io.BytesIO(shard_zip)).extractall(folder)
    env = {"SEED": 0, "SHARD_EVAL_FRACTION": FRACTION, "SHARD_DATA": str(folder), "SHARD_INDEX": 1}
    personal = {k.removeprefix("personal."): v for k, v in own.items() if k.startswith("personal.")}
    assert set(personal) == {"fc.weight", "fc.bias"}
    personalised = fl_evaluate_model({**final_global, **personal}, env)
    global_only = fl_evaluate_model(final_global, env)
    recorded = evaluated[2]["evaluation_shards"]["1"]
    assert recorded["num_samples"] == personalised["num_samples"] == int(len(load_dataset(folder)[1]) * FRACTION)
    assert recorded["accuracy"] == pytest.approx(personalised["accuracy"])
    assert recorded["loss"] == pytest.approx(personalised["loss"], rel=1e-5)
    # ...which the global model alone (its head never trained: it stays with the shards) does not reach.
    assert global_only["accuracy"] < personalised["accuracy"] - 0.2
    # `apiary status` shows the mean and each shard's score.
    text = str(evaluation_text(evaluated[2]))
    assert "mean of 3 shards" in text and f"1:{recorded['accuracy']:.3g}" in text
