"""`apiary token create/list/revoke` as an operator runs them, against the tracker's database (SQLite here,
as the embedded default): the token is printed once and never listed, mistakes are one line."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.fixtures.policy import foreign

REPO = Path(__file__).resolve().parents[2]


def _apiary(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not foreign(k)}
    env.update({"APIARY_HOME": str(home), "PYTHONPATH": str(REPO), "APIARY_HTTP_PORT": "0"})
    return subprocess.run([sys.executable, "-m", "services.app.cli", "token", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_token_is_shown_once_listed_by_name_and_revoked(tmp_path: Path) -> None:
    # Execute
    made = _apiary("create", "--name", "ci", "--role", "viewer", "--json", home=tmp_path)
    again = _apiary("create", "--name", "ci", home=tmp_path)
    bad_role = _apiary("create", "--name", "x", "--role", "boss", home=tmp_path)
    listed = _apiary("list", home=tmp_path)
    revoked = _apiary("revoke", "ci", home=tmp_path)
    unknown = _apiary("revoke", "ci", home=tmp_path)

    # Assert
    created = json.loads(made.stdout)
    assert made.returncode == 0 and set(created) == {"token", "name", "role"}
    assert (created["name"], created["role"]) == ("ci", "viewer") and created["token"].startswith("apiary_")
    assert again.returncode == 2 and again.stderr.strip() == ("error: a token named 'ci' already exists: revoke it "
                                                             "first (apiary token revoke ci) or choose another name")
    assert bad_role.returncode == 2 and "role 'boss' is unknown: expected one of viewer, submitter, admin" in \
        bad_role.stderr
    assert listed.stdout.startswith("ci\tviewer\t") and created["token"] not in listed.stdout
    assert revoked.returncode == 0 and unknown.returncode == 2 and "no token is named 'ci'" in unknown.stderr
    with sqlite3.connect(tmp_path / "apiary.db") as db:
        assert db.execute("SELECT count(*) FROM api_tokens").fetchone() == (0,)
    assert "Traceback" not in again.stderr + bad_role.stderr + unknown.stderr
