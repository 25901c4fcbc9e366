"""The commands that follow and steer a job through the tracker's HTTP API: submit --wait, status, cancel."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from rich.live import Live

from apiary.status import TERMINAL
from services.app.code import local_code, ship
from services.app.console import console, no_tracker_tables
from services.app.ports import Ports
from services.app.render import render_job
from services.app.tracker_api import ApiSettings, tracker_api
from services.tracker.client import JobNotFound, TrackerClient, TrackerError
from services.tracker.publish import publish_job_request


async def submit(settings: ApiSettings, request: dict[str, Any], wait: bool) -> tuple[str, dict[str, Any] | None]:
    """Publish a job request on the bus (its local `code` folder uploaded first, through the tracker's API);
    with `wait`, follow it to its end. Returns its id and last view."""
    if local_code(request) is not None:
        async with tracker_api(settings) as (api, _):
            request = await ship(api, request)
    ports = Ports(settings)
    await ports.bus.connect()
    try:
        job_id = await publish_job_request(ports.bus, request)
    finally:
        await ports.bus.close()
    if not wait:
        return job_id, None
    async with tracker_api(settings) as (api, _):
        return job_id, await watch(api, job_id, live=False)


async def status(settings: ApiSettings, job_id: str, live: bool) -> tuple[dict[str, Any] | None, str]:
    """The job's view (None if the tracker knows no such job) and where that tracker is; with `live`, drawn
    until the job ends."""
    async with tracker_api(settings) as (api, where):
        if live:
            return await watch(api, job_id, live=True), where
        try:
            return await api.get_job(job_id), where
        except JobNotFound:
            return None, where
        except Exception as e:
            if no_tracker_tables(e):  # in-process, over a database no tracker ever ran on
                return None, where
            raise


async def cancel(settings: ApiSettings, job_id: str, reason: str) -> str:
    """Ask the scheduler to stop a job (also one not known yet); returns `cancelling`, `unknown`, or the
    tracker's reason why there is nothing to cancel (prefixed `ended:`)."""
    async with tracker_api(settings, publish=True) as (api, where):
        try:
            answer = await api.cancel_job(job_id, reason, ahead=True)
        except TrackerError as e:
            if e.status_code == 409:
                return f"ended:{e}"
            raise
        except Exception as e:
            if no_tracker_tables(e):  # in-process, over a database no tracker ever ran on
                raise RuntimeError(f"no job {job_id!r} is known to the tracker at {where}") from None
            raise
    return str(answer["status"])


async def watch(api: TrackerClient, job_id: str, *, live: bool) -> dict[str, Any]:
    """Follow the tracker's live view of a job until it ends, drawing it if asked (waits for a job whose
    request the tracker has not recorded yet)."""
    view: dict[str, Any] | None = None
    # Transient: once the job ended, the command prints its last view as a result (on stdout).
    with Live(console=console, refresh_per_second=4, transient=True) if live else _Nothing() as display:
        while view is None or view["status"] not in TERMINAL:
            # A stream ends without the job's end only when the tracker stops: follow it again.
            async with aclosing(api.watch_job(job_id, wait_known=True)) as views:
                async for view in views:
                    if display is not None:
                        display.update(render_job(view))
    return view


class _Nothing:
    """A stand-in for rich's Live when nothing is drawn."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["cancel", "status", "submit", "watch"]
