"""`/api/v1/tenants`: the applications that share the agents a selector picks, with weights, quotas and tokens.

Operators read them (viewer) and admins change them, as API keys and agents: a tenant's token is a credential for
the agents' APIs. Every change is an audit event, and republishes, in the same transaction, the policy document of
each agent whose tenants it changes (`controlplane/rules/tenants.py`). A token is made here, returned once, and
kept only as its SHA-256 digest (`spillway.contract.tenants.hash_token`): the digest is what the documents carry.

No `from __future__ import annotations` here: FastAPI reads the body types from the annotations.
"""

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response, status
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from controlplane.api.deps import Admin, IfMatch, Reason, SessionDep, Viewer, actor_of
from controlplane.api.resources import Cursor, Limit
from controlplane.db import repository as repo
from controlplane.db.models import Tenant, TenantToken, utcnow
from controlplane.errors import Conflict, NotFound
from controlplane.rules.loop import PolicyDefaults
from controlplane.rules.tenants import republish
from controlplane.schemas.common import Page
from controlplane.schemas.tenants import (
    MAX_TOKENS_PER_TENANT,
    TenantCreate,
    TenantPatch,
    TenantRead,
    TenantTokenCreate,
    TenantTokenCreated,
    TenantTokenRead,
)
from controlplane.secrets import new_ident
from spillway.contract.tenants import MAX_TENANTS, hash_token

TOKEN_PREFIX = "spt_"  # noqa: S105 - what a tenant token starts with (a Spillway tenant token), not a secret
PREFIX_SHOWN = len(TOKEN_PREFIX) + 6  # the characters kept to tell tokens apart: 36 of the secret's 256 bits

KIND: repo.ResourceKind[Tenant] = repo.ResourceKind("tenant", Tenant, TenantCreate, TenantRead.model_validate)
router = APIRouter(prefix="/api/v1/tenants", tags=["tenants"])


def _defaults(request: Request) -> PolicyDefaults:
    defaults: PolicyDefaults = request.app.state.policy_defaults
    return defaults


def _send(row: Tenant, response: Response) -> TenantRead:
    response.headers["ETag"] = repo.etag(row)
    return TenantRead.model_validate(row)


def _changed(session: Session, request: Request, actor: repo.Actor) -> None:
    """The change is written (not committed): republish the documents it changes, then commit both at once."""
    republish(session, actor, _defaults(request))
    session.commit()


@router.get("", response_model=Page[TenantRead], summary="List tenants")
def list_tenants(session: SessionDep, _: Viewer, cursor: Cursor = None, limit: Limit = 100) -> Any:
    rows, next_cursor = repo.list_rows(session, KIND, cursor=cursor, limit=limit)
    return {"items": [TenantRead.model_validate(r) for r in rows], "next_cursor": next_cursor}


@router.post("", response_model=TenantRead, status_code=status.HTTP_201_CREATED, summary="Create a tenant")
def create_tenant(
    body: TenantCreate, request: Request, session: SessionDep, who: Admin, response: Response, reason: Reason = None
) -> Any:
    if repo.count(session, Tenant) >= MAX_TENANTS:
        raise Conflict(f"there are {MAX_TENANTS} tenants already, the most a policy document carries; delete one")
    actor = actor_of(who, reason)
    row = repo.create_row(session, KIND, body, actor)
    _changed(session, request, actor)
    response.headers["Location"] = f"/api/v1/tenants/{row.id}"
    return _send(row, response)


@router.get("/{item_id}", response_model=TenantRead, summary="Read a tenant")
def get_tenant(item_id: str, session: SessionDep, _: Viewer, response: Response) -> Any:
    return _send(repo.get_row(session, KIND, item_id), response)


@router.put("/{item_id}", response_model=TenantRead, summary="Replace a tenant")
def replace_tenant(
    item_id: str,
    body: TenantCreate,
    request: Request,
    session: SessionDep,
    who: Admin,
    response: Response,
    if_match: IfMatch = None,
    reason: Reason = None,
) -> Any:
    actor = actor_of(who, reason)
    row = repo.replace_row(session, KIND, item_id, body, if_match, actor)
    _changed(session, request, actor)
    return _send(row, response)


