"""The dashboard shows what each worker receives: a stacked bar per shard, a segment per label, in Chromium."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import Browser

from apiary.settings import Settings
from services.app.runtime import Embedded
from tests.e2e.test_dashboard import ARTIFACTS
from tests.toyjobs.toy import make_dataset

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

SEGMENTS = """rows => rows.map(r => [...r.querySelectorAll('.stack span')]
                  .map(s => [s.dataset.label, +s.dataset.count]))"""


async def test_each_shard_is_a_stacked_bar_of_its_labels(browser: Browser, tmp_path: Path) -> None:
    # Prepare
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    request = {"name": "skewed", "entrypoint": "tests.toyjobs.toy:fl_train_model",
               "dataset": str(make_dataset(tmp_path / "toy-data", 90)), "config": {"mode": "ok"},
               "split": {"strategy": "label_skew", "alpha": 0.3, "seed": 4},
               "distributed": {"num_rounds": 1, "min_workers": 3, "max_workers": 3}}
    problems: list[str] = []
    async with Embedded(settings, workers=3, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        job_id = await stack.submit(request)
        await stack.wait(job_id, timeout=120)
        view = await stack.api.get_job(job_id)
        page = await browser.new_page(viewport={"width": 1360, "height": 1000})
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        # Execute
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_selector("#data-table tbody tr[data-shard='2']")
        drawn = await page.locator("#data-table tbody tr").evaluate_all(SEGMENTS)
        widths = await page.locator("#data-table .stack").evaluate_all("bars => bars.map(b => b.style.width)")
        head = await page.inner_text("#split")
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-data.png"), full_page=True)
        await page.close()

    # Assert
    expected = [[[label, count] for label, count in sorted(s["labels"].items(), key=lambda kv: int(kv[0]))]
                for s in view["data_shards"]]
    largest = max(s["num_samples"] for s in view["data_shards"])
    assert drawn == expected
    assert "100%" in widths and len(widths) == 3
    assert [float(w.removesuffix("%")) for w in widths] == pytest.approx(
        [max(2, 100 * s["num_samples"] / largest) for s in view["data_shards"]], abs=1e-3)
    assert head == "split label_skew alpha=0.3 seed=4"
    assert problems == []
