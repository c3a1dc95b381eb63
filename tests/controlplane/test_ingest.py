"""The OTLP/HTTP receiver: the real OpenTelemetry exporter in, minute rollups out; every refusal has its status."""

from __future__ import annotations

import gzip
import time

import httpx
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from sqlalchemy import select

from controlplane.app import create_app
from controlplane.settings import Settings
from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from spillway.contract import names
from tests.conftest import Plane, telemetry_for
from tests.utils.builders import make_agent


def test_the_real_exporter_lands_in_minute_rollups_without_double_counting(plane: Plane) -> None:
    telemetry = telemetry_for(plane)
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    for total_s in (0.005, 0.006, 0.050, 0.500):
        stats.request(1, "local", 0.001, 0.002, total_s)
    stats.outcome(3, "rejected")
    assert telemetry.provider.force_flush(10_000)
    assert telemetry.provider.force_flush(10_000)  # the same cumulative values again: nothing new
    stats.request(1, "local", 0.001, 0.002, 0.007)
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()

    requests = {(r.attributes[names.ATTR_PRIORITY], r.attributes[names.ATTR_OUTCOME]): r.total
                for r in plane.rollups("spillway.requests")}  # fmt: skip
    assert requests == {(1, "local"): 5.0, (3, "rejected"): 1.0}
    durations = [r for r in plane.rollups("spillway.request.duration") if r.attributes[names.ATTR_PRIORITY] == 1]
    assert sum(r.count for r in durations) == 5
    buckets = [sum(col) for col in zip(*(r.buckets for r in durations), strict=True)]
    assert buckets == [3, 1, 1]  # <=10 ms, <=100 ms, above
    assert durations[0].bounds == [0.01, 0.1]
    agents = httpx.get(f"{plane.url}/api/v1/status", headers={"Authorization": f"Bearer {plane.admin}"}).json()
    assert agents["agents"]["healthy"] == 1  # the agent reported: it has been seen


