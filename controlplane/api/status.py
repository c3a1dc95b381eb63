"""Fleet summary and the probes. `/healthz` and `/readyz` are the only unauthenticated routes and reveal nothing."""

import logging
from datetime import datetime, timedelta
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from controlplane import __version__
from controlplane.access import agent_counts
from controlplane.api.agent_metrics import Window
from controlplane.api.deps import FreshRollups, SessionDep, SettingsDep, Viewer
from controlplane.db.models import Agent, Backend, Rule, Slo, utcnow
from controlplane.db.repository import count
from controlplane.errors import ValidationFailed
from controlplane.query import (
    REQUEST_DURATION,
    REQUESTS,
    SERVED,
    Histogram,
    Rollup,
    merge_histograms,
    read_rollups,
    summarise,
)
from controlplane.schemas.common import Duration, format_duration
from controlplane.slo.windows import SloWindows
from spillway.contract.names import ATTR_GENAI_TOKEN_TYPE, ATTR_OUTCOME, GENAI_TOKEN_USAGE, GENAI_TPOT, GENAI_TTFT

log = logging.getLogger("spillway.controlplane")
probes = APIRouter(tags=["probes"])
router = APIRouter(prefix="/api/v1", tags=["status"])


@probes.get("/healthz", summary="Liveness: the process answers")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/readyz", summary="Readiness: the database answers", responses={503: {"description": "not ready"}})
def readyz(request: Request) -> Any:
    try:
        with request.app.state.engine.connect() as conn:
            current = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except Exception:  # unreachable, or never migrated; the details stay in the server log
        log.warning("readiness check failed", exc_info=True)
        current = None
    if current is None or current != request.app.state.schema_head:
        message = "database unreachable or not migrated"
        return JSONResponse({"error": "not_ready", "message": message, "details": None}, status_code=503)
    return {"status": "ready"}


class AgentCounts(BaseModel):
    total: int
    healthy: int
    stale: int
    never_seen: int


class FleetTraffic(BaseModel):
    model: str | None
    priority: int | None
    requests: float
    rps: float
    outcomes: dict[str, float]
    p50_ms: float | None
    p99_ms: float | None


class FleetAgent(BaseModel):
    """One agent that reported traffic in the window; the generative figures are null when it served no generative
    model (no GenAI histograms) in it."""

    agent: str
    name: str | None
    requests: float
    rps: float
    ttft_p99_ms: float | None = Field(description="time to first token, all its generative models together")
    tpot_p99_ms: float | None = Field(description="time per output token, all its generative models together")
    tokens_out_per_s: float | None = Field(description="generated tokens per second")


class FleetLive(BaseModel):
    """What the fleet's agents reported over the window (whole minute rollups, so `since` is a minute start)."""

    window: Duration
    since: datetime
    until: datetime
    requests: float
    rps: float
    outcomes: dict[str, float] = Field(description="requests per outcome (local, overflow, rejected, error, ...)")
    p50_ms: float | None = Field(description="latency of requests served on the devices, all agents together")
    p99_ms: float | None
    traffic: list[FleetTraffic] = Field(description="per model and priority")
    agents: list[FleetAgent] = Field(description="per agent that reported in the window, by name")


class SloState(BaseModel):
    slo: str
    name: str
    objective: float
    sli: float | None
    budget_remaining: float | None
    firing: list[str] = Field(description="alert pairs firing now, as 'long/short'")


class ControlLoopState(BaseModel):
    """This replica's part in the control loop (one replica leads at a time on PostgreSQL)."""

    leader: bool
    interval_s: float = Field(description="0: the loop is off on this replica")
    last_cycle_at: datetime | None
    last_cycle_s: float | None = Field(description="how long the last cycle took")
    pairs: int | None = Field(description="(rule, agent) pairs the last cycle evaluated")


