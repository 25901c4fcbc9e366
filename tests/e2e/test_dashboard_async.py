"""The dashboard's job page of an async (FedBuff) job in a real browser: versions counted, the staleness histogram
and each worker's update rate as the API has them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser

from apiary.settings import Settings
from services.app.runtime import Embedded
from tests.e2e.conftest import REPO
from tests.fixtures.embedded import toy_request

pytestmark = pytest.mark.slow
ARTIFACTS = REPO / "test-artifacts"


async def test_the_job_page_shows_versions_staleness_and_update_rates(browser: Browser, tmp_path: Path,
                                                                      toy_dataset: Path) -> None:
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.0)
    request = toy_request(toy_dataset, num_rounds=4, min_workers=3, max_workers=3, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2, "staleness_weight": "hinge"}})
    problems: list[str] = []
    ARTIFACTS.mkdir(exist_ok=True)
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        job_id = await stack.submit(request)
        await stack.wait(job_id, timeout=120)
        token = await stack.api_token()
        page = await browser.new_page(viewport={"width": 1360, "height": 1000})
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        await page.goto(f"{url}/?token={token}#/jobs/{job_id}")
        await page.wait_for_selector("#async-versions #staleness-histogram tbody tr")
        label = await page.inner_text(".stats .stat-label >> nth=0")
        counter = await page.inner_text("#round-counter")
        histogram = await page.locator("#staleness-histogram tbody tr").evaluate_all(
            "rows => rows.map(r => [+r.dataset.staleness, +r.children[1].textContent])")
        rates = await page.locator("#update-rates tbody tr").evaluate_all("rows => rows.map(r => r.dataset.worker)")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-async.png"), full_page=True)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            view = (await http.get(f"/api/v1/training-jobs/{job_id}")).json()
        await page.close()

    buffered = view["asynchronous"]
    assert label.lower() == "version" and counter == "4 / 4"  # (styled in capitals)
    assert histogram == [[h["staleness"], h["count"]] for h in buffered["staleness_histogram"]]
    assert sum(count for _, count in histogram) == buffered["updates"] == 8
    assert sorted(rates) == sorted(w["worker_id"] for w in buffered["workers"])
    assert problems == []
    assert view["forged"] == []  # every task's reports (progress, heartbeats, result) proved by its own digests