def _export_body(plane: Plane) -> bytes:
    """A protobuf export as the SDK makes it, captured from the real exporter's encoder."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    settings = TelemetrySettings(agent_id=plane.agent_id)
    telemetry = AgentTelemetry(settings, readers=[reader], probes=False)
    ModelStats(listener=telemetry.recorder("mlp", 2)).request(2, "local", 0.001, 0.002, 0.004)
    data = reader.get_metrics_data()
    assert data is not None
    return bytes(encode_metrics(data).SerializeToString())


def test_json_and_gzip_are_accepted(plane: Plane) -> None:
    body = _export_body(plane)
    message = ExportMetricsServiceRequest()
    message.ParseFromString(body)
    auth = {"Authorization": f"Bearer {plane.token}"}
    as_json = json_format.MessageToJson(message).encode()
    r = httpx.post(f"{plane.url}/v1/metrics", content=as_json, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    r = httpx.post(f"{plane.url}/v1/metrics", content=gzip.compress(body),
                   headers={**auth, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})  # fmt: skip
    assert r.status_code == 200, r.text
    reply = ExportMetricsServiceResponse()
    reply.ParseFromString(r.content)
    assert reply.partial_success.rejected_data_points == 0


def test_refusals_have_the_right_status_and_never_a_5xx(plane: Plane) -> None:
    body = _export_body(plane)
    auth = {"Authorization": f"Bearer {plane.token}", "Content-Type": "application/x-protobuf"}
    url = f"{plane.url}/v1/metrics"
    assert httpx.post(url, content=b"\xff\x00garbage", headers=auth).status_code == 400
    assert (
        httpx.post(url, content=b"{not json", headers={**auth, "Content-Type": "application/json"}).status_code == 400
    )
    assert httpx.post(url, content=body, headers={**auth, "Content-Type": "text/plain"}).status_code == 415
    assert httpx.post(url, content=b"notgzip", headers={**auth, "Content-Encoding": "gzip"}).status_code == 400
    assert httpx.post(url, content=b"x" * (17 << 20), headers=auth).status_code == 413
    bomb = gzip.compress(b"\0" * (20 << 20))
    assert httpx.post(url, content=bomb, headers={**auth, "Content-Encoding": "gzip"}).status_code == 400
    assert httpx.post(url, content=body, headers={"Content-Type": "application/x-protobuf"}).status_code == 401
    operator = {"Authorization": f"Bearer {plane.admin}", "Content-Type": "application/x-protobuf"}
    assert httpx.post(url, content=body, headers=operator).status_code == 403
    # Another agent's token cannot write this agent's metrics.
    other = httpx.post(f"{plane.url}/api/v1/agents", json=make_agent(),
                       headers={"Authorization": f"Bearer {plane.admin}"}).json()["token"]  # fmt: skip
    forged = httpx.post(url, content=body, headers={**auth, "Authorization": f"Bearer {other}"})
    assert forged.status_code == 403 and "service.instance.id" in forged.json()["message"]


def test_unsupported_types_and_cardinality_are_reported_as_partial_success(plane: Plane) -> None:
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    attribute = resource.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.instance.id", plane.agent_id
    scope = resource.scope_metrics.add()
    summary = scope.metrics.add()
    summary.name = "legacy.summary"
    summary.summary.data_points.add().count = 3
    gauge = scope.metrics.add()
    gauge.name = "queue"
    for i in range(45):  # the plane allows 40 series per agent
        point = gauge.gauge.data_points.add()
        point.time_unix_nano = 1_700_000_000_000_000_000
        point.as_int = i
        kv = point.attributes.add()
        kv.key, kv.value.int_value = names.ATTR_PRIORITY, i
    headers = {"Authorization": f"Bearer {plane.token}", "Content-Type": "application/x-protobuf"}
    r = httpx.post(f"{plane.url}/v1/metrics", content=message.SerializeToString(), headers=headers)
    assert r.status_code == 200
    reply = ExportMetricsServiceResponse()
    reply.ParseFromString(r.content)
    assert reply.partial_success.rejected_data_points == 1 + 5
    assert "summary" in reply.partial_success.error_message
    assert "cardinality" in reply.partial_success.error_message
    assert len(plane.rollups("queue")) == 40


def test_malformed_points_are_refused_one_by_one_and_the_rest_is_stored(plane: Plane) -> None:
    """A NaN gauge, an infinite sum, a histogram whose counts do not fit its bounds: each is refused through
    partial_success (no database stores them faithfully; SQLite would fail the whole export), the rest lands."""
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    attribute = resource.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.instance.id", plane.agent_id
    scope = resource.scope_metrics.add()
    now = time.time_ns()
    gauge = scope.metrics.add()
    gauge.name = "temperature"
    for value in (float("nan"), 71.5):
        point = gauge.gauge.data_points.add()
        point.time_unix_nano, point.as_double = now, value
        kv = point.attributes.add()
        kv.key, kv.value.string_value = "sensor", "nan" if value != value else "ok"
    total = scope.metrics.add()
    total.name = "spillway.requests"
    total.sum.aggregation_temporality = 1  # delta
    infinite = total.sum.data_points.add()
    infinite.time_unix_nano, infinite.as_double = now, float("inf")
    histogram = scope.metrics.add()
    histogram.name = "spillway.request.duration"
    histogram.histogram.aggregation_temporality = 1
    broken = histogram.histogram.data_points.add()
    broken.time_unix_nano, broken.count, broken.sum = now, 3, 0.3
    broken.explicit_bounds.extend([0.01, 0.1])
    broken.bucket_counts.extend([1, 2])  # two counts for two bounds: the +Inf bucket is missing
    headers = {"Authorization": f"Bearer {plane.token}", "Content-Type": "application/x-protobuf"}
    r = httpx.post(f"{plane.url}/v1/metrics", content=message.SerializeToString(), headers=headers)
    assert r.status_code == 200, r.text
    reply = ExportMetricsServiceResponse()
    reply.ParseFromString(r.content)
    assert reply.partial_success.rejected_data_points == 3
    for reason in ("non-finite value", "2 bucket counts for 2 explicit bounds"):
        assert reason in reply.partial_success.error_message
    assert [r.last for r in plane.rollups("temperature")] == [71.5]


def test_rollups_past_the_retention_are_deleted(sqlite_url: str) -> None:
    from datetime import timedelta

    from fastapi.testclient import TestClient

    from controlplane.app import prune_once
    from controlplane.db import MetricRollup, make_engine, make_sessionmaker, transaction, utcnow

    settings = Settings(database_url=sqlite_url, retention_days=35)
    app = create_app(settings)
    with TestClient(app):
        deadline = time.monotonic() + 30
        while app.state.retention_passes < 1 and time.monotonic() < deadline:  # the pass at start has run
            time.sleep(0.01)
        engine = make_engine(sqlite_url)
        with transaction(make_sessionmaker(engine)) as session:
            for age_days in (40, 36, 34, 0):
                session.add(MetricRollup(agent_id="a", metric="m", series=f"s{age_days}", attributes={},
                                         minute=utcnow() - timedelta(days=age_days), kind="sum"))  # fmt: skip
        assert prune_once(app, settings) == 2
        with make_sessionmaker(engine)() as session:
            kept = sorted(r.series for r in session.scalars(select(MetricRollup)))
        engine.dispose()
    assert kept == ["s0", "s34"]


def test_overload_answers_503_with_retry_after(plane: Plane) -> None:
    """With every ingest slot taken, an export is turned away at once (the SDK exporter retries it later)."""
    import asyncio

    from controlplane.errors import Overloaded

    body = _export_body(plane)
    headers = {"Authorization": f"Bearer {plane.token}", "Content-Type": "application/x-protobuf"}
    # The fixture's app runs in another thread; take its slots through its own event loop.
    app = plane.app
    slots: asyncio.Semaphore = app.state.ingest_slots
    taken = 0
    while not slots.locked():
        slots._value -= 1
        taken += 1
    try:
        # 30 s, not httpx's 5 s: a busy CI machine once took longer to answer; what is checked is the answer.
        r = httpx.post(f"{plane.url}/v1/metrics", content=body, headers=headers, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == Overloaded.code
    finally:
        slots._value += taken
    assert httpx.post(f"{plane.url}/v1/metrics", content=body, headers=headers, timeout=30).status_code == 200
