"""Tenants in the control plane's telemetry: the agent's real OTLP exporter sends request metrics with
`spillway.tenant` (and points without it, as agents from before tenants do) through the real receiver; the agent
metrics answer per tenant and filtered to one, SLOs with a tenant selector count that tenant only, and the receiver
bounds the tenants it keeps per agent."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sqlalchemy import select

from controlplane.app import create_app
from controlplane.db import MetricRollup
from controlplane.ingest.receiver import Ingestor
from controlplane.query import tenant_of
from controlplane.settings import Settings
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from spillway.contract.names import (
    ATTR_GENAI_MODEL,
    ATTR_GENAI_OPERATION,
    ATTR_MODEL,
    ATTR_OUTCOME,
    ATTR_PRIORITY,
    ATTR_TENANT,
    ATTR_VERSION,
    REQUESTS,
)
from tests.conftest import Plane, make_keys, telemetry_for
from tests.utils.builders import make_agent, make_slo
from tests.utils.server import serving


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    """SQLite only: what is tested here is the tenant, not the database (test_ingest runs both)."""
    return sqlite_url


@dataclass
class Exported:
    plane: Plane
    slos: dict[str, str]  # name -> id


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """One control plane on SQLite for the module: SLOs made (`_create_slos`), then the agent's export (`_export`)
    through the real exporter and receiver."""
    url = f"sqlite:///{tmp_path_factory.mktemp('tenants') / 'spillway.db'}"
    admin = make_keys(url)["admin"]
    app = create_app(Settings(database_url=url, control_loop_interval_s=0))
    with serving(app) as base:
        created = httpx.post(f"{base}/api/v1/agents", json=make_agent(), headers={"Authorization": f"Bearer {admin}"})
        body = created.json()
        plane = Plane(base, url, admin, body["agent"]["id"], body["token"], app)
        slos = _create_slos(plane)
        _export(plane)
        yield Exported(plane, slos)


def _record(telemetry: AgentTelemetry, tenant: str | None, outcome: str, seconds: float | None = None) -> None:
    """One request of `mlp` at priority 1, as an agent records it; `tenant` None: an agent from before tenants."""
    attributes: dict[str, Any] = {ATTR_MODEL: "mlp", ATTR_VERSION: "1", ATTR_PRIORITY: 1, ATTR_OUTCOME: outcome}
    if tenant is not None:
        attributes[ATTR_TENANT] = tenant
    telemetry.requests.add(1, attributes)
    if seconds is not None:
        telemetry.request_duration.record(seconds, attributes)


def _export(plane: Plane) -> None:
    """alpha: 6 served within 10 ms and 2 refused (its quota); beta: 2 served in 50 ms; 2 served within 10 ms
    without a tenant. And one generative stream of alpha's (time to first token 50 ms)."""
    telemetry = telemetry_for(plane)  # latency buckets at 10 ms and 100 ms
    for _ in range(6):
        _record(telemetry, "alpha", "local", 0.005)
    for _ in range(2):
        _record(telemetry, "alpha", "rejected")
        _record(telemetry, "beta", "local", 0.050)
        _record(telemetry, None, "local", 0.005)
    genai = {ATTR_GENAI_MODEL: "tiny-lm", ATTR_GENAI_OPERATION: "chat", ATTR_TENANT: "alpha"}
    telemetry.ttft.record(0.05, genai)
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()


def _metrics(plane: Plane, **params: str) -> httpx.Response:
    return httpx.get(f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics", params={"window": "5m", **params},
                     headers={"Authorization": f"Bearer {plane.admin}"})  # fmt: skip


