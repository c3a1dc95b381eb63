"""Issuing and revoking credentials: API keys for operators, tokens for agents. Secrets are shown once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from controlplane.db.models import Agent, ApiKey, utcnow
from controlplane.db.repository import Actor, check_if_match, count, flush, record_event
from controlplane.errors import Conflict, DuplicateName, NotFound, PreconditionFailed, SpillwayError
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


def _write_key(session: Session, key: ApiKey, values: dict[str, Any], *, keeps_an_admin: bool) -> bool:
    """One conditional UPDATE of `key` at the version that was read; with `keeps_an_admin`, only while another
    active admin key exists. False when it changed nothing: the key changed meanwhile, or it is the last admin.

    The condition is checked by the statement that writes, so no concurrent change can slip between the two: on
    SQLite the statement holds the database's write lock; on PostgreSQL (READ COMMITTED, where each statement sees
    what was committed before it began) the active admin rows are locked first, in id order, so that two removals
    take turns and the second one's condition sees the first one's commit.
    """
    changed = update(ApiKey).where(ApiKey.id == key.id, ApiKey.version == key.version, ApiKey.revoked_at.is_(None))
    if keeps_an_admin:
        admins = select(ApiKey.id).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).order_by(ApiKey.id)
        session.scalars(admins.with_for_update()).all()
        other = aliased(ApiKey)
        changed = changed.where(exists().where(other.role == "admin", other.revoked_at.is_(None), other.id != key.id))
    try:
        written = session.execute(
            changed.values(**values, version=ApiKey.version + 1), execution_options={"synchronize_session": False}
        )
    except IntegrityError as exc:  # a concurrent rename won the race for the name
        session.rollback()
        raise DuplicateName(
            f"an API key named '{values.get('name')}' already exists",
            details=[{"field": "name", "message": "taken"}],
        ) from exc
    session.refresh(key)  # as written, or as it is now (why nothing was written)
    return cast(CursorResult[Any], written).rowcount == 1


def _refused(key: ApiKey, version: int, doing: str) -> SpillwayError:
    """Why a conditional write of `key` (read at `version`) changed nothing."""
    if key.version != version:
        return PreconditionFailed(f"API key '{key.name}' changed while you wrote it; GET it again and retry")
    return Conflict(f"this is the last active admin key; create another admin key before {doing} it")


def change_api_key(
    session: Session, ident: str, *, name: str | None, role: str | None, if_match: str | None, actor: Actor
) -> ApiKey:
    key = get_api_key(session, ident)
    check_if_match(if_match, key)
    if key.revoked_at is not None:
        raise Conflict(f"API key '{key.name}' is revoked; create a new one")
    changes: dict[str, dict[str, str]] = {}
    if name is not None and name != key.name:
        if session.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
            raise DuplicateName(
                f"an API key named '{name}' already exists", details=[{"field": "name", "message": "taken"}]
            )
        changes["name"] = {"from": key.name, "to": name}
    if role is not None and role != key.role:
        changes["role"] = {"from": key.role, "to": role}
    if not changes:
        return key
    version, demoting = key.version, "role" in changes and key.role == "admin"
    values = {field: change["to"] for field, change in changes.items()}
    if not _write_key(session, key, values, keeps_an_admin=demoting):
        if key.revoked_at is not None:
            raise Conflict(f"API key '{key.name}' is revoked; create a new one")
        raise _refused(key, version, "demoting")
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
    version = key.version
    if not _write_key(session, key, {"revoked_at": utcnow()}, keeps_an_admin=key.role == "admin"):
        if key.revoked_at is not None:  # revoked meanwhile by someone else: what was asked holds
            return
        raise _refused(key, version, "revoking")
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
