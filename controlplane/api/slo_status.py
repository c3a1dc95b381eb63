"""`GET /api/v1/slos/{id}/status`: the SLO's SLI, error budget and burn rates now, from agent telemetry."""

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from controlplane.api.deps import SessionDep, Viewer
from controlplane.db import repository as repo
from controlplane.schemas.common import Duration


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


def slo_status_router(kind: repo.ResourceKind[Any]) -> APIRouter:
    router = APIRouter(prefix="/api/v1/slos", tags=["slos"])

    @router.get("/{item_id}/status", response_model=SloStatus, summary="SLI, error budget and burn rates now")
    def status(item_id: str, session: SessionDep, _: Viewer) -> Any:
        from controlplane.slo.status import slo_status

        return slo_status(session, repo.get_row(session, kind, item_id))

    return router
