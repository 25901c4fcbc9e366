"""The probe paths (services.app.health) as an orchestrator reads them: status, body and content type."""

from __future__ import annotations

import httpx

from services.app.health import Check, HealthApp


async def _down() -> None:
    raise ConnectionRefusedError("connection refused\nsecond line")


async def _up() -> None:
    return None


async def _get(checks: dict[str, Check], path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=HealthApp(checks))
    async with httpx.AsyncClient(transport=transport, base_url="http://probe") as http:
        return await http.get(path)


async def test_live_while_the_loop_runs_and_ready_when_every_check_passes() -> None:
    # Execute
    live = await _get({"bus": _down}, "/healthz")
    ready = await _get({"bus": _up, "database": _up}, "/readyz?verbose=1")

    # Assert
    assert (live.status_code, live.text) == (200, "ok\n")
    assert (ready.status_code, ready.text) == (200, "ready\n")
    assert ready.headers["content-type"] == "text/plain; charset=utf-8"


async def test_not_ready_says_one_line_per_failing_check() -> None:
    # Execute
    response = await _get({"bus": _down, "database": _up}, "/readyz")

    # Assert
    assert response.status_code == 503
    assert response.text == "bus: ConnectionRefusedError: connection refused\n"


async def test_any_other_path_is_404_naming_the_probe_paths() -> None:
    # Execute
    response = await _get({}, "/metrics")

    # Assert
    assert (response.status_code, response.text) == (404, "not found: use /healthz or /readyz\n")
