"""History for charts: an agent's and the fleet's telemetry per step (`/agents/{id}/metrics/history`,
`/metrics/history`), and an SLO's events, SLI, budget left and burn rates per step (`/slos/{id}/history`)."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, BeforeValidator, Field, WithJsonSchema

from controlplane.api.agent_metrics import TenantFilter, _seconds_in_query
from controlplane.api.deps import FreshRollups, SessionDep, SettingsDep, Viewer
from controlplane.db.models import Slo, utcnow
from controlplane.errors import NotFound, Overloaded
from controlplane.history import Steps, metrics_history
from controlplane.schemas.common import Duration
from controlplane.slo.history import MIN_LONG_STEP_S, slo_history
from controlplane.slo.windows import FINE_MINUTES, SloWindows

router = APIRouter(prefix="/api/v1", tags=["history"])

HEAVY_AT_ONCE = 2
"""Histories computed at once per process: a fleet's week reads every rollup of every agent in it, so a few viewers
(or one dashboard left refreshing in many tabs) must not take every thread of the API. Others wait their turn."""
HEAVY_WAIT_S = 20.0  # then 503 overloaded, Retry-After
_heavy = threading.BoundedSemaphore(HEAVY_AT_ONCE)


@contextmanager
def _turn() -> Iterator[None]:
    if not _heavy.acquire(timeout=HEAVY_WAIT_S):
        raise Overloaded(f"{HEAVY_AT_ONCE} histories are being computed; try again shortly",
                         details={"retry_after_s": 5})  # fmt: skip
    try:
        yield
    finally:
        _heavy.release()


_SPAN_SCHEMA = {
    "anyOf": [
        {"type": "integer", "minimum": 60, "description": "seconds"},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d|w)\s*$", "examples": ["5m", "1h"]},
    ]
}
Span = Annotated[Duration, BeforeValidator(_seconds_in_query), WithJsonSchema(_SPAN_SCHEMA, mode="validation")]
WindowParam = Annotated[Span | None, Query(description="how far back: 1m..7d (default 1h)")]
StepParam = Annotated[
    Span | None,
    Query(description="whole minutes, at least 1m; at most 720 points (default: the smallest of 1m, 5m, 15m, 1h, 6h "
          "giving at most 360)"),
]  # fmt: skip
ModelFilter = Annotated[str | None, Query(min_length=1, max_length=128, description="only this model's traffic")]


class GroupPoint(BaseModel):
    model: str | None
    priority: int | None
    requests: float
    rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    queue_depth: float | None = Field(description="the last reading in the step (summed over versions); null if none")


class GenerationPoint(BaseModel):
    model: str
    streams: float = Field(description="streams answered with tokens in the step")
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tokens_out_per_s: float


class DevicePoint(BaseModel):
    metric: str
    attributes: dict[str, Any]
    last: float | None
    max: float | None


class FleetPoint(BaseModel):
    ts: datetime = Field(description="the start of the step")
    requests: float = Field(description="0 in a step without data")
    rps: float = Field(description="requests / the whole step (the current minute counted whole)")
    outcomes: dict[str, float]
    p50_ms: float | None = Field(description="of requests served locally; null without any")
    p95_ms: float | None
    p99_ms: float | None
    groups: list[GroupPoint] = Field(description="per (model, priority)")
    generation: list[GenerationPoint] = Field(description="generative models")


class AgentPoint(FleetPoint):
    device: list[DevicePoint] = Field(description="device and host gauges: last and highest reading in the step")


class FleetHistory(BaseModel):
    agent: None = Field(default=None, description="null: every agent summed")
    window: Duration
    step: Duration
    since: datetime = Field(description="the start of the first step")
    until: datetime = Field(description="now: the last step holds the current minute")
    points: list[FleetPoint] = Field(description="every step of the window, oldest first")


class AgentHistory(FleetHistory):
    agent: str  # type: ignore[assignment]
    points: list[AgentPoint]  # type: ignore[assignment]


class AlertPoint(BaseModel):
    """An alert pair as the status says it (`AlertStatus`), where a window that cannot be counted is null."""

    long: Duration
    short: Duration
    threshold: float = Field(description="burn rate at which this pair fires")
    severity: str
    long_burn_rate: float | None = Field(description="null without events, or where the window is shorter than an "
                                         "hour and older than the six hours kept by the minute")  # fmt: skip
    short_burn_rate: float | None
    firing: bool | None = Field(description="null where a window of the pair cannot be counted (see the rates)")


class SloPoint(BaseModel):
    ts: datetime = Field(description="the end of the step (now, for the last)")
    good: float = Field(description="events within the step")
    total: float
    sli: float | None = Field(description="good / total within the step; null without events")
    window_sli: float | None = Field(description="over the SLO window ending at ts")
    budget_remaining: float | None = Field(description="of the SLO window ending at ts")
    alerts: list[AlertPoint] = Field(description="each pair's burn rates over its windows ending at ts")


class SloHistory(BaseModel):
    slo: str
    name: str
    window: Duration
    step: Duration
    slo_window: Duration
    objective: float
    points: list[SloPoint] = Field(description="every step of the window, oldest first")


@router.get("/agents/{item_id}/metrics/history", response_model=AgentHistory, tags=["agents"],
            summary="An agent's telemetry per step", dependencies=[FreshRollups])  # fmt: skip
def agent_history(item_id: str, session: SessionDep, _: Viewer, window: WindowParam = None, step: StepParam = None,
                  model: ModelFilter = None, tenant: TenantFilter = None) -> Any:  # fmt: skip
    now = utcnow()
    steps = Steps.of(window, step, now)
    with _turn():
        return metrics_history(session, steps, agent=item_id, now=now, model=model, tenant=tenant)


@router.get("/metrics/history", response_model=FleetHistory, summary="The fleet's telemetry per step, agents summed",
            dependencies=[FreshRollups])  # fmt: skip
def fleet_history(session: SessionDep, _: Viewer, window: WindowParam = None, step: StepParam = None,
                  model: ModelFilter = None, tenant: TenantFilter = None) -> Any:  # fmt: skip
    now = utcnow()
    steps = Steps.of(window, step, now)
    with _turn():
        return metrics_history(session, steps, agent=None, now=now, model=model, tenant=tenant)


@router.get("/slos/{item_id}/history", response_model=SloHistory, tags=["slos"],
            summary="An SLO's events, SLI, budget left and burn rates per step",
            dependencies=[FreshRollups])  # fmt: skip
def history_of_slo(item_id: str, request: Request, session: SessionDep, settings: SettingsDep, _: Viewer,
                   window: WindowParam = None, step: StepParam = None) -> Any:  # fmt: skip
    if session.get(Slo, item_id) is None:
        raise NotFound(f"no SLO with id '{item_id}'")
    now = utcnow()
    steps = Steps.of(window, step, now, min_step_beyond=(FINE_MINUTES * 60, MIN_LONG_STEP_S))
    windows: SloWindows = request.app.state.slo_windows
    counts = None
    for max_age_s in (settings.evaluation_interval_s, 0.0):  # an SLO created since the last refresh: refresh now
        counts = windows.counts(session, item_id, now, max_age_s=max_age_s)
        if counts is not None:
            break
    if counts is None:
        raise NotFound(f"no SLO with id '{item_id}'")
    # Beyond the minutes kept, the counts are whole hours: steps then end on whole hours (the last one holds now).
    align = 60 if steps.window > FINE_MINUTES * 60 else 1
    steps = replace(steps, last=counts.latest // align * align + align - 1)
    spec = counts.spec
    with _turn():
        points = slo_history(session, counts, steps, now)
    return {"slo": spec.id, "name": spec.name, "window": steps.window, "step": steps.step, "slo_window": spec.window,
            "objective": spec.objective, "points": points}  # fmt: skip
