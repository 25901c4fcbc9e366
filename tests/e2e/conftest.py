"""The embedded stack's fixtures live in tests/fixtures/embedded.py (a plugin for every test folder); the
dashboard tests share headless Chromium from here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, async_playwright

from tests.fixtures.embedded import REPO, StackFactory, toy_request

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Headless Chromium from the system (never a downloaded one)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium", pytrace=False)
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        await launched.close()


__all__ = ["REPO", "StackFactory", "browser", "toy_request"]
