"""`apiary status` shows the job's code bundle: its sha256 (short), size and entrypoint."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from services.app.render import render_job


def _printed(view: dict[str, Any]) -> list[str]:
    console = Console(width=160, record=True, color_system=None)
    console.print(render_job(view))
    return [line.strip() for line in console.export_text().splitlines()]


def _view(**extra: Any) -> dict[str, Any]:
    return {"job_id": "j1", "name": "digits", "status": "running", "round": 1, "num_rounds": 3, "attempt": 1,
            "shards": [], "rounds": [], **extra}


def test_a_job_with_a_bundle_prints_its_sha256_size_and_entrypoint() -> None:
    code = {"key": f"code/{'3f' * 32}.zip", "sha256": "3f" * 32, "size": 12_345, "entrypoint": "pkg.train:fit"}

    lines = _printed(_view(code=code))

    assert "code 3f3f3f3f3f3f (12.3 kB), entrypoint pkg.train:fit" in lines


def test_a_job_without_a_bundle_prints_no_code_line() -> None:
    assert not any(line.startswith("code ") for line in _printed(_view(code=None)))