class GatewayBackendState(BaseModel):
    """One cloud backend as this replica's gateway sees it (each replica learns on its own)."""

    id: str
    name: str
    url: str
    protocol: str = Field(
        default="v2",
        description="v2 (Open Inference Protocol over HTTP), v2_grpc (the same over gRPC: Triton's/KServe's gRPC "
        "port, a Spillway agent's grpc_port) or openai (OpenAI-compatible)",
    )
    models: list[str]
    model_map: dict[str, str] = Field(
        default_factory=dict, description="openai backends: edge model name -> the backend's name for it"
    )
    healthy: bool = Field(description="passing its readiness checks for every model it lists")
    unhealthy_models: list[str] = Field(description="models whose readiness checks fail")
    ejected: bool = Field(description="out of the pool after consecutive failures (outlier detection)")
    ejected_until: datetime | None
    times_ejected: int = Field(description="the ejection multiplier: each ejection lasts base x this")
    consecutive_failures: int
    outstanding: int = Field(description="requests in flight at this backend now")
    max_concurrency: int
    weight: float
    requests: int = Field(description="attempts sent since this process started")
    errors: int = Field(description="attempts that failed: connect, reset, timeout, 5xx")
    busy: int = Field(default=0, description="attempts the backend shed (503 with Retry-After): retried, not errors")
    p50_ms: float | None = Field(description="over the last 256 attempts")
    p99_ms: float | None
    last_error: str | None
    tenant_share: dict[str, float] = Field(
        default_factory=dict, description="tenant -> the most of this backend's in-flight requests it may hold"
    )
    tenants: dict[str, int] = Field(
        default_factory=dict, description="requests in flight at this backend now, per tenant that has some"
    )
    tenant_refused: dict[str, int] = Field(
        default_factory=dict,
        description="per tenant capped by tenant_share: requests refused since this process started for holding "
        "its share here (and at every other backend with room)",
    )


class GatewayState(BaseModel):
    """The overflow gateway on this replica."""

    active_requests: int
    active_retries: int
    retry_limit: float = Field(description="retries allowed in flight now (the retry budget)")
    loaded_at: datetime | None = Field(description="when the backends were last loaded from the database")
    backends: list[GatewayBackendState]


class FleetStatus(BaseModel):
    version: str
    agents: AgentCounts
    slos: int
    rules: int
    rules_enabled: int
    backends: int
    live: FleetLive
    slo_states: list[SloState] = Field(description="every SLO now, least budget left first")
    control_loop: ControlLoopState
    gateway: GatewayState


MAX_LIVE_WINDOW_S = 86400


def live_traffic(session: Session, window_s: int, now: datetime) -> dict[str, Any]:
    """Request rates, outcomes and latency of the whole fleet over the window, and per agent, from the minute
    rollups."""
    since = (now - timedelta(seconds=window_s)).replace(second=0, microsecond=0)
    rows = list(read_rollups(session, since=since, metrics=(REQUESTS, REQUEST_DURATION, *_GENAI_READ)))
    summary = summarise((r for r in rows if r.metric in (REQUESTS, REQUEST_DURATION)), since=since, until=now)
    served = (r.histogram for r in rows if r.metric == REQUEST_DURATION and r.attributes.get(ATTR_OUTCOME) == SERVED)
    merged = merge_histograms(h for h in served if h is not None)
    p50, p99 = (merged.quantile(0.5), merged.quantile(0.99)) if merged else (None, None)
    traffic = [{"model": t["model"], "priority": t["priority"], "requests": t["requests"], "rps": t["rps"],
                "outcomes": t["outcomes"], "p50_ms": t["latency_ms"]["p50"], "p99_ms": t["latency_ms"]["p99"]}
               for t in summary["traffic"]]  # fmt: skip
    return {
        "window": window_s, "since": since, "until": now, "requests": summary["requests"], "rps": summary["rps"],
        "outcomes": summary["outcomes"], "p50_ms": None if p50 is None else p50 * 1000,
        "p99_ms": None if p99 is None else p99 * 1000, "traffic": traffic,
        "agents": _per_agent(session, rows, max((now - since).total_seconds(), 1.0)),
    }  # fmt: skip


_GENAI_READ = (GENAI_TTFT, GENAI_TPOT, GENAI_TOKEN_USAGE)


