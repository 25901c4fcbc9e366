"""What the job form's browser tests share: a stack with tokens per role, registering files over the HTTP API,
and reading the request the page POSTs."""

from __future__ import annotations

import json
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from playwright.async_api import Browser, Page, Request

from apiary.settings import Settings
from services.app.runtime import Embedded
from services.tracker import token_store

REPO = Path(__file__).resolve().parents[2]
API = "/api/v1"


@dataclass
class Dashboard:
    """A running stack's tracker over HTTP with a token per role, and the browser problems seen so far."""

    stack: Embedded
    url: str
    tokens: dict[str, str]
    problems: list[str]

    def http(self, who: str = "admin") -> httpx.AsyncClient:
        """An HTTP client with `who`'s token."""
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[who]}"},
                                 timeout=60)

    async def register(self, kind: str, file: Path, name: str) -> dict[str, Any]:
        """Register a file (a folder is zipped first) as a model or dataset over the API."""
        if file.is_dir():
            file = zip_folder(file, file.with_suffix(".zip"))
        async with self.http() as http:
            response = await http.post(f"{API}/{kind}", params={"filename": file.name, "name": name},
                                       content=file.read_bytes())
        assert response.status_code == 201, response.text
        return dict(response.json())

    async def open(self, browser: Browser, who: str, hash_: str = "#/", width: int = 1280) -> Page:
        """A page on the dashboard with `who`'s token, page errors collected."""
        page = await browser.new_page(viewport={"width": width, "height": 900})
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        await page.goto(f"{self.url}/?token={self.tokens[who]}{hash_}")
        return page


@asynccontextmanager
async def dashboard(tmp_path: Path, workers: int = 0, stack: Embedded | None = None) -> AsyncIterator[Dashboard]:
    """An embedded stack serving the dashboard, with a viewer, a submitter and an admin token."""
    settings = Settings(home=tmp_path / ".apiary", http_port=0, heartbeat_interval=0.5, progress_interval=0.1)
    stack = stack or Embedded(settings, workers=workers, code_paths=[str(REPO)])
    async with stack:
        url = await stack.tracker.start_http()
        await token_store.migrate(stack.ports.db)
        tokens = {role: await token_store.create(stack.ports.db, f"{role}-1", role)
                  for role in ("viewer", "submitter", "admin")}
        yield Dashboard(stack, url, tokens, [])


def zip_folder(folder: Path, target: Path) -> Path:
    """A folder as a zip of its files (paths relative to the folder)."""
    with zipfile.ZipFile(target, "w") as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())
    return target


def posted_jobs(page: Page) -> list[dict[str, Any]]:
    """The job requests the page POSTs from now on (dry runs too), in order, as JSON."""
    seen: list[dict[str, Any]] = []

    def record(request: Request) -> None:
        if request.method == "POST" and request.url.split("?")[0].endswith(f"{API}/training-jobs"):
            seen.append({"dry_run": "dry_run=true" in request.url, "body": json.loads(request.post_data or "{}")})

    page.on("request", record)
    return seen


async def fill_by_label(page: Page, values: dict[str, str]) -> None:
    """Type each value into the input whose accessible name is the key."""
    for label, value in values.items():
        await page.get_by_label(label, exact=True).fill(value)


__all__ = ["API", "REPO", "Dashboard", "dashboard", "fill_by_label", "posted_jobs", "zip_folder"]
