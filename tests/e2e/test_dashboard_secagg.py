"""A job with secure aggregation, run embedded: the API says with each round what secure aggregation did (the stage
reached, who took part, the threshold), and the dashboard's rounds table and `apiary status` show it in one line
(in a real browser: Debian's headless Chromium, via Playwright)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import Browser

from apiary.settings import Settings
from services.app.render import secure_text
from services.app.runtime import Embedded
from tests.e2e.test_secure_aggregation import request

pytestmark = pytest.mark.slow


async def test_the_api_status_and_job_page_show_each_secure_round(browser: Browser, tmp_path: Path,
                                                                 toy_dataset: Path) -> None:
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    async with Embedded(settings, workers=3) as stack:
        url = await stack.tracker.start_http()
        # Shard 2's training fails after its keys went out: it shared keys, never masked; the others recover it.
        body = request(toy_dataset, num_rounds=1)
        body["config"] = {**body["config"], "mode": "raise", "fail_shards": [2]}
        job_id = await stack.submit(body)
        view = await stack.wait(job_id, timeout=120)
        fetched = await stack.api.get_job(job_id)  # GET /training-jobs/{id}, through the API's schema
        page = await browser.new_page()
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_selector("td.secure-aggregation", timeout=30_000)
        shown = await page.text_content("td.secure-aggregation")

    assert view["status"] == "completed", view.get("reason")
    summary = view["rounds"][0]["secure_aggregation"]
    assert fetched["rounds"][0]["secure_aggregation"] == summary
    assert summary["stage"] == "unmasked" and summary["threshold"] == 2 and summary["num_shares"] == 3
    assert summary["participants"] == [0, 1, 2] and summary["survivors"] == [0, 1] and summary["signers"] == [0, 1]
    assert summary["revealed"] == [0, 1]
    # Shard 2 failed after advertising: it shared keys (dropped, its masks removed via shares) or not (left out).
    assert summary["dropped"] == [s for s in summary["shared"] if s not in (0, 1)]
    assert secure_text(summary).startswith("unmasked; threshold 2 of 3; participants 0,1,2; masked 0,1")
    assert shown == secure_text(summary)
