"""An assignment's one-time secret: how a report proves it comes from the worker that took the assignment.

The scheduler draws a secret per shard and puts it in that shard's assignment only; `round.start` carries
its sha256 (and that of the progress token derived from it), never the secret. The worker echoes the
secret in its `worker.done` / `worker.failed`, which only the aggregator reads, and the progress token
(not the secret) in its `worker.progress` and heartbeats, which the tracker reads: whoever sees a
progress event can forge progress, never a result.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from apiary.bus.identity import worker_of

SECRET_BYTES = 32
SECRET = "assignment secret"
TOKEN = "progress token"
# The digest a report must match for a shard its round gave no secret: nothing matches it.
UNMATCHABLE = ""


def new_secret() -> str:
    """A fresh random secret for one assignment."""
    return secrets.token_urlsafe(SECRET_BYTES)


def digest(value: str) -> str:
    """The sha256 (hex) a round.start carries for a secret or a progress token."""
    return hashlib.sha256(value.encode()).hexdigest()


def progress_token(secret: str) -> str:
    """What a worker presents in its progress and heartbeats: derived from the secret, never revealing it."""
    return hmac.new(secret.encode(), b"apiary progress", hashlib.sha256).hexdigest()


def proves(presented: str | None, expected_digest: str | None) -> bool:
    """Whether `presented` is the secret (or token) whose digest is `expected_digest` (compared in constant
    time); False when either is missing."""
    if not presented or not expected_digest:
        return False
    return hmac.compare_digest(digest(presented), expected_digest)


def judge(worker_id: str, user_id: str | None, presented: str | None, expected_digest: str | None, *,
          what: str = SECRET, about: str) -> str | None:
    """Why a worker's report on `about` ("shard 3", "the task") is forged, or None: it does not present the `what`
    whose digest is `expected_digest` (None: no assignment is known for it here, so only the broker user is
    judged), or another worker's broker user sent it. The secret is judged first: a report failing both is
    recorded as lacking it."""
    if expected_digest is not None and not proves(presented, expected_digest):
        return f"{'a wrong' if presented else 'no'} {what} for {about}"
    sender = worker_of(user_id)
    if sender is not None and sender != worker_id:
        # A service's or a shared user is not judged here: the broker's topic permissions keep services from
        # publishing worker.* at all.
        return f"sent by worker {sender!r}'s broker user, not by worker {worker_id!r}"
    return None