def test_agent_metrics_by_tenant_and_filtered_to_one(exported: Exported) -> None:
    plane = exported.plane
    whole = _metrics(plane)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    # What existing clients read is unchanged: every tenant's requests.
    assert body["tenant"] is None
    assert body["requests"] == 12 and body["outcomes"] == {"local": 10, "rejected": 2}
    assert [(t["model"], t["requests"]) for t in body["traffic"]] == [("mlp", 12)]
    by = {t["tenant"]: t for t in body["by_tenant"]}
    assert list(by) == ["alpha", "beta", "default"]  # points without a tenant are the default tenant's
    assert (by["alpha"]["requests"], by["alpha"]["outcomes"]) == (8, {"local": 6, "rejected": 2})
    assert (by["alpha"]["served"], by["alpha"]["rejected"]) == (6, 2)
    assert by["alpha"]["share"] == pytest.approx(0.6)
    assert by["beta"]["share"] == pytest.approx(0.2) and by["default"]["share"] == pytest.approx(0.2)
    assert by["default"]["outcomes"] == {"local": 2}
    # Percentiles inside the bucket of the true value: alpha's all within 10 ms, beta's in (10, 100] ms.
    assert by["alpha"]["latency_ms"]["count"] == 6
    assert by["alpha"]["latency_ms"]["p50"] == pytest.approx(5.0)  # rank 3 of 6 in (0, 10]
    assert by["alpha"]["latency_ms"]["p99"] <= 10.0
    assert 10.0 < by["beta"]["latency_ms"]["p50"] <= 100.0 and 10.0 < by["beta"]["latency_ms"]["p99"] <= 100.0
    assert by["alpha"]["ttft_ms"]["count"] == 1 and by["beta"]["ttft_ms"]["count"] == 0
    seconds = (datetime.fromisoformat(body["until"]) - datetime.fromisoformat(body["since"])).total_seconds()
    assert by["alpha"]["rps"] == pytest.approx(8 / seconds)

    alpha = _metrics(plane, tenant="alpha").json()
    assert alpha["tenant"] == "alpha"
    assert alpha["requests"] == 8 and alpha["outcomes"] == {"local": 6, "rejected": 2}
    (traffic,) = alpha["traffic"]
    assert traffic["requests"] == 8 and traffic["latency_ms"]["count"] == 6
    assert [t["tenant"] for t in alpha["by_tenant"]] == ["alpha"]
    assert alpha["by_tenant"][0]["share"] == pytest.approx(0.6)  # still of every tenant's served requests
    assert [g["model"] for g in alpha["generation"]] == ["tiny-lm"]

    default = _metrics(plane, tenant="default").json()
    assert default["requests"] == 2 and default["traffic"][0]["latency_ms"]["count"] == 2
    assert default["generation"] == []  # alpha's stream is not the default tenant's
    nobody = _metrics(plane, tenant="nobody").json()
    assert (nobody["requests"], nobody["traffic"], nobody["by_tenant"]) == (0, [], [])

    for bad in ("Alpha", "no spaces", "-x", "x" * 64, ""):
        refused = _metrics(plane, tenant=bad)
        assert refused.status_code == 422, (bad, refused.text)
        assert "tenant" in refused.text


def _create_slo(plane: Plane, tenant: str | None, **over: Any) -> str:
    selector: dict[str, Any] = {"labels": {"site": "berlin"}, "model": "mlp"}
    if tenant is not None:
        selector["tenant"] = tenant
    body = make_slo(selector=selector, objective=90, window="1d", alert_windows=[], **over)
    created = httpx.post(f"{plane.url}/api/v1/slos", headers={"Authorization": f"Bearer {plane.admin}"}, json=body)
    assert created.status_code == 201, created.text
    assert created.json()["selector"]["tenant"] == tenant
    return str(created.json()["id"])


def _create_slos(plane: Plane) -> dict[str, str]:
    availability = {"sli_kind": "availability", "threshold_ms": None}
    return {
        "alpha-up": _create_slo(plane, "alpha", **availability),
        "beta-fast": _create_slo(plane, "beta", threshold_ms=10),
        "default-up": _create_slo(plane, "default", **availability),
        "all-up": _create_slo(plane, None, **availability),
        "all-fast": _create_slo(plane, None, threshold_ms=10),
    }


