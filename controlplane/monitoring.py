"""The control plane's own metrics, for Prometheus: HTTP requests per route template, OTLP data points ingested,
agents by status, the overflow gateway per backend (and its refusals per tenant its `tenant_share` names;
docs/overflow/gateway.md), and the process. Each app has its own registry (tests build many apps in one process).

Labels are bounded: routes are templates (`/api/v1/slos/{item_id}`), never raw paths, and a request answered
before or without routing (bad credentials, an oversized body, an unknown path) is `route="(unrouted)"`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane import __version__
from controlplane.access import agent_counts

log = logging.getLogger("spillway.controlplane")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format 0.0.4."""

UNROUTED = "(unrouted)"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class AgentStatusCollector(Collector):
    """`spillway_agents{status}` read from the database at scrape time: healthy, stale or never seen."""

    def __init__(self, sessions: Callable[[], sessionmaker[Session] | None], stale_after_s: float) -> None:
        self.sessions = sessions
        self.stale_after = timedelta(seconds=stale_after_s)

    def describe(self) -> Iterable[Metric]:
        yield self._family()

    def collect(self) -> Iterable[Metric]:
        factory = self.sessions()
        if factory is None:  # before the app's lifespan opened the database
            return
        try:
            with factory() as session:
                counts = agent_counts(session, self.stale_after.total_seconds())
        except Exception:  # the other metrics still go out; the database's trouble is in the log
            log.warning("could not count agents for /metrics", exc_info=True)
            return
        family = self._family()
        for status in ("healthy", "stale", "never_seen"):
            family.add_metric([status], counts[status])
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "spillway_agents",
            "enrolled agents by status (stale: not seen for SPILLWAY_STALE_AFTER_S)",
            labels=["status"],
        )


class GatewayTenantCollector(Collector):
    """`spillway_gateway_tenant_refusals_total{backend, tenant}` read from the gateway's backends at scrape time
    (their `tenant_refused`, as `GET /api/v1/status` shows it): requests refused (429 `tenant_quota`) for holding
    their share of a backend and of every other one with room. Bounded: only the tenants a backend's `tenant_share`
    names, each from 0; a backend's count restarts when the process does (or the backend is deleted)."""

    NAME = "spillway_gateway_tenant_refusals"

    def __init__(self) -> None:
        self.snapshot: Callable[[], Iterable[Mapping[str, Any]]] | None = None

    def describe(self) -> Iterable[Metric]:
        yield self._family()

    def collect(self) -> Iterable[Metric]:
        if self.snapshot is None:  # no gateway watched (yet)
            return
        try:
            backends = list(self.snapshot())
        except Exception:  # read while the gateway changes it: the other metrics still go out
            log.warning("could not read the gateway's tenant refusals for /metrics", exc_info=True)
            return
        family = self._family()
        for backend in backends:
            refused = backend.get("tenant_refused") or {}
            for tenant in sorted(backend.get("tenant_share") or {}):
                family.add_metric([str(backend["name"]), tenant], float(refused.get(tenant, 0)))
        yield family

    @classmethod
    def _family(cls) -> CounterMetricFamily:
        return CounterMetricFamily(
            cls.NAME,
            "requests of a tenant refused for holding its tenant_share of this backend (and of every other with room)",
            labels=["backend", "tenant"],
        )


class IngestCollector(Collector):
    """The OTLP receiver's statistics (`Ingestor.stats()`) read at scrape time: `spillway_ingest_<name>`, a gauge
    (what is queued, how old, the log's size) or a counter (`_total`: exports submitted, applied, replayed ...)."""

    PREFIX = "spillway_ingest_"
    GAUGES = {
        "queued_exports": "exports acknowledged or taken and not yet applied to the rollups",
        "oldest_unapplied_s": "age of the oldest export not yet applied (seconds)",
        "log_bytes": "size of this process's ingest log (segments not yet deleted)",
    }
    COUNTERS = {
        "submitted_exports": "exports taken by this process (folded, logged, queued)",
        "applied": "exports applied to the rollups",
        "failed": "exports the store failed to apply",
        "batches": "applier transactions",
        "replayed": "ingest-log records replayed at start",
        "replay_failed": "ingest-log records that could not be replayed",
        "log_cut_records": "torn records cut from the ingest log's tail at start",
        "stale_batches": "applier batches redone because another replica had written their streams",
    }

    def __init__(self) -> None:
        self.stats: Callable[[], Mapping[str, float]] | None = None

    def describe(self) -> Iterable[Metric]:
        for name, text in self.GAUGES.items():
            yield GaugeMetricFamily(self.PREFIX + name, text)
        for name, text in self.COUNTERS.items():
            yield CounterMetricFamily(self.PREFIX + name, text)

    def collect(self) -> Iterable[Metric]:
        if self.stats is None:  # before the app's lifespan started the receiver
            return
        try:
            stats = dict(self.stats())
        except Exception:  # the other metrics still go out
            log.warning("could not read the ingest statistics for /metrics", exc_info=True)
            return
        for name, value in sorted(stats.items()):
            metric = self.PREFIX + re.sub(r"[^a-z0-9_]", "_", name.lower())
            if name in self.COUNTERS:
                family: Metric = CounterMetricFamily(metric, self.COUNTERS[name], value=float(value))
            else:
                family = GaugeMetricFamily(metric, self.GAUGES.get(name, f"the OTLP receiver's {name}"), float(value))
            yield family


