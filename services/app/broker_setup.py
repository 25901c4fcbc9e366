"""`apiary broker setup`: create the broker's users (one per service role, one per worker) with their
permissions, through `rabbitmqctl import_definitions`, idempotently: a user that exists keeps its password,
and running it again changes nothing. New users' passwords are generated, kept in a credentials file only
this user can read, and printed once."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apiary.bus.identity import DEFAULT_PREFIX
from services.app.broker_plan import BrokerUser, definitions, plan, queue_policy

CREDENTIALS_FILE = "broker-credentials.json"  # under APIARY_HOME, mode 0600: user -> password


class BrokerSetupError(RuntimeError):
    """The broker could not be set up; the message says why and what to do."""


@dataclass(frozen=True)
class SetupResult:
    """What `setup` did: every user, the passwords of those it created, and the definitions applied."""

    vhost: str
    users: list[BrokerUser]
    created: dict[str, str]
    applied: dict[str, Any]


def rabbitmqctl(*args: str) -> str:
    """Run rabbitmqctl (on the broker's machine, as a user allowed to) and return its output."""
    if shutil.which("rabbitmqctl") is None:
        raise BrokerSetupError("rabbitmqctl is not on PATH: run apiary broker setup on the broker's machine, or "
                               "load the definitions it writes (--definitions FILE) into the broker")
    result = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=120,
                            check=False)
    if result.returncode != 0:
        raise BrokerSetupError(f"rabbitmqctl {args[0]} failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout


def existing_users() -> set[str]:
    """The broker's users now."""
    rows = json.loads(rabbitmqctl("list_users", "--quiet", "--formatter", "json") or "[]")
    return {str(row["user"]) for row in rows}


def load_credentials(path: Path) -> dict[str, str]:
    """The passwords setup generated before (user -> password), or none."""
    try:
        return {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}
    except (ValueError, AttributeError) as e:
        raise BrokerSetupError(f"{path} is not a JSON object of user -> password ({e}): fix or remove it") from None


def save_credentials(path: Path, credentials: dict[str, str]) -> None:
    """Write the credentials file, readable by this user alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(credentials, out, indent=1, sort_keys=True)
    tmp.replace(path)


def setup(exchange: str, vhost: str, workers: Sequence[str], credentials_path: Path, *,
          prefix: str | None = None, apply: bool = True, shared_workers: bool = False) -> SetupResult:
    """Create what is missing of the plan (users with new passwords) and set every user's permissions; with
    `apply` False only work out the definitions (every user with a password, for a broker's first start)."""
    users = plan(exchange, workers, prefix or DEFAULT_PREFIX, shared_workers=shared_workers)
    known = load_credentials(credentials_path)
    present = existing_users() if apply else set()
    created = {u.name: secrets.token_urlsafe(24) for u in users if u.name not in present and u.name not in known}
    if created:
        save_credentials(credentials_path, {**known, **created})
    # A user that exists keeps its password; one only this file knows (the broker lost it) gets it back.
    passwords = {u.name: {**known, **created}[u.name] for u in users if u.name not in present}
    applied = definitions(users, vhost, exchange, passwords)
    if apply:
        _import(applied)
    return SetupResult(vhost, users, created, applied)


def _import(applied: dict[str, Any]) -> None:
    """`rabbitmqctl import_definitions` of these definitions, through a file removed right after. The file is
    readable by the broker's own user (Debian's rabbitmqctl runs as it); it holds salted hashes of random
    passwords, never the passwords."""
    with tempfile.TemporaryDirectory(prefix="apiary-broker-") as tmp:
        os.chmod(tmp, 0o755)
        path = Path(tmp) / "definitions.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as out:
            json.dump(applied, out)
        rabbitmqctl("import_definitions", str(path), "--format", "json")


def full_definitions(exchange: str, vhost: str, workers: Sequence[str], credentials_path: Path, *,
                     shared_workers: bool = False) -> dict[str, Any]:
    """Definitions with every user and its password (generated where the credentials file has none), for a
    broker that loads them at start (`load_definitions`); `guest` is not among them."""
    users = plan(exchange, workers, shared_workers=shared_workers)
    known = load_credentials(credentials_path)
    missing = {u.name: secrets.token_urlsafe(24) for u in users if u.name not in known}
    if missing:
        save_credentials(credentials_path, {**known, **missing})
    return definitions(users, vhost, exchange, {**known, **missing})


def remove(users: Sequence[BrokerUser]) -> None:
    """Delete these users from the broker (tests; retiring a worker)."""
    for user in users:
        with contextlib.suppress(BrokerSetupError):
            rabbitmqctl("delete_user", user.name)


def apply_policy(exchange: str, vhost: str) -> None:
    """Set the exchange's queue policy alone, as `setup` does with the users (a deployment whose users exist)."""
    policy = queue_policy(exchange, vhost)
    rabbitmqctl("set_policy", "-p", policy["vhost"], "--apply-to", policy["apply-to"], "--priority",
                str(policy["priority"]), policy["name"], policy["pattern"], json.dumps(policy["definition"]))


def remove_policy(exchange: str, vhost: str) -> None:
    """Clear the exchange's queue policy (tests; retiring a deployment that shares its vhost)."""
    policy = queue_policy(exchange, vhost)
    with contextlib.suppress(BrokerSetupError):
        rabbitmqctl("clear_policy", "-p", policy["vhost"], policy["name"])


__all__ = ["CREDENTIALS_FILE", "BrokerSetupError", "SetupResult", "apply_policy", "existing_users",
           "full_definitions", "load_credentials", "remove", "remove_policy", "setup"]
