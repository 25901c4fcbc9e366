"""The dashboard in a real browser (Debian's headless Chromium, driven by Playwright) while a digits job runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page

from apiary.settings import Settings
from services.app.jobfile import load_job_file
from services.app.runtime import Embedded

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
NUM_ROUNDS = 8

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def digits_request() -> dict[str, object]:
    """The digits example job, with more rounds so there is time to watch it."""
    if not (REPO / "examples/digits/data/manifest.json").is_file():
        subprocess.run([sys.executable, "examples/digits/prepare.py"], cwd=REPO, check=True, capture_output=True)
    request = load_job_file(REPO / "examples/digits/job.yaml")
    request["dataset"] = str(REPO / "examples/digits/data")
    request["config"] = {**request["config"], "heldout": str(REPO / "examples/digits/heldout")}
    request["distributed"] = {**request["distributed"], "num_rounds": NUM_ROUNDS}
    return request


async def _round(page: Page) -> int:
    return int(await page.get_attribute("#round-counter", "data-round") or 0)


async def _points(page: Page) -> int:
    return int(await page.get_attribute("#worker-loss-chart", "data-points") or 0)


async def test_the_job_page_follows_a_running_digits_job(browser: Browser, tmp_path: Path,
                                                         digits_request: dict[str, object]) -> None:
    settings = Settings(home=tmp_path / ".apiary", http_port=0, progress_interval=0.1, heartbeat_interval=0.5)
    ARTIFACTS.mkdir(exist_ok=True)
    problems: list[str] = []
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        page = await browser.new_page(viewport={"width": 1360, "height": 1000}, device_scale_factor=1)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        job_id = await stack.submit(digits_request)

        token = await stack.api_token()
        await page.goto(f"{url}/?token={token}#/jobs/{job_id}")  # as `apiary run` prints it
        # The predicates below see no element while the page still renders (a predicate that throws would end
        # the wait at once, as it did once under load): `?.` reads undefined instead.
        await page.wait_for_function("+document.querySelector('#round-counter')?.dataset.round >= 1", timeout=60_000)
        await page.wait_for_function("+document.querySelector('#worker-loss-chart')?.dataset.points > 0",
                                     timeout=60_000)
        first_round, first_points = await _round(page), await _points(page)
        await page.wait_for_function(
            f"+document.querySelector('#round-counter')?.dataset.round > {first_round}"
            f" && +document.querySelector('#worker-loss-chart')?.dataset.points > {first_points}",
            timeout=60_000,
        )
        later_round, later_points = await _round(page), await _points(page)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-running.png"), full_page=True)

        await stack.wait(job_id, timeout=180)
        await page.wait_for_function("document.querySelector('#live')?.dataset.state === 'ended'", timeout=30_000)
        await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        counter = await page.inner_text("#round-counter")
        status = await page.inner_text(".job-head .badge")
        drawn_points = await _points(page)
        drawn_rounds = await page.locator("#round-loss-chart g[data-name='aggregated loss'] circle").count()
        # The digits module's fl_evaluate_model on a worker after each round: its loss beside the training
        # loss, its accuracy on a chart of its own.
        drawn_evaluation_losses = await page.locator(
            "#round-loss-chart g[data-name='evaluation loss'] circle").count()
        drawn_accuracies = await page.locator("#evaluation-chart g[data-name='evaluation accuracy'] circle").count()
        progress_states = await page.locator("#progress-table tbody tr").evaluate_all(
            "rows => rows.map(r => r.dataset.state)")
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            metrics = (await http.get(f"/api/v1/training-jobs/{job_id}/metrics")).json()

        await page.goto(f"{url}/#/")
        await page.wait_for_selector(f"#jobs-table tr[data-job='{job_id}']")
        await page.wait_for_selector("#workers-table tr[data-worker='worker-1']")
        listed = await page.inner_text(f"#jobs-table tr[data-job='{job_id}']")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-jobs.png"), full_page=True)
        await page.close()

    assert first_round >= 1 and later_round > first_round
    assert later_points > first_points
    assert counter == f"{NUM_ROUNDS} / {NUM_ROUNDS}" and status == "completed"
    assert drawn_points == sum(len(s["points"]) for s in metrics["workers"]) > later_points
    assert drawn_rounds == len(metrics["rounds"]) == NUM_ROUNDS
    assert drawn_evaluation_losses == len(metrics["evaluations"]["loss"]) == NUM_ROUNDS
    assert drawn_accuracies == len(metrics["evaluations"]["accuracy"]) == NUM_ROUNDS
    assert progress_states and set(progress_states) == {"reported"}
    assert "completed" in listed and f"{NUM_ROUNDS} / {NUM_ROUNDS}" in listed
    assert problems == []
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
