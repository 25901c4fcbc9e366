"""Which tracker a command talks to: the one at APIARY_API_URL, or this machine's, served in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from pydantic import Field

from apiary.settings import Settings
from services.app import dblock
from services.app.ports import Ports
from services.app.tokens import read_run_token
from services.tracker.client import TrackerClient
from services.tracker.inprocess import in_process_client

DEFAULT_API_URL = "http://127.0.0.1:8080"
# A named tracker that is restarting gets a few seconds to listen again before a command gives up.
CONNECT_RETRIES = 4


class ApiSettings(Settings):
    """The process settings, plus where the tracker's HTTP API is."""

    api_url: str = Field(default=DEFAULT_API_URL, description="the tracker's HTTP API; unset, the usual local "
                         "address for a deployment, and for the embedded default see tracker_api()")
    token: str | None = Field(default=None, description="the API token (APIARY_TOKEN); unset, the token of the "
                              "`apiary run` that holds APIARY_HOME (its `token` file), if any")

    def api_token(self) -> str | None:
        """The token to send: APIARY_TOKEN, else the one `apiary run` left for its own run under APIARY_HOME."""
        return self.token or read_run_token(self.home)


@asynccontextmanager
async def tracker_api(settings: ApiSettings, *, publish: bool = False) -> AsyncIterator[tuple[TrackerClient, str]]:
    """A client of the tracker's API and where that tracker is, for messages.

    APIARY_API_URL set, or a deployment (a bus other than the in-memory one): that tracker over HTTP, by
    default at the usual local address. The embedded default: the tracker of the `apiary run` that holds
    this database, if one runs (at the local address), else the same API served in this process over the
    database (after `apiary run` ended); `publish` connects the bus too, for commands that publish.
    """
    url = settings.api_url.rstrip("/")
    embedded = dblock.lock_path(settings) is not None and "api_url" not in settings.model_fields_set
    if embedded and not dblock.held_elsewhere(settings):
        async with _in_process(settings, publish) as client:
            yield client, settings.resolved_database_url()
        return
    transport = httpx.AsyncHTTPTransport(retries=CONNECT_RETRIES)
    async with TrackerClient(url, transport=transport, token=settings.api_token()) as client:
        yield client, url


@asynccontextmanager
async def _in_process(settings: Settings, publish: bool) -> AsyncIterator[TrackerClient]:
    from services.tracker import Tracker

    ports = Ports(settings)
    await ports.db.connect()
    try:
        if publish:
            await ports.bus.connect()
        async with in_process_client(Tracker(ports.bus, ports.db, ports.storage, settings)) as client:
            yield client
    finally:
        await ports.close() if publish else await ports.db.close()


__all__ = ["DEFAULT_API_URL", "ApiSettings", "tracker_api"]
