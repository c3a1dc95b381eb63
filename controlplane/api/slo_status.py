"""An SLO's SLI, error budget and burn rates now, from agent telemetry: over all the agents it selects
(`GET /api/v1/slos/{id}/status`) and per agent (`GET /api/v1/slos/{id}/agents`, worst first)."""

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from controlplane.api.deps import FreshRollups, SessionDep, SettingsDep, Viewer
from controlplane.db import repository as repo
from controlplane.errors import NotFound
from controlplane.schemas.common import Duration
from controlplane.settings import Settings
from controlplane.slo import Evaluation, SloWindows


class AlertStatus(BaseModel):
    long: Duration
    short: Duration
    threshold: float = Field(description="burn rate at which this pair fires")
    severity: str
    long_burn_rate: float | None
    short_burn_rate: float | None
    firing: bool


class SloStatus(BaseModel):
    slo: str
    name: str
    agents: int = Field(description="agents the SLO's selector matches")
    window: Duration
    objective: float
    sli: float | None = Field(description="good / total over the window; null without traffic")
    good: float
    total: float
    error_budget: float = Field(description="1 - objective")
    budget_remaining: float | None = Field(description="share of the window's budget left; negative once overspent")
    alerts: list[AlertStatus]
    evaluated_at: datetime = Field(description="when these figures were computed (at most the evaluation interval old)")
    observed_since: datetime | None = Field(
        default=None,
        description="the start of the first minute with events inside the window (exact within the last 6 h, else "
        "the start of its hour); null without events",
    )
    observed: Duration = Field(
        default=0,
        description="the part of the window the figures cover: the window when events reach back to its first "
        "minute, else from observed_since to evaluated_at (less for an SLO younger than its window)",
    )


class AgentSloStatus(SloStatus):
    agent: str


def evaluate(request: Request, session: Session, settings: Settings, slo_id: str) -> Evaluation:
    windows: SloWindows = request.app.state.slo_windows
    for max_age_s in (settings.evaluation_interval_s, 0.0):  # an SLO created since the last refresh: refresh now
        for evaluation in windows.evaluate(session, max_age_s=max_age_s):
            if evaluation.spec.id == slo_id:
                return evaluation
    raise NotFound(f"SLO '{slo_id}' not found")


def slo_status_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/slos", tags=["slos"])

    @router.get("/{item_id}/status", response_model=SloStatus, summary="SLI, error budget and burn rates now",
                dependencies=[FreshRollups])  # fmt: skip
    def status(item_id: str, request: Request, session: SessionDep, settings: SettingsDep, _: Viewer) -> Any:
        repo.get_row(session, kind, item_id)  # 404 names the SLO
        return evaluate(request, session, settings, item_id).status()

    @router.get("/{item_id}/agents", response_model=list[AgentSloStatus], dependencies=[FreshRollups],
                summary="The SLO per agent it selects, least budget left first")  # fmt: skip
    def per_agent(
        item_id: str,
        request: Request,
        session: SessionDep,
        settings: SettingsDep,
        _: Viewer,
        limit: Annotated[int, Query(ge=1, le=10_000, description="at most this many agents")] = 100,
    ) -> Any:
        repo.get_row(session, kind, item_id)
        rows = evaluate(request, session, settings, item_id).per_agent()
        rows.sort(key=lambda r: (r["budget_remaining"] is None, r["budget_remaining"] or 0.0, r["agent"]))
        return rows[:limit]

    return router
