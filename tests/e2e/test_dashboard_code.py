"""The dashboard's job page shows the job's code bundle (sha256 short, size, entrypoint), in a real browser
(Debian's headless Chromium, driven by Playwright)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from playwright.async_api import Browser

from apiary import bundle
from apiary.settings import Settings
from apiary.weights import dumps
from services.app.runtime import Embedded
from tests.toyjobs.toy import make_dataset

TRAIN_PY = '''
def fl_train_model(payload, out_dir, logger=None):
    return {"weights": dict(payload["initial_weights"]), "samples": 1}
'''

pytestmark = pytest.mark.slow




async def test_the_job_page_shows_the_code_bundle(browser: Browser, tmp_path: Path) -> None:
    (tmp_path / "src" / "dashtoy").mkdir(parents=True)
    (tmp_path / "src" / "dashtoy" / "train.py").write_text(TRAIN_PY)
    packed = bundle.pack(tmp_path / "src")
    (tmp_path / "init.safetensors").write_bytes(dumps({"w": torch.zeros(2)}))
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    async with Embedded(settings, workers=1) as stack:
        url = await stack.tracker.start_http()
        code = await stack.api.upload_code(packed.data)
        job_id = await stack.submit({
            "name": "dash", "entrypoint": "dashtoy.train:fl_train_model", "code": code,
            "model": str(tmp_path / "init.safetensors"), "dataset": str(make_dataset(tmp_path / "data", 4)),
            "distributed": {"num_rounds": 1}})
        view = await stack.wait(job_id, timeout=120)
        page = await browser.new_page()
        await page.goto(f"{url}/?token={await stack.api_token()}#/jobs/{job_id}")
        await page.wait_for_function("(document.querySelector('#code')?.textContent.length ?? 0) > 0", timeout=30_000)
        shown = await page.text_content("#code")

    assert view["status"] == "completed", view.get("reason")
    size = f"{packed.size} B" if packed.size < 1000 else f"{packed.size / 1000:.1f} kB"
    assert shown == f"code {packed.sha256[:12]} ({size}), entrypoint dashtoy.train:fl_train_model"