GATEWAY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The overflow gateway's instruments; per backend, labelled by the backend's name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "spillway_gateway_requests",
            "attempts sent to a backend, by its answer's status code or the failure (connect, reset, timeout)",
            ["backend", "code"],
            registry=registry,
        )
        self.errors = Counter(
            "spillway_gateway_errors",
            "failed attempts by kind: connect, reset, timeout, status_5xx, bad_response",
            ["backend", "kind"],
            registry=registry,
        )
        self.duration = Histogram(
            "spillway_gateway_request_duration_seconds",
            "time of one attempt at a backend, until its answer's last byte was passed on",
            ["backend"],
            buckets=GATEWAY_BUCKETS_S,
            registry=registry,
        )
        self.outstanding = Gauge(
            "spillway_gateway_outstanding", "requests in flight at a backend", ["backend"], registry=registry
        )
        self.ejections = Counter(
            "spillway_gateway_ejections", "times a backend was ejected by outlier detection", ["backend"],
            registry=registry,
        )  # fmt: skip
        self.retries = Counter("spillway_gateway_retries", "attempts retried on another backend", registry=registry)
        self.rejected = Counter(
            "spillway_gateway_rejected",
            "requests the gateway answered itself with an error, by its code (no_backend, no_capacity, ...)",
            ["reason"],
            registry=registry,
        )
        self.tenant_refusals = GatewayTenantCollector()
        registry.register(self.tenant_refusals)

    def watch(self, snapshot: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        """Read the per-tenant refusals from `snapshot` (the gateway's `BackendPool.snapshot`) at each scrape."""
        self.tenant_refusals.snapshot = snapshot

    def forget(self, backend: str) -> None:
        """A deleted (or renamed) backend's gauge goes; its counters stay until the process restarts."""
        with contextlib.suppress(KeyError):
            self.outstanding.remove(backend)


class ControlPlaneMetrics:
    """The instruments and their registry."""

    def __init__(self, sessions: Callable[[], sessionmaker[Session] | None], stale_after_s: float) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "spillway_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "spillway_http_request_duration_seconds",
            "time to answer an HTTP request (until its last body byte was sent), by route template and method",
            ["route", "method"],
            registry=self.registry,
        )
        self.ingest_points = Counter(
            "spillway_ingest_data_points",
            "OTLP data points received from agents: accepted, or rejected through partial_success",
            ["result"],
            registry=self.registry,
        )
        for result in ("accepted", "rejected"):
            self.ingest_points.labels(result)  # both series exist from the start, at 0
        self.loop_cycles = Histogram(
            "spillway_control_loop_cycle_seconds",
            "time one control-loop cycle took (rules, SLOs, policies written), in the replica that leads",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
            registry=self.registry,
        )
        self.loop_last_cycle = Gauge(
            "spillway_control_loop_last_cycle_seconds", "the last control-loop cycle's duration (leader only)",
            registry=self.registry,
        )  # fmt: skip
        self.loop_leader = Gauge(
            "spillway_control_loop_leader", "1 while this process runs the control loop (holds the leadership)",
            registry=self.registry,
        )  # fmt: skip
        Info("spillway_controlplane", "the control plane's version", registry=self.registry).info(
            {"version": __version__}
        )
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(AgentStatusCollector(sessions, stale_after_s))
        self.gateway = GatewayMetrics(self.registry)
        self.ingest = IngestCollector()
        self.registry.register(self.ingest)

    def watch_ingest(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Read the receiver's statistics (`Ingestor.stats`) at each scrape."""
        self.ingest.stats = stats

    def observe_http(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "other"
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route, method).observe(seconds)

    def cycled(self, seconds: float) -> None:
        self.loop_cycles.observe(seconds)
        self.loop_last_cycle.set(seconds)

    def ingested(self, accepted: int, rejected: int) -> None:
        self.ingest_points.labels("accepted").inc(accepted)
        self.ingest_points.labels("rejected").inc(rejected)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetrics:
    """ASGI middleware, outermost, so that it also counts what the body limit and authentication refuse."""

    def __init__(self, app: ASGIApp, metrics: ControlPlaneMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before it answers, the server answers 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None)  # set by the router once it has matched
            self.metrics.observe_http(route or UNROUTED, scope["method"], status, time.perf_counter() - started)


__all__ = [
    "CONTENT_TYPE",
    "UNROUTED",
    "AgentStatusCollector",
    "ControlPlaneMetrics",
    "GatewayMetrics",
    "GatewayTenantCollector",
    "HttpMetrics",
    "IngestCollector",
]
