"""A job with differential privacy, run embedded: the API lists ε with each round, and the dashboard's job page and
`apiary status` say in one line what it has spent (in a real browser: Debian's headless Chromium, via Playwright)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import Browser

from apiary.privacy import epsilon
from apiary.settings import Settings
from services.app.render import privacy_text
from services.app.runtime import Embedded
from tests.toyjobs.toy import make_dataset

pytestmark = pytest.mark.slow


async def test_the_job_page_and_status_show_the_privacy_spent(browser: Browser, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    async with Embedded(settings, workers=2) as stack:
        url = await stack.tracker.start_http()
        job_id = await stack.submit({
            "name": "private", "entrypoint": "tests.toyjobs.toy:fl_train_model",
            "dataset": str(make_dataset(tmp_path / "data", 6)),
            "distributed": {"num_rounds": 2, "max_workers": 2, "min_workers": 2,
                            "differential_privacy": {"noise_multiplier": 1.0, "clipping_norm": 2.0}}})
        view = await stack.wait(job_id, timeout=120)
        page = await browser.new_page()
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_function("(document.querySelector('#privacy')?.textContent.length ?? 0) > 0",
                                     timeout=30_000)
        shown = await page.text_content("#privacy")

    assert view["status"] == "completed", view.get("reason")
    spent = [r["metrics"]["dp_epsilon"] for r in view["rounds"] if r["status"] == "aggregated"]
    assert spent == [epsilon(1.0, 1, 1e-5), epsilon(1.0, 2, 1e-5)]
    assert privacy_text(view["rounds"]) == "differential privacy: ε 7.077 at δ 1e-05 after round 2, clipping norm 2"
    assert shown == "differential privacy: ε 7.077 at δ 1e-05 after round 2, clipping norm 2"
