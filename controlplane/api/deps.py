"""Dependencies injected into routes: the database session, settings, the caller, and request headers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from controlplane.api.auth import Principal, authorize_agent, authorize_role
from controlplane.db.repository import Actor
from controlplane.errors import Unauthenticated
from controlplane.ingest.receiver import Ingestor
from controlplane.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="an operator API key or an agent token")


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SessionDep = Annotated[Session, Depends(_session)]
SettingsDep = Annotated[Settings, Depends(_settings)]


def _principal(
    request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """Set by the `Authenticate` middleware; the bearer scheme is declared here for the OpenAPI schema."""
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:  # only if the middleware were removed: fail closed
        raise Unauthenticated("missing credentials")
    return principal


Caller = Annotated[Principal, Depends(_principal)]
"""Any authenticated caller, whatever its role (an operator's key or an agent's token)."""


def require_viewer(p: Annotated[Principal, Depends(_principal)]) -> Principal:
    return authorize_role(p, "viewer")


def require_editor(p: Annotated[Principal, Depends(_principal)]) -> Principal:
    return authorize_role(p, "editor")


def require_admin(p: Annotated[Principal, Depends(_principal)]) -> Principal:
    return authorize_role(p, "admin")


def require_agent(p: Annotated[Principal, Depends(_principal)], session: SessionDep) -> Principal:
    return authorize_agent(session, p)


Viewer = Annotated[Principal, Depends(require_viewer)]
Editor = Annotated[Principal, Depends(require_editor)]
Admin = Annotated[Principal, Depends(require_admin)]
AgentCaller = Annotated[Principal, Depends(require_agent)]

READ_YOUR_WRITES_S = 2.0
"""How long a rollup read waits, at most, for the exports this process acknowledged before it to be applied."""


def _rollups_caught_up(request: Request) -> None:
    """Read-your-writes for the rollup-reading endpoints: an export is answered once it is durable (in the ingest
    log), its rollups are written just after; a read waits (in the thread pool, never on the event loop, at most
    READ_YOUR_WRITES_S) until every export this process acknowledged before the read is in the rollups."""
    ingestor: Ingestor = request.app.state.ingestor
    ingestor.wait_applied(ingestor.accepted_seq, timeout=READ_YOUR_WRITES_S)


FreshRollups = Depends(_rollups_caught_up)
"""`dependencies=[FreshRollups]` on a route that reads rollups (agent metrics, status, history, SLO status)."""

IfMatch = Annotated[
    str | None, Header(alias="If-Match", description="ETag from a GET; a stale one answers 412", max_length=512)
]
Reason = Annotated[
    str | None, Header(alias="X-Spillway-Reason", description="why: recorded in the audit event", max_length=500)
]


def actor_of(principal: Principal, reason: str | None) -> Actor:
    return Actor(principal.actor, reason or "")
