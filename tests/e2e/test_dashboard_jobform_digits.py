"""The digits example started from the dashboard's form in a real browser (Debian's headless Chromium): the
POSTed request is the example's job file field for field (its dataset registered, so named by id), and the
job page the browser goes to follows the job live until it completes. Writes the time from pressing Submit to
the page showing round 1 to test-artifacts/jobform-digits-timing.json."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser

from services.app.jobfile import load_job_file
from tests.e2e.jobform_helpers import REPO, dashboard, fill_by_label, posted_jobs

pytestmark = pytest.mark.slow

ARTIFACTS = REPO / "test-artifacts"
DIGITS = REPO / "examples/digits"


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    """The digits example's job file as a request, its data prepared."""
    if not (DIGITS / "data/manifest.json").is_file():
        subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    return load_job_file(DIGITS / "job.yaml")


async def test_the_digits_example_submitted_from_the_form_runs_live_to_completion(
        browser: Browser, tmp_path: Path, example: dict[str, Any]) -> None:
    # Prepare
    heldout = example["config"]["heldout"]
    other = {k: v for k, v in example["config"].items() if k not in ("epochs", "batch_size", "learning_rate")}
    async with dashboard(tmp_path, workers=3) as board:
        dataset = await board.register("datasets", DIGITS / "data", "digits")
        page = await board.open(browser, "submitter")
        await page.wait_for_selector("#workers-table tr[data-worker='worker-3']")
        posted = posted_jobs(page)

        # Execute: the example's job file, typed into the form
        await page.get_by_role("link", name="New training job").click()
        await page.wait_for_selector("#f-name:focus")
        await page.get_by_label("What trains (entrypoint, or none for the built-in trainer)").select_option("code")
        config, distributed = example["config"], example["distributed"]
        await fill_by_label(page, {
            "Job name (name)": example["name"], "Entrypoint (entrypoint)": example["entrypoint"],
            "Epochs (epochs)": str(config["epochs"]), "Batch size (batch_size)": str(config["batch_size"]),
            "Learning rate (learning_rate)": str(config["learning_rate"]),
            "Other config keys, as a JSON object (other)": json.dumps(other)})
        await page.get_by_label("Dataset (dataset_id)").select_option(str(dataset["dataset_id"]))
        await page.locator("#advanced > summary").click()
        await fill_by_label(page, {
            "Rounds (num_rounds)": str(distributed["num_rounds"]),
            "Fewest workers (min_workers)": str(distributed["min_workers"]),
            "Most workers (max_workers)": str(distributed["max_workers"]),
            "Aggregation timeout, seconds (aggregation_timeout)": str(distributed["aggregation_timeout"]),
            "Failed rounds tolerated (fault_tolerance)": str(distributed["fault_tolerance"])})
        pressed = time.monotonic()
        await page.get_by_role("button", name="Submit job").click()
        await page.wait_for_function("+document.querySelector('#round-counter')?.dataset.round >= 1",
                                     timeout=120_000, polling=50)
        round_1_shown = time.monotonic() - pressed
        await page.wait_for_function(
            "document.querySelectorAll(\"#round-loss-chart g[data-name='aggregated loss'] circle\").length >= 1",
            timeout=120_000, polling=50)
        round_1_aggregated = time.monotonic() - pressed
        await page.wait_for_function("document.querySelector('#live')?.dataset.state === 'ended'", timeout=300_000)
        ended = time.monotonic() - pressed
        status = await page.inner_text(".job-head .badge")
        counter = await page.inner_text("#round-counter")
        await page.close()

    # Assert
    ARTIFACTS.mkdir(exist_ok=True)
    timing = {"submit_to_round_1_shown_s": round(round_1_shown, 2),
              "submit_to_round_1_aggregated_s": round(round_1_aggregated, 2), "submit_to_end_s": round(ended, 2)}
    (ARTIFACTS / "jobform-digits-timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(f"digits from the form: {timing}")
    submitted = [p["body"] for p in posted if not p["dry_run"]]
    assert len(submitted) == 1
    body = submitted[0]
    expected = {k: v for k, v in example.items() if k != "dataset"}
    expected["dataset_id"] = dataset["dataset_id"]
    # The form names `enabled` and `strategy` always, as the documented request does (here their defaults), and
    # leaves out a null steps_per_round (its default).
    expected["distributed"] = {"enabled": True, "strategy": "federated_averaging",
                               **{k: v for k, v in distributed.items() if v is not None}}
    assert set(body) == set(expected)
    for block in ("config", "distributed", "worker_selection"):
        assert body[block] == expected[block], block
    assert body["config"]["heldout"] == heldout
    assert (body["name"], body["entrypoint"]) == (example["name"], example["entrypoint"])
    assert status == "completed"
    assert counter == f"{distributed['num_rounds']} / {distributed['num_rounds']}"
    assert board.problems == []
