"""The agent's OpenTelemetry metrics: instruments, attribute names, units and buckets in memory, the Prometheus text
they also give in process, and the real OTLP/HTTP exporter (in process and from a separately started agent) into a
real HTTP server on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, OtlpDestination, TelemetrySettings
from edge_agent.telemetry.probes import CpuUtilisation
from spillway.contract import names
from tests.agent.conftest import start_agent, stop_agent
from tests.utils.server import free_port


class Received:
    """What an OTLP endpoint was sent: (headers or gRPC metadata, lower-cased; the export) in arrival order."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], ExportMetricsServiceRequest]] = []

    def resource(self) -> dict[str, str]:
        """The string attributes of the resource of the latest export."""
        return {a.key: a.value.string_value for a in self.requests[-1][1].resource_metrics[0].resource.attributes}

    def metrics(self) -> dict[str, list]:
        """Every metric of every export, by name."""
        found: dict[str, list] = {}
        for _, message in self.requests:
            for resource_metrics in message.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        found.setdefault(metric.name, []).append(metric)
        return found

    def requests_counted(self, outcome: str, priority: int) -> int:
        """The latest cumulative `spillway.requests` count of (outcome, priority) it was sent (0: none yet)."""
        count = 0
        for metric in self.metrics().get(names.REQUESTS, []):
            for point in metric.sum.data_points:
                attributes = {a.key: a.value for a in point.attributes}
                if (attributes[names.ATTR_OUTCOME].string_value, attributes[names.ATTR_PRIORITY].int_value) == (
                    outcome, priority,
                ):  # fmt: skip
                    count = max(count, point.as_int)
        return count

    def wait_for_requests(self, outcome: str, priority: int, count: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.requests_counted(outcome, priority) < count:
            assert time.monotonic() < deadline, f"{self.requests_counted(outcome, priority)} of {count} counted"
            time.sleep(0.05)


class Capture(Received):
    """A real OTLP/HTTP endpoint that keeps what it is sent, and the paths it was sent to."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportMetricsServiceRequest()
                message.ParseFromString(body)
                capture.paths.append(self.path)
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
    telemetry.watch_queue(lambda: [({names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: 3}, 7)])

    points = _points(reader)
    counts = {(p.attributes["spillway.priority"], p.attributes["spillway.outcome"]): p.value
              for p in points["spillway.requests"]}  # fmt: skip
    assert counts == {(1, "local"): 2, (3, "rejected"): 1}
    (duration,) = points["spillway.request.duration"]
    assert list(duration.explicit_bounds) == [0.005, 0.05, 0.5]  # configured ms, exported in seconds
    assert list(duration.bucket_counts) == [0, 1, 1, 0]
    assert duration.attributes == {"spillway.model": "mlp", "spillway.model.version": "1", "spillway.priority": 1,
                                   "spillway.outcome": "local", "spillway.tenant": "default"}  # fmt: skip
    assert points["spillway.batch.size"][0].sum == 2
    assert points["spillway.queue.depth"][0].value == 7
    resource = reader.get_metrics_data().resource_metrics[0].resource.attributes  # type: ignore[union-attr]
    assert resource["service.name"] == "spillway-edge-agent"
    assert resource["service.instance.id"] == "jetson-7"
    assert resource["spillway.device.class"] == "jetson" and resource["spillway.label.site"] == "berlin"
    assert resource["host.name"]
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


def test_the_policy_gauges_carry_a_namespaced_source_and_units_prometheus_reads_right() -> None:
    reader = InMemoryMetricReader()
    telemetry = AgentTelemetry(TelemetrySettings(agent_id="a"), readers=[reader])
    telemetry.watch_policy(lambda: (4, "control_plane"))
    telemetry.policy_refusals.add(1, {names.ATTR_POLICY_SOURCE: "cache"})
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    version = metrics[names.POLICY_VERSION]
    # A version is not a ratio: unit "1" would make it `spillway_policy_version_ratio` in Prometheus.
    assert version.unit == "{version}"
    assert [(p.value, dict(p.attributes)) for p in version.data.data_points] == [
        (4, {"spillway.policy.source": "control_plane"})
    ]
    assert [dict(p.attributes) for p in metrics[names.POLICY_REFUSALS].data.data_points] == [
        {"spillway.policy.source": "cache"}
    ]
    assert metrics["system.memory.usage"].unit == "By"
    telemetry.shutdown()


def _families(telemetry: AgentTelemetry) -> dict[str, Metric]:
    body, content_type = telemetry.metrics_text()
    assert content_type.startswith("text/plain; version=")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _samples(family: Metric) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels but the scope's) -> value."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_")))): s.value
            for s in family.samples}  # fmt: skip


def test_the_prometheus_text_has_every_instrument_of_the_otlp_stream_with_the_same_values() -> None:
    reader = InMemoryMetricReader()
    settings = TelemetrySettings(agent_id="edge-3", latency_buckets_ms=(5.0, 50.0))
    telemetry = AgentTelemetry(settings, readers=[reader])
    stats = ModelStats(listener=telemetry.recorder("mlp", 2))
    stats.request(1, "local", 0.001, 0.003, 0.006)
    stats.request(1, "local", 0.002, 0.004, 0.070)
    stats.outcome(3, "rejected")
    stats.batch(2, 0.004, ok=True)
    telemetry.watch_policy(lambda: (4, "control_plane"))
    generation = telemetry.generation("tiny-lm")
    generation.finished(1, "local", operation="chat", prompt_tokens=12, completion_tokens=8, ttft_s=0.05,
                        duration_s=0.4)  # fmt: skip
    generation.step(12)
    engine = {"kv_blocks": {"used": 3, "total": 64}, "preemptions": 1, "active": 2}
    telemetry.watch_engines(lambda: [("tiny-lm", engine)])
    telemetry.watch_queue(lambda: [({names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "2", names.ATTR_PRIORITY: 3}, 7)])

    families = _families(telemetry)
    data = reader.get_metrics_data()
    assert data is not None
    otlp = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    # The OTel names as Prometheus has them: dots to underscores, the unit's suffix, `_total` for counters (which
    # the parser strips from the family's name), `_ratio` for a gauge of unit 1, and no `_total` on a gauge.
    expected = {
        names.REQUESTS: "spillway_requests",
        names.REQUEST_DURATION: "spillway_request_duration_seconds",
        names.QUEUE_DURATION: "spillway_queue_duration_seconds",
        names.COMPUTE_DURATION: "spillway_compute_duration_seconds",
        names.BATCH_SIZE: "spillway_batch_size",
        names.QUEUE_DEPTH: "spillway_queue_depth",
        names.POLICY_VERSION: "spillway_policy_version",
        names.GENAI_TTFT: "gen_ai_server_time_to_first_token_seconds",
        names.GENAI_TPOT: "gen_ai_server_time_per_output_token_seconds",
        names.GENAI_REQUEST_DURATION: "gen_ai_server_request_duration_seconds",
        names.GENAI_TOKEN_USAGE: "gen_ai_client_token_usage",
        names.STEP_TOKENS: "spillway_generation_step_tokens",
        names.KV_BLOCKS_USED: "spillway_kv_blocks_used",
        names.KV_BLOCKS_TOTAL: "spillway_kv_blocks_limit",
        names.ACTIVE_STREAMS: "spillway_generation_streams_active",
        names.PREEMPTIONS: "spillway_generation_preemptions",
        "system.memory.usage": "system_memory_usage_bytes",
    }
    assert otlp - {"system.cpu.utilization"} == set(expected)  # (CPU utilisation needs two readings a second apart)
    # One name on both sides: each family is its instrument's name plus a suffix, never renamed for /metrics (the KV
    # budget gauge is `.limit` in the OTLP stream too: a gauge never ends in `.total`).
    assert all(family.startswith(name.replace(".", "_")) for name, family in expected.items())
    assert names.KV_BLOCKS_TOTAL == "spillway.kv.blocks.limit"
    gauges = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if isinstance(m.data, Gauge)}  # fmt: skip
    assert names.KV_BLOCKS_TOTAL in gauges and not {name for name in gauges if name.endswith(".total")}
    assert set(families) == {*expected.values(), "target_info"} | ({"system_cpu_utilization_ratio"} & set(families))

    model = (("spillway_model", "mlp"), ("spillway_model_version", "2"))
    tenant = (("spillway_tenant", "default"),)
    local = (*model, ("spillway_outcome", "local"), ("spillway_priority", "1"), *tenant)
    assert _samples(families["spillway_requests"]) == {
        ("spillway_requests_total", local): 2,
        ("spillway_requests_total", (*model, ("spillway_outcome", "rejected"), ("spillway_priority", "3"), *tenant)): 1,
        ("spillway_requests_total", (("spillway_model", "tiny-lm"), ("spillway_model_version", "1"),
                                     ("spillway_outcome", "local"), ("spillway_priority", "1"), *tenant)): 1,
    }  # fmt: skip
    durations = _samples(families["spillway_request_duration_seconds"])
    name = "spillway_request_duration_seconds"
    assert [durations[(f"{name}_bucket", (("le", le), *local))] for le in ("0.005", "0.05", "+Inf")] == [0, 1, 2]
    assert durations[(f"{name}_count", local)] == 2
    assert durations[(f"{name}_sum", local)] == pytest.approx(0.076)
    assert _samples(families["spillway_policy_version"]) == {
        ("spillway_policy_version", (("spillway_policy_source", "control_plane"),)): 4
    }
    assert _samples(families["spillway_kv_blocks_limit"]) == {
        ("spillway_kv_blocks_limit", (("spillway_model", "tiny-lm"),)): 64
    }
    (target,) = families["target_info"].samples
    assert target.name == "target_info" and target.labels["service_instance_id"] == "edge-3"
    telemetry.shutdown()


def test_two_agents_in_one_process_each_serve_their_own_metrics_and_leave_the_global_registry_alone() -> None:
    from prometheus_client import REGISTRY, generate_latest

    one = AgentTelemetry(TelemetrySettings(agent_id="one"), probes=False)
    two = AgentTelemetry(TelemetrySettings(agent_id="two"), probes=False)
    ModelStats(listener=one.recorder("mlp", 1)).outcome(1, "local")
    ModelStats(listener=two.recorder("mlp", 1)).outcome(2, "rejected")
    ModelStats(listener=two.recorder("mlp", 1)).outcome(2, "rejected")
    assert [s.value for s in _families(one)["spillway_requests"].samples] == [1]
    assert [s.value for s in _families(two)["spillway_requests"].samples] == [2]
    assert b"spillway_" not in generate_latest(REGISTRY)
    one.shutdown()
    assert [s.value for s in _families(two)["spillway_requests"].samples] == [2]
    two.shutdown()


def test_a_scrape_pushes_nothing_and_a_push_carries_what_was_scraped(capture: Capture) -> None:
    settings = TelemetrySettings(agent_id="a3", otlp_endpoints=(OtlpDestination(capture.url + "/v1/metrics"),),
                                 export_interval_s=3600)  # fmt: skip
    telemetry = AgentTelemetry(settings, probes=False)
    ModelStats(listener=telemetry.recorder("mlp", 1)).outcome(1, "local")
    for _ in range(3):
        assert _samples(_families(telemetry)["spillway_requests"])
    assert capture.requests == []  # one aggregation serves both: a scrape collects without exporting
    assert telemetry.provider.force_flush(timeout_millis=10_000)
    assert len(capture.requests) == 1 and capture.requests_counted("local", 1) == 1  # cumulative, not reset
    telemetry.shutdown()


def test_cpu_utilisation_readings_closer_than_a_second_repeat_the_last_one() -> None:
    now = [100.0]
    cpu = CpuUtilisation(min_window_s=1.0, clock=lambda: now[0])
    assert list(cpu()) == []  # a first reading has nothing to compare with
    now[0] += 0.2
    assert list(cpu()) == []  # nor one a sliver later (a scrape right after an export)
    sum(i * i for i in range(200_000))  # some CPU time for /proc/stat to count
    now[0] += 1.0
    (first,) = cpu()
    now[0] += 0.5
    (again,) = cpu()
    assert 0.0 <= first.value <= 1.0 and again.value == first.value


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
        capture.wait_for_requests("local", 1, 3)
        assert capture.requests_counted("local", 1) == 3
        headers, message = capture.requests[-1]
        assert headers["authorization"] == "Bearer spa_agent_token"
        resource = {a.key: a.value.string_value for a in message.resource_metrics[0].resource.attributes}
        assert resource["service.instance.id"] == "edge-9"
    finally:
        stop_agent(agent)
