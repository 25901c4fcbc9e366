"""`apiary run` serves its API with a token of its own: it prints the dashboard's address with it, leaves it
for the CLI in APIARY_HOME/token (mode 0600) while it runs, and revokes it when it ends."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx

from tests.fixtures.embedded import REPO, toy_request
from tests.fixtures.policy import foreign
from tests.toyjobs.toy import make_dataset

SLOW = {"mode": "slow", "slow_seconds": 60}  # still training when the test looks


def _environment(home: Path) -> dict[str, str]:
    keep = ("APIARY_ALLOWED_ENTRYPOINTS", "APIARY_DATA_ROOTS")  # the test session's policy
    environment = {k: v for k, v in os.environ.items() if not foreign(k) or k in keep}
    environment.update({"APIARY_HOME": str(home), "PYTHONPATH": str(REPO), "APIARY_HTTP_PORT": "0",
                        "COLUMNS": "80"})
    return environment


def test_apiary_run_serves_its_api_with_its_own_token_and_revokes_it_at_the_end(tmp_path: Path) -> None:
    # Prepare
    home, folder = tmp_path / ".apiary", tmp_path / "job"
    dataset = make_dataset(folder / "data", 8)
    job = folder / "job.json"
    job.write_text(json.dumps({**toy_request(dataset, max_workers=2, min_workers=2), "config": SLOW}))
    run = subprocess.Popen([sys.executable, "-m", "services.app.cli", "run", str(job), "--workers", "2"],
                           cwd=REPO, env=_environment(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert run.stderr is not None
        address = next((line.split(" ", 1)[1].strip() for line in run.stderr if line.startswith("dashboard: ")),
                       None)
        assert address is not None, run.communicate(timeout=60)
        parts = urlsplit(address)
        base, token, job_id = f"{parts.scheme}://{parts.netloc}", parse_qs(parts.query)["token"][0], \
            parts.fragment.removeprefix("/jobs/")
        token_file = home / "token"

        # Execute
        anonymous = httpx.get(f"{base}/api/v1/workers")
        with_token = httpx.get(f"{base}/api/v1/workers", headers={"Authorization": f"Bearer {token}"})
        cli_env = {**_environment(home), "APIARY_API_URL": base}  # no APIARY_TOKEN: the CLI finds the run's
        status = subprocess.run([sys.executable, "-m", "services.app.cli", "status", job_id, "--json"], cwd=REPO,
                                env=cli_env, capture_output=True, text=True, timeout=120)
        file_mode, file_token = token_file.stat().st_mode & 0o777, token_file.read_text().strip()
    finally:
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=120)

    # Assert
    assert anonymous.status_code == 401 and with_token.status_code == 200
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["job_id"] == job_id
    assert (file_mode, file_token) == (0o600, token)
    assert run.returncode == 130, err[-2000:]
    assert not token_file.exists()
    with sqlite3.connect(home / "apiary.db") as db:
        assert db.execute("SELECT name FROM api_tokens").fetchall() == []
