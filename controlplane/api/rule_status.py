"""`GET /api/v1/rules/{id}/status`: where a rule stands on each agent it selects, as the control loop left it."""

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy import select

from controlplane.api.deps import SessionDep, Viewer
from controlplane.db import repository as repo
from controlplane.db.models import Agent, RuleState


class RuleAgentState(BaseModel):
    agent: str
    agent_name: str
    state: str = Field(description="ok, pending (met, waiting for `for`), firing, or recovering")
    since: datetime
    fired_at: datetime | None
    step: int = Field(description="recovery steps taken (0: the action in full)")
    latched: bool = Field(description="kept fired by the flap limit")
    observed: dict[str, Any] = Field(description="the numbers the condition saw at the last change")


def rule_status_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/rules", tags=["rules"])

    summary = "The rule on each agent where it is pending, firing or recovering"

    @router.get("/{item_id}/status", response_model=list[RuleAgentState], summary=summary)
    def status(item_id: str, session: SessionDep, _: Viewer) -> Any:
        repo.get_row(session, kind, item_id)
        query = (select(RuleState, Agent.name).join(Agent, Agent.id == RuleState.agent_id)
                 .where(RuleState.rule_id == item_id, RuleState.state != "ok").order_by(Agent.name))  # fmt: skip
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
            )
            for row, name in session.execute(query)
        ]

    return router