@router.patch("/{item_id}", response_model=TenantRead, summary="Change some fields of a tenant")
def patch_tenant(
    item_id: str,
    body: TenantPatch,  # type: ignore[valid-type]
    request: Request,
    session: SessionDep,
    who: Admin,
    response: Response,
    if_match: IfMatch = None,
    reason: Reason = None,
) -> Any:
    actor = actor_of(who, reason)
    row = repo.patch_row(session, KIND, item_id, body, if_match, actor)
    _changed(session, request, actor)
    return _send(row, response)


@router.delete("/{item_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a tenant and its tokens")
def delete_tenant(
    item_id: str,
    request: Request,
    session: SessionDep,
    who: Admin,
    if_match: IfMatch = None,
    reason: Reason = None,
) -> Response:
    actor = actor_of(who, reason)
    repo.check_if_match(if_match, repo.get_row(session, KIND, item_id))
    session.execute(delete(TenantToken).where(TenantToken.tenant_id == item_id))
    repo.delete_row(session, KIND, item_id, if_match, actor)
    _changed(session, request, actor)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# ---- tokens ----------------------------------------------------------------------------------


def _tokens(session: Session, tenant_id: str) -> list[TenantToken]:
    query = select(TenantToken).where(TenantToken.tenant_id == tenant_id)
    return list(session.scalars(query.order_by(TenantToken.created_at, TenantToken.id)))


@router.get(
    "/{item_id}/tokens", response_model=Page[TenantTokenRead], summary="List a tenant's tokens (never their secrets)"
)
def list_tokens(item_id: str, session: SessionDep, _: Viewer) -> Any:
    repo.get_row(session, KIND, item_id)
    return {"items": _tokens(session, item_id), "next_cursor": None}


@router.post(
    "/{item_id}/tokens",
    response_model=TenantTokenCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Make a token for a tenant; the response holds it, shown only here",
)
def create_token(
    item_id: str,
    request: Request,
    session: SessionDep,
    who: Admin,
    response: Response,
    body: Annotated[TenantTokenCreate | None, Body()] = None,
    reason: Reason = None,
) -> Any:
    tenant = repo.get_row(session, KIND, item_id)
    if len(_tokens(session, item_id)) >= MAX_TOKENS_PER_TENANT:
        raise Conflict(f"tenant '{tenant.name}' has {MAX_TOKENS_PER_TENANT} tokens, the most it may; revoke one first")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    label = body.label if body is not None else ""
    row = TenantToken(id=new_ident(), tenant_id=item_id, label=label, prefix=token[:PREFIX_SHOWN],
                      token_sha256=hash_token(token), created_at=utcnow())  # fmt: skip
    session.add(row)
    repo.flush(session, "tenant token")
    actor = actor_of(who, reason)
    repo.record_event(
        session, kind="tenant.token_created", actor=actor, subject_type="tenant", subject_id=item_id,
        data={"name": tenant.name, "token_id": row.id, "prefix": row.prefix, "label": label},
    )  # fmt: skip
    _changed(session, request, actor)
    response.headers["Location"] = f"/api/v1/tenants/{item_id}/tokens"
    return {"tenant_token": row, "token": token}


@router.delete(
    "/{item_id}/tokens/{token_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke a tenant's token: the agents refuse it once they have the new policy",
)
def revoke_token(
    item_id: str, token_id: str, request: Request, session: SessionDep, who: Admin, reason: Reason = None
) -> Response:
    tenant = repo.get_row(session, KIND, item_id)
    row = session.get(TenantToken, token_id)
    if row is None or row.tenant_id != item_id:
        raise NotFound(f"tenant '{tenant.name}' has no token with id '{token_id}'")
    prefix, label = row.prefix, row.label
    session.delete(row)
    session.flush()
    actor = actor_of(who, reason)
    repo.record_event(
        session, kind="tenant.token_revoked", actor=actor, subject_type="tenant", subject_id=item_id,
        data={"name": tenant.name, "token_id": token_id, "prefix": prefix, "label": label},
    )  # fmt: skip
    _changed(session, request, actor)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
