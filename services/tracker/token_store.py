"""The API's tokens and who submitted each job, in the tracker's database: a token is kept only as the sha256
of its secret, so the table never holds a usable token."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from apiary.db import Database, Executor

COMPONENT = "tracker_auth"  # its own migrations, beside the tracker's views
Role = Literal["viewer", "submitter", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "submitter", "admin")  # each may do what those before it may
TOKEN_PREFIX = "apiary_"
NAME_PATTERN = r"^[A-Za-z0-9][\w.@\-]{0,99}$"

# Append only: a database records how many of these it has applied.
MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS api_tokens (
      name TEXT PRIMARY KEY, role TEXT NOT NULL, token_sha256 TEXT NOT NULL UNIQUE,
      created_at DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION);
    CREATE TABLE IF NOT EXISTS job_submitters (
      job_id TEXT PRIMARY KEY, token_name TEXT NOT NULL, submitted_at DOUBLE PRECISION NOT NULL)
    """,
]


class TokenError(ValueError):
    """A token cannot be made or revoked as asked; the message says why."""


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a token's name and role."""

    name: str
    role: Role

    def may(self, role: Role) -> bool:
        """Whether this principal's role includes `role`."""
        return ROLES.index(self.role) >= ROLES.index(role)


def digest(token: str) -> str:
    """What the database keeps of a token: the hex sha256 of its text."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_role(role: str) -> Role:
    """A role name, checked."""
    for known in ROLES:
        if role == known:
            return known
    raise TokenError(f"role {role!r} is unknown: expected one of {', '.join(ROLES)}")


async def migrate(db: Database) -> None:
    """Create the tables (idempotent)."""
    await db.migrate(COMPONENT, MIGRATIONS)


async def create(db: Database, name: str, role: str) -> str:
    """A new token for `name` with `role`; only its hash is stored, so this is the one time it is seen."""
    checked = check_role(role)
    if not re.match(NAME_PATTERN, name):
        raise TokenError(f"token name {name!r} is invalid: expected 1 to 100 letters, digits, '.', '_', '@' or '-'")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    async with db.transaction() as tx:
        if await tx.fetchval("SELECT name FROM api_tokens WHERE name = $1", name) is not None:
            raise TokenError(f"a token named {name!r} already exists: revoke it first (apiary token revoke "
                             f"{name}) or choose another name")
        await tx.execute("INSERT INTO api_tokens (name, role, token_sha256, created_at) VALUES ($1, $2, $3, $4)",
                         name, checked, digest(token), time.time())
    return token


async def revoke(db: Database, name: str) -> None:
    """Forget a token: requests carrying it are refused from now on."""
    async with db.transaction() as tx:
        if await tx.fetchval("SELECT name FROM api_tokens WHERE name = $1", name) is None:
            raise TokenError(f"no token is named {name!r}: see apiary token list")
        await tx.execute("DELETE FROM api_tokens WHERE name = $1", name)


async def listed(db: Database) -> list[dict[str, Any]]:
    """Every token's name, role and creation time (never the token), oldest first."""
    rows = await db.fetch("SELECT name, role, created_at FROM api_tokens ORDER BY created_at, name")
    return [dict(row) for row in rows]


async def principal(db: Executor, token: str) -> Principal | None:
    """Who holds this token, or None if no token has its hash."""
    row = await db.fetchrow("SELECT name, role FROM api_tokens WHERE token_sha256 = $1", digest(token))
    return Principal(str(row["name"]), check_role(str(row["role"]))) if row is not None else None


async def record_submitter(db: Database, job_id: str, name: str) -> None:
    """Remember which token submitted a job (the first one, if a request is repeated)."""
    async with db.transaction() as tx:
        await tx.execute("INSERT INTO job_submitters (job_id, token_name, submitted_at) VALUES ($1, $2, $3)"
                         " ON CONFLICT DO NOTHING", job_id, name, time.time())


async def submitter(db: Executor, job_id: str) -> str | None:
    """The name of the token that submitted a job through the API, or None (submitted on the bus, or unknown)."""
    value = await db.fetchval("SELECT token_name FROM job_submitters WHERE job_id = $1", job_id)
    return str(value) if value is not None else None


__all__ = ["COMPONENT", "ROLES", "Principal", "Role", "TokenError", "create", "digest", "listed", "migrate",
           "principal", "record_submitter", "revoke", "submitter"]