def _per_agent(session: Session, rows: list[Rollup], seconds: float) -> list[dict[str, Any]]:
    """Each agent's requests and generative figures (p99 TTFT and TPOT over all its models, output tokens/s)."""
    requests: dict[str, float] = {}
    latencies: dict[tuple[str, str], list[Histogram]] = {}
    tokens_out: dict[str, float] = {}
    for row in rows:
        requests.setdefault(row.agent, 0.0)
        if row.metric == REQUESTS:
            requests[row.agent] += row.total
        elif row.metric == GENAI_TOKEN_USAGE:
            output = row.attributes.get(ATTR_GENAI_TOKEN_TYPE) == "output"
            tokens_out[row.agent] = tokens_out.get(row.agent, 0.0) + (row.total if output else 0.0)
        elif row.metric in (GENAI_TTFT, GENAI_TPOT) and row.histogram is not None:
            latencies.setdefault((row.agent, row.metric), []).append(row.histogram)
    names: dict[str, str] = {}
    if requests:
        names = {
            row.id: row.name
            for row in session.execute(select(Agent.id, Agent.name).where(Agent.id.in_(list(requests))))
        }

    def p99_ms(agent: str, metric: str) -> float | None:
        merged = merge_histograms(latencies.get((agent, metric), ()))
        p99 = merged.quantile(0.99) if merged else None
        return None if p99 is None else p99 * 1000

    entries = [{"agent": agent, "name": names.get(agent), "requests": n, "rps": n / seconds,
                "ttft_p99_ms": p99_ms(agent, GENAI_TTFT), "tpot_p99_ms": p99_ms(agent, GENAI_TPOT),
                "tokens_out_per_s": tokens_out[agent] / seconds if agent in tokens_out else None}
               for agent, n in requests.items()]  # fmt: skip
    return sorted(entries, key=lambda e: (e["name"] or "", e["agent"]))


def slo_states(request: Request, session: Session, max_age_s: float) -> list[dict[str, Any]]:
    windows: SloWindows = request.app.state.slo_windows
    states = []
    for evaluation in windows.evaluate(session, max_age_s=max_age_s):
        if evaluation.spec.source != "slo":
            continue
        status = evaluation.status()
        firing = [
            f"{format_duration(a['long'])}/{format_duration(a['short'])}" for a in status["alerts"] if a["firing"]
        ]
        keep = ("slo", "name", "objective", "sli", "budget_remaining")
        states.append({**{k: status[k] for k in keep}, "firing": firing})
    states.sort(key=lambda s: (s["budget_remaining"] is None, s["budget_remaining"] or 0.0, s["name"]))
    return states


@router.get("/status", response_model=FleetStatus, summary="Fleet summary: agents, live traffic, SLOs",
            dependencies=[FreshRollups])  # fmt: skip
def fleet_status(request: Request, session: SessionDep, settings: SettingsDep, _: Viewer, window: Window = 300) -> Any:
    if window > MAX_LIVE_WINDOW_S:
        raise ValidationFailed.field("query.window", "must be at most 1 day for the fleet's live figures")
    window_s = int(window)
    now = utcnow()
    return FleetStatus(
        version=__version__,
        agents=AgentCounts.model_validate(agent_counts(session, settings.stale_after_s)),
        slos=count(session, Slo),
        rules=count(session, Rule),
        rules_enabled=count(session, Rule, Rule.enabled.is_(True)),
        backends=count(session, Backend),
        live=FleetLive.model_validate(live_traffic(session, window_s, now)),
        slo_states=[SloState.model_validate(s) for s in slo_states(request, session, settings.evaluation_interval_s)],
        control_loop=_loop_state(request, settings.control_loop_interval_s),
        gateway=GatewayState.model_validate(request.app.state.gateway.status()),
    )


def _loop_state(request: Request, interval_s: float) -> ControlLoopState:
    last = request.app.state.control_loop.last
    leader = interval_s > 0 and request.app.state.leadership.leader
    return ControlLoopState(
        leader=leader, interval_s=interval_s, last_cycle_at=last.at if last else None,
        last_cycle_s=last.seconds if last else None, pairs=last.pairs if last else None,
    )  # fmt: skip
