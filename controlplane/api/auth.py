"""Who is calling: operator API keys with roles, and agent tokens that reach only agent endpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, ApiKey, utcnow
from controlplane.errors import Forbidden, Unauthenticated
from controlplane.secrets import AGENT_TOKEN_PREFIX, API_KEY_PREFIX, parse_credential, secret_matches

Role = Literal["viewer", "editor", "admin"]
ROLE_RANK: dict[str, int] = {"viewer": 0, "editor": 1, "admin": 2}
_LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    kind: Literal["key", "agent"]
    id: str
    name: str
    role: str | None = None

    @property
    def actor(self) -> str:
        return f"{self.kind}:{self.name}"


def authenticate(session: Session, authorization: str | None) -> Principal:
    """Resolve an `Authorization: Bearer ...` header to a principal, or raise 401 saying what is wrong."""
    if not authorization:
        raise Unauthenticated("missing credentials: send 'Authorization: Bearer <api key or agent token>'")
    scheme, _, raw = authorization.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise Unauthenticated("unsupported credentials: use 'Authorization: Bearer <api key or agent token>'")
    cred = parse_credential(raw.strip())
    if cred is None:
        raise Unauthenticated("invalid credentials")
    now = utcnow()
    if cred.prefix == API_KEY_PREFIX:
        key = session.get(ApiKey, cred.ident)
        if key is None or key.revoked_at is not None or not secret_matches(cred.secret, key.key_hash):
            raise Unauthenticated("invalid or revoked API key")
        if key.last_used_at is None or now - key.last_used_at > _LAST_USED_RESOLUTION:
            # A plain UPDATE: noting use is not an edit, so the key's version (its ETag) stays.
            session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
            session.commit()
        return Principal("key", key.id, key.name, key.role)
    assert cred.prefix == AGENT_TOKEN_PREFIX
    agent = session.get(Agent, cred.ident)
    if agent is None or not secret_matches(cred.secret, agent.token_hash):
        raise Unauthenticated("invalid agent token")
    return Principal("agent", agent.id, agent.name)


def authorize_role(principal: Principal, role: Role) -> Principal:
    if principal.kind != "key":
        raise Forbidden("agent tokens may call only agent endpoints")
    assert principal.role is not None
    if ROLE_RANK[principal.role] < ROLE_RANK[role]:
        raise Forbidden(f"this needs the '{role}' role; key '{principal.name}' has '{principal.role}'")
    return principal


_noted: dict[str, float] = {}  # agent id -> when (monotonic) this process last wrote its last_seen


def authorize_agent(session: Session, principal: Principal) -> Principal:
    """Agent endpoints only; a call from the agent itself is what `last_seen` records (written at most once a
    minute per agent and process: an agent polling and exporting every few seconds costs no write each time)."""
    if principal.kind != "agent":
        raise Forbidden("this endpoint is for agents: use the agent's token")
    moment = time.monotonic()
    if moment - _noted.get(principal.id, -1e9) < _LAST_USED_RESOLUTION.total_seconds():
        return principal
    _noted[principal.id] = moment
    now = utcnow()
    session.execute(
        update(Agent)
        .where(Agent.id == principal.id, (Agent.last_seen.is_(None)) | (Agent.last_seen < now - _LAST_USED_RESOLUTION))
        .values(last_seen=now)
    )
    session.commit()
    return principal
