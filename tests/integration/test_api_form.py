"""What the dashboard's job form asks of the HTTP API, against a running stack with the tracker's tables on SQLite
and on PostgreSQL: a dry run checks a request and submits nothing, every bad field comes back at once (an
unknown one naming the field it is closest to), a token says its role, the defaults of each block, and a job's
own request to run it again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from apiary.trainers.causal_lm_config import CausalLMConfig
from tests.fixtures.served import Served
from tests.toyjobs.toy import make_dataset

API = "/api/v1"


@pytest.fixture
def toy(tmp_path: Path) -> dict[str, Any]:
    """A valid toy job request."""
    return {"name": "toy", "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "toy-data", 6)), "config": {"mode": "ok"},
            "distributed": {"num_rounds": 1, "min_workers": 1, "max_workers": 1}}


async def test_a_dry_run_checks_a_request_and_submits_nothing(served: Served, toy: dict[str, Any]) -> None:
    # Execute
    async with served.client("submitter") as http:
        checked = await http.post(f"{API}/training-jobs", params={"dry_run": "true"}, json=toy)
        jobs = (await http.get(f"{API}/training-jobs")).json()
    async with served.client("viewer") as viewer:
        refused = await viewer.post(f"{API}/training-jobs", params={"dry_run": "true"}, json=toy)

    # Assert
    assert checked.status_code == 200, checked.text
    assert checked.json() == {"valid": True, "request": toy}
    assert jobs == []
    assert refused.status_code == 403


async def test_every_bad_field_comes_back_at_once_an_unknown_one_with_its_closest_name(
        served: Served, toy: dict[str, Any]) -> None:
    # Prepare
    body = {**toy, "distributed": {"num_rounds": 0, "min_workers": 4, "max_workers": 2,
                                                 "num_round": 3}}

    # Execute
    async with served.client("submitter") as http:
        response = await http.post(f"{API}/training-jobs", params={"dry_run": "true"}, json=body)

    # Assert
    assert response.status_code == 422
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert errors["distributed.num_round"] == "unknown field (did you mean num_rounds?)"
    assert errors["distributed.num_rounds"].startswith("Input should be greater than or equal to 1")
    assert errors["distributed"] == "min_workers (4) must not exceed max_workers (2)"


@pytest.mark.parametrize("role", ["viewer", "submitter", "admin"])
async def test_a_token_says_its_name_and_role(served: Served, role: str) -> None:
    # Execute
    async with served.client(role) as http:
        me = (await http.get(f"{API}/token")).json()

    # Assert
    assert me == {"name": f"{role}-1", "role": role, "may_submit": role != "viewer",
                  "may_administer": role == "admin"}


async def test_the_defaults_are_the_request_models_own(served: Served) -> None:
    # Execute
    async with served.client("viewer") as http:
        defaults = (await http.get(f"{API}/job-defaults")).json()

    # Assert
    assert defaults["distributed"]["num_rounds"] == 1 and defaults["distributed"]["enabled"] is True
    assert defaults["distributed"]["strategy"] == "federated_averaging"
    assert defaults["worker_selection"]["mode"] == "pool"
    assert defaults["built_in_config"] == CausalLMConfig.model_validate({}).model_dump()
    assert defaults["early_stopping"]["metric"] == "val_loss"


async def test_a_job_s_request_can_be_read_back_to_run_it_again(served: Served, toy: dict[str, Any]) -> None:
    # Prepare
    async with served.client("submitter") as http:
        job_id = (await http.post(f"{API}/training-jobs", json=toy)).json()["job_id"]

        # Execute
        deadline = time.monotonic() + 30
        while (response := await http.get(f"{API}/training-jobs/{job_id}/request")).status_code == 404:
            assert time.monotonic() < deadline, response.text
            await asyncio.sleep(0.1)
        again = await http.post(f"{API}/training-jobs", json=response.json())
        unknown = await http.get(f"{API}/training-jobs/nope/request")

    # Assert
    assert response.json() == toy
    assert again.status_code == 202 and again.json()["job_id"] != job_id
    assert unknown.status_code == 404 and "no job 'nope'" in unknown.json()["detail"]
