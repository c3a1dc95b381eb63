"""Issuing and revoking credentials: API keys for operators, tokens for agents. Secrets are shown once."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, ApiKey, utcnow
from controlplane.db.repository import Actor, check_if_match, count, flush, record_event
from controlplane.errors import Conflict, DuplicateName, NotFound
from controlplane.secrets import (
    AGENT_TOKEN_PREFIX,
    API_KEY_PREFIX,
    format_credential,
    hash_secret,
    new_ident,
    new_secret,
)


def issue_api_key(session: Session, name: str, role: str, actor: Actor) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the only copy of the bearer key."""
    if session.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
        raise DuplicateName(
            f"an API key named '{name}' already exists", details=[{"field": "name", "message": "taken"}]
        )
    ident, secret = new_ident(), new_secret()
    key = ApiKey(id=ident, name=name, role=role, key_hash=hash_secret(secret), version=1, created_at=utcnow())
    session.add(key)
    flush(session, "API key")
    record_event(
        session,
        kind="api_key.created",
        actor=actor,
        subject_type="api_key",
        subject_id=ident,
        data={"name": name, "role": role},
    )
    return key, format_credential(API_KEY_PREFIX, ident, secret)


def get_api_key(session: Session, ident: str) -> ApiKey:
    key = session.get(ApiKey, ident)
    if key is None:
        raise NotFound(f"no API key with id '{ident}'")
    return key


def _other_active_admins(session: Session, key: ApiKey) -> int:
    """Locks every active admin row, in id order (PostgreSQL), so two admins cannot revoke each other at once."""
    admins = select(ApiKey.id).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).order_by(ApiKey.id)
    return sum(1 for ident in session.scalars(admins.with_for_update()) if ident != key.id)


def change_api_key(
    session: Session, ident: str, *, name: str | None, role: str | None, if_match: str | None, actor: Actor
) -> ApiKey:
    key = get_api_key(session, ident)
    check_if_match(if_match, key)
    if key.revoked_at is not None:
        raise Conflict(f"API key '{key.name}' is revoked; create a new one")
    changes = {}
    if name is not None and name != key.name:
        if session.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
            raise DuplicateName(
                f"an API key named '{name}' already exists", details=[{"field": "name", "message": "taken"}]
            )
        changes["name"] = {"from": key.name, "to": name}
        key.name = name
    if role is not None and role != key.role:
        if key.role == "admin" and _other_active_admins(session, key) == 0:
            raise Conflict("this is the last active admin key; create another admin key before demoting it")
        changes["role"] = {"from": key.role, "to": role}
        key.role = role
    if changes:
        record_event(
            session,
            kind="api_key.updated",
            actor=actor,
            subject_type="api_key",
            subject_id=ident,
            data={"name": key.name, "changes": changes},
        )
    flush(session, "API key")
    return key


def revoke_api_key(session: Session, ident: str, if_match: str | None, actor: Actor) -> None:
    key = get_api_key(session, ident)
    check_if_match(if_match, key)
    if key.revoked_at is not None:
        return
    if key.role == "admin" and _other_active_admins(session, key) == 0:
        raise Conflict("this is the last active admin key; create another admin key before revoking it")
    key.revoked_at = utcnow()
    record_event(
        session,
        kind="api_key.revoked",
        actor=actor,
        subject_type="api_key",
        subject_id=ident,
        data={"name": key.name, "role": key.role},
    )
    flush(session, "API key")


def new_agent_token(agent_id: str) -> tuple[str, str]:
    """(bearer token, its hash) for an agent; the agent id is part of the token."""
    secret = new_secret()
    return format_credential(AGENT_TOKEN_PREFIX, agent_id, secret), hash_secret(secret)


def rotate_agent_token(session: Session, agent: Agent, actor: Actor) -> str:
    token, digest = new_agent_token(agent.id)
    agent.token_hash = digest
    agent.updated_at = utcnow()
    record_event(
        session,
        kind="agent.token_rotated",
        actor=actor,
        subject_type="agent",
        subject_id=agent.id,
        agent_id=agent.id,
        data={"name": agent.name},
    )
    flush(session, "API key")
    return token


def agent_counts(session: Session, stale_after_s: float) -> dict[str, int]:
    """Agents by status: healthy (seen within `stale_after_s`), stale, or never seen."""
    total = count(session, Agent)
    never = count(session, Agent, Agent.last_seen.is_(None))
    healthy = count(session, Agent, Agent.last_seen >= utcnow() - timedelta(seconds=stale_after_s))
    return {"total": total, "healthy": healthy, "stale": total - never - healthy, "never_seen": never}
