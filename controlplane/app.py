"""The control plane's FastAPI application: built by `create_app(settings)`, resources opened in its lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel
from sqlalchemy import text

from controlplane import __version__
from controlplane.api import access as access_routes
from controlplane.api import (
    agent_metrics,
    events,
    history,
    ingest,
    monitoring,
    openslo,
    policy,
    prometheus_rules,
    status,
    tenants,
    whoami,
)
from controlplane.api.authn import AgentTokenCache, Authenticate
from controlplane.api.deps import Viewer, require_admin, require_editor, require_viewer
from controlplane.api.errors import install_error_handlers
from controlplane.api.limits import BodyLimit
from controlplane.api.resources import resource_router
from controlplane.api.rule_status import rule_status_router
from controlplane.api.slo_status import slo_status_router
from controlplane.db.migrate import head_revision, migrate_to
from controlplane.db.models import Agent, Backend, Rule, Slo, utcnow
from controlplane.db.repository import ResourceKind
from controlplane.db.session import make_engine, make_sessionmaker
from controlplane.errors import ValidationFailed
from controlplane.gateway import Gateway, GatewayConfig, GatewayDispatcher, gateway_router
from controlplane.ingest.log import open_ingest_log
from controlplane.ingest.receiver import Ingestor
from controlplane.monitoring import ControlPlaneMetrics, HttpMetrics
from controlplane.rules.loop import ControlLoop, Leadership, PolicyDefaults
from controlplane.schemas.access import AgentCreate, AgentPatch, AgentRead
from controlplane.schemas.backends import BackendCreate, BackendPatch, BackendRead
from controlplane.schemas.common import ERROR_RESPONSES
from controlplane.schemas.rules import RuleCreate, RulePatch, RuleRead
from controlplane.schemas.slos import GENAI_THRESHOLDS_MS, SloCreate, SloPatch, SloRead, genai_threshold_problem
from controlplane.settings import Settings
from controlplane.slo.windows import SloWindows

log = logging.getLogger("spillway.controlplane")
_MIGRATION_LOCK = 0x5370_696C  # "Spil": one replica migrates at a time on PostgreSQL


def agent_reader(stale_after_s: float) -> Any:
    stale_after = timedelta(seconds=stale_after_s)
    fields = [f for f in AgentRead.model_fields if f != "status"]

    def read(row: Agent) -> AgentRead:
        if row.last_seen is None:
            state = "never_seen"
        else:
            state = "stale" if utcnow() - row.last_seen > stale_after else "healthy"
        return AgentRead.model_validate({**{f: getattr(row, f) for f in fields}, "status": state})

    return read


def threshold_on_boundary(boundaries_ms: list[float]) -> Any:
    """A latency SLO's (or latency rule's) threshold must be a histogram bucket boundary, else it is not exact; a
    ttft or tpot one (an SLO's `sli_kind`, a latency condition's `metric`) a boundary of that GenAI histogram."""

    def check(values: dict[str, Any]) -> None:
        threshold = values.get("threshold_ms")
        field, kind = "body.threshold_ms", values.get("sli_kind")
        condition = values.get("condition")
        if isinstance(condition, dict) and condition.get("kind") == "latency":  # a rule's latency condition
            threshold, field = condition.get("threshold_ms"), "body.condition.latency.threshold_ms"
            kind = condition.get("metric")
        if threshold is not None and kind in GENAI_THRESHOLDS_MS:
            problem = genai_threshold_problem(str(kind), threshold)
            if problem is not None:
                raise ValidationFailed.field(field, problem)
            return
        if threshold is not None and not any(abs(threshold - b) <= 1e-9 * b for b in boundaries_ms):
            listed = ", ".join(f"{b:g}" for b in sorted(boundaries_ms))
            raise ValidationFailed.field(
                field,
                f"{threshold:g} is not a latency bucket boundary; use one of {listed} (or add it to "
                "SPILLWAY_LATENCY_BUCKETS_MS and the agents' latency_buckets_ms)",
            )

    return check


def _api_router(settings: Settings, gateway: Gateway) -> APIRouter:
    api = APIRouter(responses=ERROR_RESPONSES)
    slo_kind = ResourceKind("slo", Slo, SloCreate, SloRead.model_validate,
                            check=threshold_on_boundary(settings.latency_buckets_ms))  # fmt: skip
    rule_kind = ResourceKind("rule", Rule, RuleCreate, RuleRead.model_validate,
                             check=threshold_on_boundary(settings.latency_buckets_ms))  # fmt: skip
    kinds: list[tuple[ResourceKind[Any], str, type[BaseModel], type[BaseModel], Any, bool, Any]] = [
        (slo_kind, "slos", SloRead, SloPatch, require_editor, True, None),
        (
            rule_kind,
            "rules",
            RuleRead,
            RulePatch,
            require_editor,
            True,
            None,
        ),
        (
            ResourceKind("backend", Backend, BackendCreate, BackendRead.model_validate, frozenset({"auth_header"})),
            "backends",
            BackendRead,
            BackendPatch,
            require_editor,
            True,
            gateway.backends_changed,  # the gateway in this process sees a change at once
        ),
    ]
    agent_kind = ResourceKind("agent", Agent, AgentCreate, agent_reader(settings.stale_after_s))
    kinds.append((agent_kind, "agents", AgentRead, AgentPatch, require_admin, False, None))
    # Before the resource routers: their `GET /slos/{id}` would take `/slos/prometheus-rules` for an id.
    api.include_router(openslo.openslo_router(slo_kind))
    api.include_router(prometheus_rules.router)
    api.include_router(history.router)
    api.include_router(whoami.router)
    api.include_router(access_routes.agent_enrolment_router(agent_kind))
    for kind, plural, read_model, patch_model, writer, with_create, on_change in kinds:
        api.include_router(
            resource_router(
                kind,
                plural=plural,
                read_model=read_model,
                patch_model=patch_model,
                reader=require_viewer,
                writer=writer,
                with_create=with_create,
                on_change=on_change,
            )
        )
    api.include_router(slo_status_router(slo_kind))
    api.include_router(rule_status_router(rule_kind))
    api.include_router(access_routes.keys_router)
    api.include_router(events.router)
    api.include_router(status.router)
    api.include_router(agent_metrics.router)
    api.include_router(policy.router)
    api.include_router(tenants.router)
    return api


def migrate_locked(engine: Any, url: str) -> None:
    """Run migrations to head; on PostgreSQL under an advisory lock so that replicas starting together take turns."""
    if engine.dialect.name != "postgresql":
        migrate_to(url)
        return
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK})
        try:
            migrate_to(url)
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK})


def _ingestor(factory: Any, settings: Settings) -> Ingestor:
    """The receiver, with this process's ingest log (SPILLWAY_INGEST_ACK=logged) or none (`applied`)."""
    return Ingestor(factory, max_series_per_agent=settings.max_series_per_agent,
                    latency_buckets_ms=settings.latency_buckets_ms, log=open_ingest_log(settings))  # fmt: skip


