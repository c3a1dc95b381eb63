"""`GET /api/v1/agents/{id}/policy`: an agent's policy document, for the agent itself (its token) or an operator.

A strong ETag; `If-None-Match` with the current one answers 304, so an agent polling every few seconds costs one
narrow primary-key read (the ETag column alone) and no body. A fleet polls this every few seconds (1,000 agents
every 5 s: 200 a second), so the route is async and does its database work in one worker-thread call: FastAPI
would run each sync dependency (the caller, the session) and a sync route in a thread of its own. An agent may read
only its own policy.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import Engine, bindparam, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.api.auth import Principal, authorize_role
from controlplane.api.deps import _bearer
from controlplane.db.models import Agent, Policy
from controlplane.errors import Forbidden, NotFound, Unauthenticated
from controlplane.rules.loop import PolicyDefaults, current_policy

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])

IfNoneMatch = Annotated[
    str | None, Header(alias="If-None-Match", max_length=512, description="the ETag of the policy the agent holds")
]


async def _reader(
    request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The agent itself or an operator with the viewer role; async, so FastAPI runs it without a thread (the
    `Authenticate` middleware has resolved the caller already; the bearer scheme is declared for OpenAPI)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:  # only if the middleware were removed: fail closed
        raise Unauthenticated("missing credentials")
    return principal if principal.kind == "agent" else authorize_role(principal, "viewer")


@router.get(
    "/{item_id}/policy",
    summary="The agent's policy document (its own token, or an operator key)",
    responses={200: {"description": "the document"}, 304: {"description": "unchanged since If-None-Match"}},
)
async def read_policy(
    item_id: str,
    request: Request,
    who: Annotated[Principal, Depends(_reader)],
    if_none_match: IfNoneMatch = None,
) -> Response:
    if who.kind == "agent" and who.id != item_id:
        raise Forbidden("an agent may read only its own policy")
    held = frozenset() if if_none_match is None else frozenset(tag.strip() for tag in if_none_match.split(","))
    state = request.app.state
    return await to_thread.run_sync(_answer, state.engine, state.sessionmaker, item_id, held, state.policy_defaults)


_STORED_ETAG = select(Policy.etag).where(Policy.agent_id == bindparam("agent"))


def _answer(engine: Engine, factory: sessionmaker[Session], agent_id: str, held: frozenset[str],
            defaults: PolicyDefaults) -> Response:  # fmt: skip
    """304 when the stored ETag is one the agent holds (a stored document means the agent exists: its row goes
    with the agent's), read on a plain connection (a third of an ORM session's cost); otherwise the document,
    made first if the loop has not reached the agent yet."""
    if held:
        with engine.connect() as connection:
            etag = connection.execute(_STORED_ETAG, {"agent": agent_id}).scalar()
        if etag is not None and etag in held:
            return Response(status_code=304, headers={"ETag": etag})
    with factory() as session:
        if session.get(Agent, agent_id) is None:
            raise NotFound(f"no agent with id '{agent_id}'")
        policy = current_policy(session, agent_id, defaults)
        session.commit()
        if policy.etag in held:  # the document made just now is the one the agent holds
            return Response(status_code=304, headers={"ETag": policy.etag})
        response = Response(content=_json(policy.document), media_type="application/json")
        response.headers["ETag"] = policy.etag
        response.headers["Cache-Control"] = "no-cache"
        return response


def _json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()
