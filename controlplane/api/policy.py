"""`GET /api/v1/agents/{id}/policy`: an agent's policy document, for the agent itself (its token) or an operator.

A strong ETag; `If-None-Match` with the current one answers 304, so an agent polling every few seconds costs a
primary-key read and no body. An agent may read only its own policy.
"""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response

from controlplane.api.auth import Principal, authorize_role
from controlplane.api.deps import SessionDep, _principal
from controlplane.db.models import Agent
from controlplane.errors import Forbidden, NotFound
from controlplane.rules.loop import PolicyDefaults, current_policy

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])

IfNoneMatch = Annotated[
    str | None, Header(alias="If-None-Match", max_length=512, description="the ETag of the policy the agent holds")
]


def _reader(principal: Annotated[Principal, Depends(_principal)]) -> Principal:
    return principal if principal.kind == "agent" else authorize_role(principal, "viewer")


@router.get(
    "/{item_id}/policy",
    summary="The agent's policy document (its own token, or an operator key)",
    responses={200: {"description": "the document"}, 304: {"description": "unchanged since If-None-Match"}},
)
def read_policy(
    item_id: str,
    request: Request,
    session: SessionDep,
    who: Annotated[Principal, Depends(_reader)],
    if_none_match: IfNoneMatch = None,
) -> Any:
    if who.kind == "agent" and who.id != item_id:
        raise Forbidden("an agent may read only its own policy")
    if session.get(Agent, item_id) is None:
        raise NotFound(f"no agent with id '{item_id}'")
    defaults: PolicyDefaults = request.app.state.policy_defaults
    policy = current_policy(session, item_id, defaults)
    session.commit()
    if if_none_match is not None and policy.etag in (tag.strip() for tag in if_none_match.split(",")):
        return Response(status_code=304, headers={"ETag": policy.etag})
    response = Response(content=_json(policy.document), media_type="application/json")
    response.headers["ETag"] = policy.etag
    response.headers["Cache-Control"] = "no-cache"
    return response


def _json(document: dict[str, Any]) -> bytes:
    import json

    return json.dumps(document, separators=(",", ":")).encode()