def prune_once(app: FastAPI, settings: Settings) -> int:
    """Delete minute rollups older than the retention; returns how many went."""
    from controlplane.db.session import transaction
    from controlplane.ingest.receiver import prune

    with transaction(app.state.sessionmaker) as session:
        return prune(session, utcnow() - timedelta(days=settings.retention_days))


async def _start_ingest(app: FastAPI, ingestor: Ingestor, retry_s: float = 5.0) -> asyncio.Task[None] | None:
    """Start the receiver (replaying its log) before serving; when the database is not there yet (not migrated,
    unreachable: /readyz says so) the API serves anyway, exports answer 503, and a task retries every `retry_s`."""

    async def start() -> bool:
        try:
            await to_thread.run_sync(ingestor.start)
        except Exception as exc:
            log.warning("ingest: could not start (replay the ingest log) yet, retrying in %g s: %s", retry_s, exc)
            return False
        app.state.ingest_ready = True
        return True

    async def retry() -> None:
        while True:
            await asyncio.sleep(retry_s)
            if await start():
                return

    return None if await start() else asyncio.create_task(retry())


async def _retention_loop(app: FastAPI, settings: Settings, every_s: float = 3600.0) -> None:
    """Apply the retention once at start and then every hour, off the event loop."""
    while True:
        try:
            removed = await to_thread.run_sync(prune_once, app, settings)
            app.state.retention_passes += 1
            if removed:
                log.info("retention: deleted %d minute rollups older than %.0f days", removed, settings.retention_days)
        except Exception:  # a failed pass is retried next time; it never takes the API down
            log.warning("retention pass failed", exc_info=True)
        await asyncio.sleep(every_s)


