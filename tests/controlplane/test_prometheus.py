"""The control plane's own `/metrics`: Prometheus' text format for a viewer key, with HTTP requests per route
template, OTLP data points ingested, agents by status and the process; every app has its own registry."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.app import create_app
from controlplane.settings import Settings
from edge_agent.scheduling.stats import ModelStats
from tests.conftest import Api, Plane, telemetry_for
from tests.utils.builders import make_agent

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels; fails on anything that is not the text format."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(client: httpx.Client | TestClient, key: str, base: str = "") -> Samples:
    response = client.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(response.text)


def test_scraping_needs_a_viewer_key(sqlite_api: Api) -> None:
    client = sqlite_api.client
    missing = client.get("/metrics")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"] == "unauthenticated"
    assert client.get("/metrics", headers={"Authorization": "Bearer spk_0000000000000000_wrong"}).status_code == 401
    token = sqlite_api.call("POST", "/api/v1/agents", json=make_agent()).json()["token"]
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 403
    for role in ("viewer", "editor", "admin"):
        assert client.get("/metrics", headers=sqlite_api.headers(role)).status_code == 200


def test_http_requests_are_counted_by_route_template_method_and_status(sqlite_api: Api) -> None:
    key = sqlite_api.keys["viewer"]
    before = scrape(sqlite_api.client, key)
    for _ in range(3):
        assert sqlite_api.call("GET", "/api/v1/slos", role="viewer").status_code == 200
    assert sqlite_api.call("GET", "/api/v1/slos/0000000000000000", role="viewer").status_code == 404
    assert sqlite_api.call("POST", "/api/v1/slos", role="viewer", json={}).status_code == 403
    assert sqlite_api.client.get("/api/v1/slos").status_code == 401  # refused before routing
    assert sqlite_api.call("GET", "/api/v1/no-such-thing/0000000000000000", role="viewer").status_code == 404
    after = scrape(sqlite_api.client, key)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    total = "spillway_http_requests_total"
    assert moved(total, route="/api/v1/slos", method="GET", status="200") == 3
    assert moved(total, route="/api/v1/slos/{item_id}", method="GET", status="404") == 1
    assert moved(total, route="/api/v1/slos", method="POST", status="403") == 1
    assert moved(total, route="(unrouted)", method="GET", status="401") == 1
    assert moved(total, route="(unrouted)", method="GET", status="404") == 1
    assert moved(total, route="/metrics", method="GET", status="200") == 1  # the first scrape itself
    # No raw path ever becomes a label: ids and unknown paths would make the series grow without bound.
    assert not any("0000000000000000" in v or "no-such-thing" in v for _, labels in after for _, v in labels)
    duration = "spillway_http_request_duration_seconds"
    assert moved(f"{duration}_count", route="/api/v1/slos", method="GET") == 3
    assert moved(f"{duration}_sum", route="/api/v1/slos", method="GET") > 0
    assert moved(f"{duration}_bucket", route="/api/v1/slos", method="GET", le="+Inf") == 3


def test_process_and_version_are_exposed(sqlite_api: Api) -> None:
    samples = scrape(sqlite_api.client, sqlite_api.keys["viewer"])
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"} <= names
    assert "python_info" in names
    from controlplane import __version__

    assert value(samples, "spillway_controlplane_info", version=__version__) == 1


def test_each_app_counts_only_its_own_requests(sqlite_api: Api) -> None:
    for _ in range(2):
        sqlite_api.call("GET", "/api/v1/rules", role="viewer")
    other = create_app(Settings(database_url=sqlite_api.url))  # a second app in this process: its own registry
    with TestClient(other) as client:
        samples = scrape(client, sqlite_api.keys["viewer"])
    mine = scrape(sqlite_api.client, sqlite_api.keys["viewer"])
    labels = {"route": "/api/v1/rules", "method": "GET", "status": "200"}
    assert value(samples, "spillway_http_requests_total", **labels) == 0
    assert value(mine, "spillway_http_requests_total", **labels) == 2


def _unsupported(agent_id: str) -> bytes:
    """An export the receiver refuses part of: one summary data point (an unsupported type)."""
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    attribute = resource.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.instance.id", agent_id
    summary = resource.scope_metrics.add().metrics.add()
    summary.name = "legacy.summary"
    summary.summary.data_points.add().count = 3
    return message.SerializeToString()


def test_ingested_data_points_and_agents_by_status(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    with httpx.Client(base_url=plane.url) as client:
        for _ in range(2):
            assert client.post("/api/v1/agents", json=make_agent(), headers=admin).status_code == 201
        before = scrape(client, plane.admin)
        assert value(before, "spillway_agents", status="never_seen") == 3
        assert value(before, "spillway_agents", status="healthy") == 0
        assert value(before, "spillway_ingest_data_points_total", result="accepted") == 0

        telemetry = telemetry_for(plane)
        stats = ModelStats(listener=telemetry.recorder("mlp", 1))
        stats.request(1, "local", 0.001, 0.002, 0.005)
        stats.outcome(2, "rejected")
        telemetry.shutdown()  # exports once, then stops
        refused = client.post("/v1/metrics", content=_unsupported(plane.agent_id),
                              headers={"Authorization": f"Bearer {plane.token}",
                                       "Content-Type": "application/x-protobuf"})  # fmt: skip
        assert refused.status_code == 200
        after = scrape(client, plane.admin)

    # One export: a request count per outcome (2), and request, queue and compute durations of the served one (3);
    # the queue-depth gauge had no source.
    assert value(after, "spillway_ingest_data_points_total", result="accepted") == 5
    assert value(after, "spillway_ingest_data_points_total", result="rejected") == 1
    assert value(after, "spillway_agents", status="healthy") == 1
    assert value(after, "spillway_agents", status="never_seen") == 2
    assert value(after, "spillway_agents", status="stale") == 0


def test_agents_not_seen_lately_are_stale(sqlite_url: str) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from controlplane.db import Agent, make_engine, make_sessionmaker, transaction, utcnow
    from tests.conftest import make_keys

    keys = make_keys(sqlite_url)
    app = create_app(Settings(database_url=sqlite_url, stale_after_s=30))
    with TestClient(app) as client:
        headers = {"Authorization": f"Bearer {keys['admin']}"}
        ids = [client.post("/api/v1/agents", json=make_agent(), headers=headers).json()["agent"]["id"]
               for _ in range(3)]  # fmt: skip
        engine = make_engine(sqlite_url)
        with transaction(make_sessionmaker(engine)) as session:
            session.execute(update(Agent).where(Agent.id == ids[0]).values(last_seen=utcnow() - timedelta(seconds=5)))
            session.execute(update(Agent).where(Agent.id == ids[1]).values(last_seen=utcnow() - timedelta(minutes=5)))
        engine.dispose()
        samples = scrape(client, keys["viewer"])
    assert [value(samples, "spillway_agents", status=s) for s in ("healthy", "stale", "never_seen")] == [1, 1, 1]


def test_control_loop_cycles_and_leadership_are_exposed(sqlite_url: str) -> None:
    """The leader's cycles are counted with their duration; the leadership gauge says which process runs them."""
    import time

    from tests.conftest import open_api

    for api in open_api(sqlite_url, control_loop_interval_s=0.2):
        key = api.keys["viewer"]
        deadline = time.monotonic() + 30
        samples = scrape(api.client, key)
        while value(samples, "spillway_control_loop_cycle_seconds_count") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            samples = scrape(api.client, key)
        assert value(samples, "spillway_control_loop_cycle_seconds_count") >= 2
        assert value(samples, "spillway_control_loop_leader") == 1  # SQLite: one process, always the leader
        assert value(samples, "spillway_control_loop_last_cycle_seconds") > 0
        assert value(samples, "spillway_control_loop_cycle_seconds_sum") >= value(
            samples, "spillway_control_loop_last_cycle_seconds"
        )
