"""Agent enrolment and operator API keys (admin only); tokens and keys appear once, in the creating response."""

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import select

from controlplane import access
from controlplane.api.deps import Admin, IfMatch, Reason, SessionDep, actor_of
from controlplane.api.resources import Cursor, Limit
from controlplane.db import repository as repo
from controlplane.db.models import ApiKey
from controlplane.schemas.access import (
    AgentCreate,
    AgentCreated,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPatch,
    ApiKeyRead,
)
from controlplane.schemas.common import Page
from controlplane.secrets import new_ident


def agent_enrolment_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/agents", tags=["agents"])

    @router.post(
        "",
        response_model=AgentCreated,
        status_code=status.HTTP_201_CREATED,
        summary="Enrol an agent; the response holds its token, shown only here",
    )
    def create_agent(
        body: AgentCreate, session: SessionDep, who: Admin, response: Response, reason: Reason = None
    ) -> Any:
        ident = new_ident()
        token, digest = access.new_agent_token(ident)
        row = repo.create_row(session, kind, body, actor_of(who, reason), ident=ident, token_hash=digest)
        session.commit()
        response.headers["Location"] = f"/api/v1/agents/{row.id}"
        response.headers["ETag"] = repo.etag(row)
        return {"agent": kind.read(row), "token": token}

    @router.post(
        "/{item_id}/token",
        response_model=AgentCreated,
        summary="Issue a new token for an agent; the old one stops working at once",
    )
    def rotate_token(
        item_id: str,
        session: SessionDep,
        who: Admin,
        response: Response,
        if_match: IfMatch = None,
        reason: Reason = None,
    ) -> Any:
        row = repo.get_row(session, kind, item_id)
        repo.check_if_match(if_match, row)
        token = access.rotate_agent_token(session, row, actor_of(who, reason))
        session.commit()
        response.headers["ETag"] = repo.etag(row)
        return {"agent": kind.read(row), "token": token}

    return router


keys_router = APIRouter(prefix="/api/v1/keys", tags=["keys"])


@keys_router.get("", response_model=Page[ApiKeyRead], summary="List API keys (never their secrets)")
def list_keys(
    session: SessionDep,
    _: Admin,
    cursor: Cursor = None,
    limit: Limit = 100,
    include_revoked: Annotated[bool, Query()] = False,
) -> Any:
    query = select(ApiKey) if include_revoked else select(ApiKey).where(ApiKey.revoked_at.is_(None))
    rows, next_cursor = repo.page(session, query, key=ApiKey.name, cursor=cursor, limit=limit)
    return {"items": rows, "next_cursor": next_cursor}


@keys_router.post(
    "",
    response_model=ApiKeyCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Create an API key; the response holds the key, shown only here",
)
def create_key(body: ApiKeyCreate, session: SessionDep, who: Admin, response: Response, reason: Reason = None) -> Any:
    row, key = access.issue_api_key(session, body.name, body.role, actor_of(who, reason))
    session.commit()
    response.headers["Location"] = f"/api/v1/keys/{row.id}"
    response.headers["ETag"] = repo.etag(row)
    return {"api_key": row, "key": key}


@keys_router.get("/{key_id}", response_model=ApiKeyRead, summary="Read an API key")
def get_key(key_id: str, session: SessionDep, _: Admin, response: Response) -> Any:
    row = access.get_api_key(session, key_id)
    response.headers["ETag"] = repo.etag(row)
    return row


@keys_router.patch("/{key_id}", response_model=ApiKeyRead, summary="Rename an API key or change its role")
def patch_key(
    key_id: str,
    body: ApiKeyPatch,
    session: SessionDep,
    who: Admin,
    response: Response,
    if_match: IfMatch = None,
    reason: Reason = None,
) -> Any:
    row = access.change_api_key(
        session, key_id, name=body.name, role=body.role, if_match=if_match, actor=actor_of(who, reason)
    )
    session.commit()
    response.headers["ETag"] = repo.etag(row)
    return row


@keys_router.delete(
    "/{key_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke an API key (it stays listed with include_revoked)",
)
def revoke_key(
    key_id: str, session: SessionDep, who: Admin, if_match: IfMatch = None, reason: Reason = None
) -> Response:
    access.revoke_api_key(session, key_id, if_match, actor_of(who, reason))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
