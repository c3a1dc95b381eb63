"""`GET /api/v1/rules/{id}/status`: where a rule stands on each agent it selects, as the control loop left it."""

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from sqlalchemy import select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.db import repository as repo
from controlplane.db.models import Agent, RuleState
from controlplane.rules import stepped_action
from controlplane.schemas.rules import Action

_ACTION: TypeAdapter[Action] = TypeAdapter(Action)


class RuleAgentState(BaseModel):
    agent: str
    agent_name: str
    state: str = Field(description="ok, pending (met, waiting for `for`), firing, or recovering")
    since: datetime
    fired_at: datetime | None
    step: int = Field(description="recovery steps taken (0: the action in full)")
    latched: bool = Field(description="kept fired by the flap limit")
    observed: dict[str, Any] = Field(description="the numbers the condition saw at the last change")
    in_force: dict[str, Any] | None = Field(
        description=(
            "the action as it applies now, after the recovery steps taken (a shed level fewer, a max_tokens cap "
            "doubled...; a dry-run rule's: what it would apply); null while pending"
        )
    )


def rule_status_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/rules", tags=["rules"])

    summary = "The rule on each agent where it is pending, firing or recovering"

    @router.get("/{item_id}/status", response_model=list[RuleAgentState], summary=summary)
    def status(item_id: str, session: SessionDep, _: Viewer) -> Any:
        rule = repo.get_row(session, kind, item_id)
        try:
            action: Action | None = _ACTION.validate_python(rule.action)
        except ValidationError:  # stored by a newer version: the loop leaves it out too
            action = None
        query = (select(RuleState, Agent.name).join(Agent, Agent.id == RuleState.agent_id)
                 .where(RuleState.rule_id == item_id, RuleState.state != "ok").order_by(Agent.name))  # fmt: skip
        active = ("firing", "recovering")
        return [
            RuleAgentState(
                agent=row.agent_id,
                agent_name=name,
                state=row.state,
                since=row.since,
                fired_at=row.fired_at,
                step=row.step,
                latched=bool((row.data or {}).get("latched")),
                observed=(row.data or {}).get("observed") or {},
                in_force=stepped_action(action, row.step).model_dump() if action and row.state in active else None,
            )
            for row, name in session.execute(query)
        ]

    return router