def test_slo_with_a_tenant_selector_counts_only_that_tenant(exported: Exported) -> None:
    plane, slos = exported.plane, exported.slos
    admin = {"Authorization": f"Bearer {plane.admin}"}
    counts = {}
    for name, ident in slos.items():
        status = httpx.get(f"{plane.url}/api/v1/slos/{ident}/status", headers=admin)
        assert status.status_code == 200, status.text
        counts[name] = (status.json()["good"], status.json()["total"])
    assert counts == {
        "alpha-up": (6, 8),  # its quota refusals are bad events of its own
        "beta-fast": (0, 2),  # beta's 50 ms requests miss 10 ms
        "default-up": (2, 2),  # the points without a tenant
        "all-up": (10, 12),
        "all-fast": (8, 10),
    }
    for bad, words in (("Not A Name", "should match pattern"), ("", "at least 1"), ("x" * 64, "at most 63"),
                       (7, "valid string")):  # fmt: skip
        refused = httpx.post(f"{plane.url}/api/v1/slos", headers=admin,
                             json=make_slo(selector={"labels": {"site": "berlin"}, "tenant": bad}))  # fmt: skip
        assert refused.status_code == 422, (bad, refused.text)
        details = refused.json()["details"]
        assert any(d["field"] == "body.selector.tenant" and words in d["message"] for d in details), details


def _export_message(agent_id: str, adds: dict[Any, int], telemetry: AgentTelemetry | None = None,
                    reader: InMemoryMetricReader | None = None) -> tuple[ExportMetricsServiceRequest, AgentTelemetry,
                                                                         InMemoryMetricReader]:  # fmt: skip
    """A cumulative export of `spillway.requests` after adding `adds` (tenant -> requests), as the SDK encodes it."""
    if telemetry is None or reader is None:
        reader = InMemoryMetricReader()
        telemetry = AgentTelemetry(TelemetrySettings(agent_id=agent_id), readers=[reader], probes=False)
    for tenant, n in adds.items():
        telemetry.requests.add(n, {ATTR_MODEL: "mlp", ATTR_PRIORITY: 1, ATTR_OUTCOME: "local", ATTR_TENANT: tenant})
    data = reader.get_metrics_data()
    assert data is not None
    message = ExportMetricsServiceRequest()
    message.ParseFromString(encode_metrics(data).SerializeToString())
    return message, telemetry, reader


def test_the_receiver_caps_the_tenants_it_keeps_per_agent(factory: Any) -> None:
    """Beyond the cap, and for what is not a tenant name, a point is stored as tenant `other`; each original stream
    keeps its own cumulative deltas, so the `other` rows add up exactly, export after export."""
    ingestor = Ingestor(factory, max_tenants_per_agent=2)
    adds = {"t1": 1, "t2": 2, "t3": 3, "t4": 4, "Not A Name": 5, "default": 6}
    message, telemetry, reader = _export_message("edge-1", adds)
    result = ingestor.ingest("edge-1", message)
    assert (result.accepted, result.rejected) == (6, 0)
    message, _, _ = _export_message("edge-1", {"t3": 10, "t4": 20, "t1": 100}, telemetry, reader)
    ingestor.ingest("edge-1", message)
    message, _, _ = _export_message("edge-1", {}, telemetry, reader)  # the same cumulative values: nothing new
    ingestor.ingest("edge-1", message)
    # Another agent has a cap of its own.
    other, _, _ = _export_message("edge-2", {"t3": 7})
    ingestor.ingest("edge-2", other)
    telemetry.shutdown()

    totals: dict[tuple[str, str], float] = defaultdict(float)
    with factory() as session:
        for row in session.scalars(select(MetricRollup).where(MetricRollup.metric == REQUESTS)):
            totals[(row.agent_id, tenant_of(row.attributes))] += row.total
    assert dict(totals) == {
        ("edge-1", "t1"): 101, ("edge-1", "t2"): 2, ("edge-1", "default"): 6,
        ("edge-1", "other"): 3 + 4 + 5 + 10 + 20,  # t3, t4 beyond the cap; a name that is no tenant name
        ("edge-2", "t3"): 7,
    }  # fmt: skip


def test_tenant_of_reads_points_without_a_tenant_as_the_default_tenant() -> None:
    assert tenant_of({ATTR_MODEL: "mlp"}) == "default"
    assert tenant_of({ATTR_TENANT: "alpha"}) == "alpha"
