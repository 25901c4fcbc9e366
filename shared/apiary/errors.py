"""The one failure every adapter raises when its outside system is away for now: not the work's fault."""

from __future__ import annotations


class DependencyUnavailable(Exception):
    """A dependency (database, storage, broker) cannot be used now; the same work may succeed once it is back.

    `dependency` names it for people ("PostgreSQL at db:5432/apiary"), `reason` says what it answered.
    """

    def __init__(self, message: str, *, dependency: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.dependency = dependency or "a dependency"
        self.reason = reason or message
