"""Who may call the HTTP API: a bearer token with a role on every `/api/v1` route.

Reading needs a `viewer` token, anything else (submit, cancel, register) a `submitter`; an `admin` may do
everything, a submitter cancel only the jobs it submitted. A request that never left this process (the CLI
over the local database, `apiary run`'s own client) is trusted as admin: it holds the database already.
Browsers' EventSource cannot send headers, so the live streams also take the token as `?token=`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from apiary.db import Database
from services.tracker import token_store
from services.tracker.api_path import IN_PROCESS_SCOPE_KEY
from services.tracker.tables import LazyTables
from services.tracker.token_store import Principal, Role

IN_PROCESS = Principal("in-process", "admin")
HOW = "send 'Authorization: Bearer TOKEN'; an operator makes one with `apiary token create --name NAME`"
_bearer = HTTPBearer(auto_error=False, description="A token from `apiary token create` (role viewer, submitter "
                     "or admin).")


class Tokens(LazyTables):
    """The token table of one tracker's database, created on first use (also for a tracker never started)."""

    def __init__(self, db: Database) -> None:
        super().__init__(db, token_store.COMPONENT, token_store.MIGRATIONS)
        self.db = db

    async def who(self, request: Request, credentials: HTTPAuthorizationCredentials | None, *,
                  query: bool) -> Principal:
        """The request's principal; 401 when it has no token or one that no one holds."""
        if request.scope.get(IN_PROCESS_SCOPE_KEY):
            return IN_PROCESS
        token = credentials.credentials if credentials is not None else None
        if token is None and query:
            token = request.query_params.get("token")
        if not token:
            raise _unauthorized(f"missing token: {HOW}")
        principal = await token_store.principal(await self.ready(), token)
        if principal is None:
            raise _unauthorized(f"unknown or revoked token: {HOW}")
        return principal


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


def needed_role(method: str) -> Role:
    """What a request's method needs: reading is for viewers, changing anything for submitters."""
    return "viewer" if method in ("GET", "HEAD", "OPTIONS") else "submitter"


def guard(tokens: Tokens, *, query: bool = False) -> Callable[..., Awaitable[Principal]]:
    """A dependency for a router: the request's principal, kept as `request.state.principal`; 401 without a
    valid token, 403 when its role is too low for the method. `query` also takes `?token=` (streams)."""

    async def dependency(request: Request,
                         credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> Principal:
        principal = await tokens.who(request, credentials, query=query)
        role = needed_role(request.method)
        if not principal.may(role):
            raise HTTPException(403, f"token {principal.name!r} is a {principal.role} token, which may only read: "
                                     f"{request.method} {request.url.path} needs a {role} or admin token")
        request.state.principal = principal
        return principal

    return dependency


def principal_of(request: Request) -> Principal:
    """The principal the router's guard found for this request."""
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else IN_PROCESS


async def may_cancel(tokens: Tokens, principal: Principal, job_id: str, known: bool) -> None:
    """403 unless the principal may cancel this job: an admin any job, a submitter only the jobs it submitted."""
    if principal.may("admin"):
        return
    owner = await token_store.submitter(await tokens.ready(), job_id)
    if owner == principal.name:
        return
    if not known:
        raise HTTPException(403, f"job {job_id} is not known yet: only an admin token may cancel a job ahead")
    whose = f"was submitted by {owner!r}" if owner else "was not submitted through the API"
    raise HTTPException(403, f"job {job_id} {whose}: token {principal.name!r} (submitter) may cancel only the jobs "
                             "it submitted; an admin token may cancel any")


__all__ = ["IN_PROCESS", "IN_PROCESS_SCOPE_KEY", "Tokens", "guard", "may_cancel", "needed_role", "principal_of"]
