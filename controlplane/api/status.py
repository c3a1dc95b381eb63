"""Fleet summary and the probes. `/healthz` and `/readyz` are the only unauthenticated routes and reveal nothing."""

import logging
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text

from controlplane import __version__
from controlplane.api.deps import SessionDep, SettingsDep, Viewer
from controlplane.db.models import Agent, Backend, Rule, Slo, utcnow
from controlplane.db.repository import count

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


class FleetStatus(BaseModel):
    version: str
    agents: AgentCounts
    slos: int
    rules: int
    rules_enabled: int
    backends: int


@router.get("/status", response_model=FleetStatus, summary="Fleet summary")
def fleet_status(session: SessionDep, settings: SettingsDep, _: Viewer) -> Any:
    fresh_since = utcnow() - timedelta(seconds=settings.stale_after_s)
    total = count(session, Agent)
    never = count(session, Agent, Agent.last_seen.is_(None))
    healthy = count(session, Agent, Agent.last_seen >= fresh_since)
    return FleetStatus(
        version=__version__,
        agents=AgentCounts(total=total, healthy=healthy, stale=total - never - healthy, never_seen=never),
        slos=count(session, Slo),
        rules=count(session, Rule),
        rules_enabled=count(session, Rule, Rule.enabled.is_(True)),
        backends=count(session, Backend),
    )
