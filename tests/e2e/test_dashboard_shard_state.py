"""A job that keeps state with its shards, run embedded: the API lists each shard's state size, and the dashboard's
job page and `apiary status` say in one line what the shards keep (in a real browser, via Playwright)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import Browser

from apiary.settings import Settings
from services.app.render import shard_state_text
from services.app.runtime import Embedded
from tests.e2e.test_shard_evaluation import personal_request
from tests.fixtures.embedded import REPO
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow


async def test_the_job_page_and_status_show_what_the_shards_keep(browser: Browser, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    async with Embedded(settings, workers=2) as stack:
        url = await stack.tracker.start_http()
        job_id = await stack.submit({
            "name": "stateful", "entrypoint": "tests.toyjobs.stateful:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "data", 6)),
            "distributed": {"num_rounds": 2, "max_workers": 2, "min_workers": 2, "personal_layers": ["layer.bias"]}})
        view = await stack.wait(job_id, timeout=120)
        page = await browser.new_page()
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_function("(document.querySelector('#shard-state')?.textContent.length ?? 0) > 0",
                                     timeout=30_000)
        shown = await page.text_content("#shard-state")

    assert view["status"] == "completed", view.get("reason")
    sizes = list(view["shard_state"]["bytes_per_shard"].values())
    assert len(sizes) == 2 and len(set(sizes)) == 1 and view["shard_state"]["server_state_bytes"] is None
    line = shard_state_text(view["shard_state"])
    assert line is not None and line.startswith("shard state: 2 shards, ") and line.endswith(" in all)")
    assert shown == line


async def test_the_rounds_table_shows_each_shards_personalised_score(browser: Browser, tmp_path: Path,
                                                                    digits_data: Path) -> None:
    request = personal_request(digits_data)
    request["distributed"]["num_rounds"] = 1
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)
        page = await browser.new_page()
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_function("[...document.querySelectorAll('td.evaluation')]"
                                     ".some((td) => td.textContent.includes('by shard'))", timeout=30_000)
        cells = await page.eval_on_selector_all("td.evaluation", "(tds) => tds.map((td) => td.textContent)")

    assert view["status"] == "completed", view.get("reason")
    shards = view["rounds"][0]["evaluation_shards"]
    shown = next(c for c in cells if "by shard" in c)
    assert "mean of 3 shards" in shown
    assert all(f"{s}: " in shown for s in shards)
