"""The dashboard's token in a real browser (Debian's headless Chromium): it asks for one, keeps it for the tab,
and asks again for one the API refuses; the live streams run on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import Browser

from apiary.settings import Settings
from services.app.runtime import Embedded
from services.tracker import token_store

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


async def test_the_dashboard_asks_for_a_token_keeps_it_and_asks_again_when_refused(
        browser: Browser, tmp_path: Path) -> None:
    # Prepare
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5)
    problems: list[str] = []
    async with Embedded(settings, workers=1, code_paths=[str(REPO)]) as stack:
        url = await stack.tracker.start_http()
        await token_store.migrate(stack.ports.db)
        viewer = await token_store.create(stack.ports.db, "viewer-1", "viewer")
        page = await browser.new_page()
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        # Execute: no token, then a wrong one, then the viewer's
        await page.goto(f"{url}/#/")
        asked = await page.wait_for_selector("#token-form")
        await page.fill("#token-input", "apiary_wrong")
        await page.click("#token-form button")
        await page.wait_for_function("document.querySelector('#token-form') && "
                                     "document.body.innerText.includes('unknown or revoked token')")
        await page.fill("#token-input", viewer)
        await page.click("#token-form button")
        await page.wait_for_selector("#workers-table tr[data-worker='worker-1']")
        live = await page.get_attribute("#live", "data-state")
        await page.reload()  # the tab keeps its token
        await page.wait_for_selector("#workers-table tr[data-worker='worker-1']")
        kept_after_reload = await page.locator("#token-form").count() == 0
        await page.close()

    # Assert
    assert asked is not None
    assert live == "live"
    assert kept_after_reload
    assert problems == []
