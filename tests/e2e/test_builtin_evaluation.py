"""A built-in (causal-LM) job scores its model on held-out records (config `eval_dataset_id`) on a worker: round 0
(the base with the initial adapter) and the last round, by exact match and loss; `apiary run`'s summary shows
them as before and after. An eval_dataset_id that names nothing is refused at intake, naming the field. The
stack's workers share one model cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apiary.registry import Upload, store_dataset
from services.app.render import summary
from tests.e2e.test_builtin_job import _register, _request
from tests.fixtures import tiny_llm
from tests.fixtures.embedded import StackFactory

pytest.importorskip("peft")


async def test_round_0_and_the_last_round_are_scored_on_the_held_out_records(embedded: StackFactory,
                                                                             tmp_path: Path) -> None:
    # Prepare: 6 held-out records registered as dataset 2; rounds evaluated every 2 (of 2)
    async with embedded(workers=2) as stack:
        model_id, dataset_id = await _register(stack, tmp_path)
        held_out = tmp_path / "held-out.jsonl"
        held_out.write_text("".join(json.dumps(r) + "\n" for r in tiny_llm.records(6)))
        eval_id = (await store_dataset(stack.ports.storage, 2, Upload(held_out, "held-out")))["dataset_id"]
        request = _request(model_id, dataset_id, evaluate_every=2)
        request["config"]["eval_dataset_id"] = eval_id
        unknown = {**request, "config": {**request["config"], "eval_dataset_id": 9}}

        # Execute
        view = await stack.wait(await stack.submit(request), timeout=300)
        refused = await stack.wait(await stack.submit(unknown), timeout=30)
        cache = stack.settings.home / "models"

    # Assert
    assert view["status"] == "completed", view.get("reason")
    evaluated = {r["round"]: r for r in view["rounds"] if r.get("evaluation")}
    assert sorted(evaluated) == [0, 2] and evaluated[0]["status"] == "initial"
    for r in evaluated.values():
        assert set(r["evaluation"]) == {"exact_match", "val_loss"}
        assert r["evaluation"]["exact_match"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # of the 4 records with a reply
    result = summary(view, 1.0)
    assert result["evaluation"] == {"before": {"round": 0, "metrics": evaluated[0]["evaluation"]},
                                    "after": {"round": 2, "metrics": evaluated[2]["evaluation"]}}
    assert refused["status"] == "rejected" and [e["field"] for e in refused["errors"]] == ["config.eval_dataset_id"]
    assert "config.eval_dataset_id '9' is unknown" in refused["reason"]
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [json.loads(
        (tmp_path / ".apiary" / "storage" / "models" / "1" / "model.json").read_text())["sha256"]]