async def _control_loop(app: FastAPI, every_s: float) -> None:
    """Every `every_s`: keep or try to take the leadership; the leader runs a cycle, off the event loop."""
    loop: ControlLoop = app.state.control_loop
    leadership: Leadership = app.state.leadership
    while True:
        try:
            leads = await to_thread.run_sync(leadership.ensure)
            app.state.monitoring.loop_leader.set(1 if leads else 0)
            if leads:
                report = await to_thread.run_sync(loop.cycle)
                app.state.monitoring.cycled(report.seconds)
                if report.seconds > every_s:
                    log.warning("control loop: a cycle took %.2f s, longer than its %.1f s interval",
                                report.seconds, every_s)  # fmt: skip
            else:
                loop.forget()
        except Exception:  # a failed cycle is retried next time; it never takes the API down
            log.warning("control loop cycle failed", exc_info=True)
            loop.forget()
        await asyncio.sleep(every_s)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        if settings.migrate_on_start:
            migrate_locked(engine, settings.database_url)
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.schema_head = head_revision()
        app.state.slo_windows = SloWindows()
        app.state.control_loop = ControlLoop(app.state.sessionmaker, app.state.slo_windows, app.state.policy_defaults)
        app.state.leadership = Leadership(engine)
        ingestor = _ingestor(app.state.sessionmaker, settings)
        app.state.ingestor = ingestor
        app.state.ingest_ready = False  # until the log is replayed: exports are answered 503
        app.state.monitoring.watch_ingest(ingestor.stats)
        starting = await _start_ingest(app, ingestor)  # replays what the ingest log holds unapplied, before serving
        app.state.ingest_slots = asyncio.Semaphore(settings.ingest_max_concurrent)
        app.state.retention_passes = 0
        tasks = [asyncio.create_task(_retention_loop(app, settings))]
        if starting is not None:
            tasks.append(starting)
        if settings.control_loop_interval_s > 0:
            tasks.append(asyncio.create_task(_control_loop(app, settings.control_loop_interval_s)))
        try:
            await gateway.start(app.state.sessionmaker)
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.close()
            await to_thread.run_sync(ingestor.close)  # applies what is queued, releases the log slot
            app.state.leadership.release()
            engine.dispose()

    app = FastAPI(
        title="Spillway control plane",
        version=__version__,
        description="REST policy API: SLOs, degradation rules, cloud backends, agents, API keys and events.",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.policy_defaults = PolicyDefaults(
        buckets_ms=list(settings.latency_buckets_ms), export_interval_s=settings.agent_export_interval_s,
        poll_interval_s=settings.policy_poll_interval_s, stale_after_s=settings.stale_after_s,
    )  # fmt: skip
    app.state.monitoring = ControlPlaneMetrics(lambda: getattr(app.state, "sessionmaker", None), settings.stale_after_s)
    gateway = Gateway(GatewayConfig.from_settings(settings), app.state.monitoring.gateway)
    app.state.monitoring.gateway.watch(gateway.pool.snapshot)  # per-tenant refusals, read at each scrape
    app.state.gateway = gateway
    install_error_handlers(app)
    # Added last is outermost. Inference to the gateway first, on its own fast path (its own authentication,
    # body limit and metrics); everything else: count every request, refuse oversized bodies, authenticate, route.
    app.state.agent_tokens = AgentTokenCache(settings.agent_auth_cache_s)
    app.add_middleware(Authenticate, cache=app.state.agent_tokens)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, per_path={"/v1/metrics": settings.ingest_max_body_bytes}
    )
    app.add_middleware(HttpMetrics, metrics=app.state.monitoring)
    app.add_middleware(GatewayDispatcher, gateway=gateway)
    app.include_router(status.probes)
    app.include_router(ingest.router, responses=ERROR_RESPONSES)  # the hot path: matched first
    app.include_router(monitoring.router, responses=ERROR_RESPONSES)
    app.include_router(_api_router(settings, gateway))
    app.include_router(gateway_router())

    @app.get("/api/v1/openapi.json", include_in_schema=False)
    def openapi(_: Viewer) -> dict[str, Any]:
        return app.openapi()

    return app
