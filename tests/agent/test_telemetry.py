"""The agent's OpenTelemetry metrics: instruments and buckets in memory, and the real OTLP/HTTP exporter
(in process and from a separately started agent) into a real HTTP server on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from tests.agent.conftest import start_agent, stop_agent
from tests.utils.server import free_port


class Capture:
    """A real OTLP/HTTP endpoint that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], ExportMetricsServiceRequest]] = []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportMetricsServiceRequest()
                message.ParseFromString(body)
                capture.requests.append(({k.lower(): v for k, v in self.headers.items()}, message))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def metrics(self) -> dict[str, list]:
        found: dict[str, list] = {}
        for _, message in self.requests:
            for resource_metrics in message.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        found.setdefault(metric.name, []).append(metric)
        return found


@pytest.fixture
def capture() -> Iterator[Capture]:
    endpoint = Capture()
    yield endpoint
    endpoint.server.shutdown()


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_instruments_attributes_and_buckets() -> None:
    reader = InMemoryMetricReader()
    settings = TelemetrySettings(agent_id="jetson-7", device_class="jetson", labels={"site": "berlin"},
                                 latency_buckets_ms=(5.0, 50.0, 500.0))  # fmt: skip
    telemetry = AgentTelemetry(settings, readers=[reader], probes=False)
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    stats.request(1, "local", 0.001, 0.003, 0.006)
    stats.request(1, "local", 0.002, 0.004, 0.070)
    stats.outcome(3, "rejected")
    stats.batch(2, 0.004, ok=True)
    telemetry.watch_queue(lambda: [({"model": "mlp", "model.version": "1", "priority": 3}, 7)])

    points = _points(reader)
    counts = {(p.attributes["priority"], p.attributes["outcome"]): p.value for p in points["spillway.requests"]}
    assert counts == {(1, "local"): 2, (3, "rejected"): 1}
    (duration,) = points["spillway.request.duration"]
    assert list(duration.explicit_bounds) == [0.005, 0.05, 0.5]  # configured ms, exported in seconds
    assert list(duration.bucket_counts) == [0, 1, 1, 0]
    assert duration.attributes == {"model": "mlp", "model.version": "1", "priority": 1, "outcome": "local"}
    assert points["spillway.batch.size"][0].sum == 2
    assert points["spillway.queue.depth"][0].value == 7
    resource = reader.get_metrics_data().resource_metrics[0].resource.attributes  # type: ignore[union-attr]
    assert resource["service.name"] == "spillway-edge-agent"
    assert resource["service.instance.id"] == "jetson-7"
    assert resource["spillway.device.class"] == "jetson" and resource["spillway.label.site"] == "berlin"
    assert resource["host.name"]
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


def test_the_real_exporter_sends_protobuf_with_the_agent_token(capture: Capture) -> None:
    settings = TelemetrySettings(agent_id="a1", control_plane=capture.url, agent_token="spa_x_secret",
                                 export_interval_s=60)  # fmt: skip
    telemetry = AgentTelemetry(settings)
    ModelStats(listener=telemetry.recorder("mlp", 2)).request(2, "local", 0.001, 0.002, 0.004)
    assert telemetry.provider.force_flush(timeout_millis=10_000)
    headers, message = capture.requests[-1]
    assert headers["authorization"] == "Bearer spa_x_secret"
    assert headers["content-type"] == "application/x-protobuf"
    resource = {a.key: a.value.string_value for a in message.resource_metrics[0].resource.attributes}
    assert resource["service.instance.id"] == "a1"
    names = set(capture.metrics())
    assert {"spillway.requests", "spillway.request.duration", "system.memory.usage"} <= names
    telemetry.shutdown()


def test_an_unreachable_control_plane_costs_serving_nothing() -> None:
    settings = TelemetrySettings(agent_id="a2", control_plane=f"http://127.0.0.1:{free_port()}",
                                 agent_token="t", export_interval_s=60, export_timeout_s=1)  # fmt: skip
    telemetry = AgentTelemetry(settings)
    recorder = telemetry.recorder("mlp", 1)
    started = time.monotonic()
    for _ in range(1000):
        recorder.outcome(1, "local")
    assert time.monotonic() - started < 1.0  # recording never waits on the network
    started = time.monotonic()
    telemetry.provider.force_flush(timeout_millis=2000)
    telemetry.shutdown(timeout_s=2)
    assert time.monotonic() - started < 10  # bounded, and no exception


def test_a_separately_started_agent_exports_its_requests(demo_repo: Path, tmp_path: Path, capture: Capture) -> None:
    agent = start_agent(demo_repo, tmp_path, control_plane=capture.url, agent_token="spa_agent_token",
                        agent_id="edge-9", export_interval_s=0.5)  # fmt: skip
    try:
        body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.1] * 512}],
                "parameters": {"priority": 1}}  # fmt: skip
        for _ in range(3):
            assert httpx.post(f"{agent.url}/v2/models/mlp/versions/2/infer", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 30
        local = 0
        while time.monotonic() < deadline and local < 3:
            for metric in capture.metrics().get("spillway.requests", []):
                for point in metric.sum.data_points:
                    attributes = {a.key: a.value for a in point.attributes}
                    if attributes["outcome"].string_value == "local" and attributes["priority"].int_value == 1:
                        local = max(local, point.as_int)
            time.sleep(0.1)
        assert local == 3
        headers, message = capture.requests[-1]
        assert headers["authorization"] == "Bearer spa_agent_token"
        resource = {a.key: a.value.string_value for a in message.resource_metrics[0].resource.attributes}
        assert resource["service.instance.id"] == "edge-9"
    finally:
        stop_agent(agent)
