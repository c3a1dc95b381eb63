"""The standard OpenTelemetry variables (OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT / _HEADERS / _PROTOCOL,
OTEL_RESOURCE_ATTRIBUTES, OTEL_METRIC_EXPORT_INTERVAL) as the SDK documents them, the agent config winning where
both say something: resolved in process, then through real agent processes into loopback OTLP receivers (HTTP, and
gRPC with the optional exporter)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from edge_agent.config import AgentConfig
from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, OtlpDestination, TelemetryConfigError, TelemetrySettings
from edge_agent.telemetry.otlp import describe, redacted
from tests.agent.conftest import RunningAgent, start_agent, stop_agent
from tests.agent.test_telemetry import Capture, Received

SECRET = "s3cr3t-key"  # a header value: a secret
QUERY_KEY = "k3y-in-the-query"  # an API key in an endpoint's query string: a secret too


def _config(tmp_path: Path, **settings: Any) -> AgentConfig:
    return AgentConfig.model_validate({"model_repository": str(tmp_path), **settings})


def _no_otel_env() -> dict[str, str]:
    """Every OTEL_* variable of the test's own environment blanked (empty is unset, as the SDK reads them)."""
    return {name: "" for name in os.environ if name.startswith("OTEL_")}


@pytest.fixture
def captures() -> Iterator[list[Capture]]:
    made: list[Capture] = []
    yield made
    for capture in made:
        capture.server.shutdown()


def _capture(captures: list[Capture]) -> Capture:
    captures.append(Capture())
    return captures[-1]


# ---- resolution, in process ------------------------------------------------------------------------------------


def test_the_base_endpoint_gets_v1_metrics_for_http_and_the_metrics_endpoint_is_used_as_is(tmp_path: Path) -> None:
    config = _config(tmp_path)
    (http,) = config.telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}).otlp_endpoints
    assert (http.endpoint, http.protocol) == ("http://collector:4318/v1/metrics", "http/protobuf")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    (grpc,) = config.telemetry(env).otlp_endpoints
    assert (grpc.endpoint, grpc.protocol) == ("http://collector:4318", "grpc")  # gRPC has no path
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://metrics.example/ingest",
           "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"}  # fmt: skip
    (specific,) = config.telemetry(env).otlp_endpoints
    assert (specific.endpoint, specific.protocol) == ("https://metrics.example/ingest", "http/protobuf")
    assert config.telemetry({}).otlp_endpoints == ()  # no endpoint: no push (the SDK's localhost default is not used)
    assert config.telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}).otlp_endpoints == ()  # empty is unset


def test_headers_the_signal_specific_variable_replacing_the_generic_one_url_decoded(tmp_path: Path) -> None:
    config = _config(tmp_path)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_HEADERS": "X-Api-Key=a%20b,x-team=edge"}
    (destination,) = config.telemetry(env).otlp_endpoints
    assert dict(destination.headers) == {"x-api-key": "a b", "x-team": "edge"}
    env["OTEL_EXPORTER_OTLP_METRICS_HEADERS"] = "x-metrics-key=m"
    (destination,) = config.telemetry(env).otlp_endpoints
    assert dict(destination.headers) == {"x-metrics-key": "m"}


def test_the_config_wins_where_both_say_something(tmp_path: Path) -> None:
    resource = "service.instance.id=pod-7,service.name=x,deployment.environment=prod"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}",
           "OTEL_METRIC_EXPORT_INTERVAL": "250", "OTEL_RESOURCE_ATTRIBUTES": resource}  # fmt: skip
    plain = _config(tmp_path).telemetry(env)
    assert plain.export_interval_s == 0.25
    assert plain.agent_id == "pod-7"  # over the host name, when the config names no agent_id
    assert plain.resource_attributes["deployment.environment"] == "prod"

    config = _config(tmp_path, agent_id="edge-1", export_interval_s=7, otlp_endpoints=[
        "http://yaml:4318/v1/metrics",
        {"endpoint": "http://keyed:4318/v1/metrics", "headers": {"Authorization": "Bearer k"}},
        {"endpoint": "http://grpc:4317", "protocol": "grpc"},
    ])  # fmt: skip
    settings = config.telemetry(env)
    assert settings.agent_id == "edge-1" and settings.export_interval_s == 7
    assert [(d.endpoint, d.protocol, dict(d.headers)) for d in settings.otlp_endpoints] == [
        ("http://yaml:4318/v1/metrics", "http/protobuf", {"x-api-key": SECRET}),  # no headers of its own: the env's
        ("http://keyed:4318/v1/metrics", "http/protobuf", {"authorization": "Bearer k"}),  # its own only
        ("http://grpc:4317", "grpc", {"x-api-key": SECRET}),
    ]  # and the env's endpoint is not used
    assert _config(tmp_path).telemetry({}).export_interval_s == 5.0  # neither: the default


def test_values_the_agent_cannot_use_are_refused_naming_the_variable_never_a_secret(tmp_path: Path) -> None:
    config = _config(tmp_path)
    refusals = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": ("http/json", "OTEL_EXPORTER_OTLP_PROTOCOL=http/json: the agent exports"),
        "OTEL_METRIC_EXPORT_INTERVAL": ("soon", "OTEL_METRIC_EXPORT_INTERVAL=soon: expected the export interval"),
        "OTEL_EXPORTER_OTLP_HEADERS": (f"x-api-key={SECRET},{SECRET}", "OTEL_EXPORTER_OTLP_HEADERS: header 2 is not"),
    }
    for name, (value, message) in refusals.items():
        with pytest.raises(ValueError) as refused:
            config.telemetry({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", name: value})
        assert str(refused.value).startswith(message)
        assert SECRET not in str(refused.value)
    with pytest.raises(ValueError, match="positive"):
        config.telemetry({"OTEL_METRIC_EXPORT_INTERVAL": "0"})


def test_settings_never_show_a_header_or_the_agent_token(tmp_path: Path) -> None:
    settings = _config(tmp_path, control_plane="http://plane", agent_token="spa_token_value").telemetry(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}"}
    )
    assert SECRET not in repr(settings) and "spa_token_value" not in repr(settings)
    assert "http://c:4318/v1/metrics" in repr(settings)


def test_endpoints_are_logged_without_user_info_query_or_fragment() -> None:
    """Some collectors take their API key in the query (`?api_key=`), some URLs carry a password: what the start-up
    line, the errors and a repr show is scheme, host, port and path only."""
    assert redacted(f"https://ingest.example:4318/v1/metrics?api_key={SECRET}&region=eu#{SECRET}") == (
        "https://ingest.example:4318/v1/metrics"
    )
    assert redacted(f"https://user:{SECRET}@collector/otlp/v1/metrics") == "https://collector/otlp/v1/metrics"
    assert redacted(f"http://{SECRET}@[::1]:4317?token={SECRET}") == "http://[::1]:4317"
    assert redacted("http://c:4318/v1/metrics") == "http://c:4318/v1/metrics"  # nothing to leave out
    assert redacted("http://c:99999/") == "<unparsable URL>"
    keyed = OtlpDestination(f"http://u:{SECRET}@c:4318/v1/metrics?api_key={SECRET}", (("x-api-key", SECRET),))
    settings = TelemetrySettings(agent_id="a", control_plane=f"http://plane?k={SECRET}", otlp_endpoints=(keyed,))
    assert describe(settings) == "http://plane (http/protobuf), http://c:4318/v1/metrics (http/protobuf)"
    assert SECRET not in repr(keyed) and "http://c:4318/v1/metrics" in repr(keyed)


def test_the_env_headers_go_to_the_env_endpoint_as_is_and_never_to_the_control_plane(
    tmp_path: Path, captures: list[Capture], monkeypatch: pytest.MonkeyPatch
) -> None:
    plane, collector = _capture(captures), _capture(captures)
    # The SDK's HTTP exporter reads the process's variables itself: set them there.
    for name, value in _no_otel_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", collector.url + "/custom/ingest")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # the METRICS one wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", f"x-api-key={SECRET}")
    settings = _config(tmp_path, agent_id="edge-2", control_plane=plane.url, agent_token="spa_t").telemetry()
    telemetry = AgentTelemetry(settings, probes=False)
    ModelStats(listener=telemetry.recorder("mlp", 1)).outcome(1, "local")
    assert telemetry.provider.force_flush(timeout_millis=10_000)
    telemetry.shutdown()

    assert set(collector.paths) == {"/custom/ingest"}
    assert collector.requests_counted("local", 1) == 1
    headers = collector.requests[-1][0]
    assert headers["x-api-key"] == SECRET and "authorization" not in headers
    headers = plane.requests[-1][0]
    assert headers["authorization"] == "Bearer spa_t" and "x-api-key" not in headers
    assert plane.paths[-1] == "/v1/metrics"


def test_a_grpc_destination_without_the_grpc_exporter_is_refused_with_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.metric_exporter", None)  # not installed
    settings = TelemetrySettings(agent_id="a", otlp_endpoints=(OtlpDestination("http://c:4317", protocol="grpc"),))
    with pytest.raises(TelemetryConfigError, match=r"pip install 'spillway\[otlp-grpc\]'"):
        AgentTelemetry(settings, probes=False)


# ---- real agent processes --------------------------------------------------------------------------------------


def _serve_some(agent: RunningAgent, count: int) -> None:
    x = np.linspace(-1, 1, 512, dtype=np.float32)
    body = {"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": x.tolist()}],
            "parameters": {"priority": 1}}  # fmt: skip
    for _ in range(count):
        assert httpx.post(f"{agent.url}/v2/models/mlp/versions/2/infer", json=body, timeout=30).status_code == 200


def _status(agent: RunningAgent) -> dict[str, Any]:
    return dict(httpx.get(f"{agent.url}/v2/spillway/status", timeout=10).json())


def test_an_agent_configured_only_by_the_standard_variables_exports_there(
    demo_repo: Path, tmp_path: Path, captures: list[Capture]
) -> None:
    collector = _capture(captures)
    env = {**_no_otel_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
           "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.instance.id=edge-env-7,service.name=x",
           "OTEL_METRIC_EXPORT_INTERVAL": "200"}  # fmt: skip
    agent = start_agent(demo_repo, tmp_path, env=env, intra_op_threads=1)
    try:
        _serve_some(agent, 2)
        collector.wait_for_requests("local", 1, 2)
        status = _status(agent)
    finally:
        stop_agent(agent)
    assert set(collector.paths) == {"/v1/metrics"}
    headers = collector.requests[-1][0]
    assert headers["x-api-key"] == SECRET and "authorization" not in headers
    resource = collector.resource()
    assert resource["deployment.environment"] == "test"
    assert resource["service.instance.id"] == "edge-env-7"  # the variable's, over the host name
    assert resource["service.name"] == "spillway-edge-agent"  # the agent's own wins
    assert status["agent_id"] == "edge-env-7" and status["telemetry"]["export_interval_s"] == 0.2
    assert SECRET not in agent.log.read_text()


def test_the_agent_config_wins_over_the_variables(demo_repo: Path, tmp_path: Path, captures: list[Capture]) -> None:
    yaml_plain, yaml_keyed, from_env = _capture(captures), _capture(captures), _capture(captures)
    env = {**_no_otel_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": from_env.url,
           "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}", "OTEL_METRIC_EXPORT_INTERVAL": "3600000"}  # fmt: skip
    endpoints = [yaml_plain.url + "/custom/metrics",  # a collector's API key in the query: never logged
                 {"endpoint": yaml_keyed.url + f"/v1/metrics?api_key={QUERY_KEY}",
                  "headers": {"Authorization": "Bearer yaml"}}]  # fmt: skip
    agent = start_agent(demo_repo, tmp_path, env=env, intra_op_threads=1, otlp_endpoints=endpoints,
                        export_interval_s=0.25)  # fmt: skip
    try:
        _serve_some(agent, 3)
        # Pushed while serving: the config's 0.25 s, not the variable's hour.
        yaml_plain.wait_for_requests("local", 1, 3)
        yaml_keyed.wait_for_requests("local", 1, 3)
    finally:
        stop_agent(agent)
    assert set(yaml_plain.paths) == {"/custom/metrics"}
    assert yaml_plain.requests[-1][0]["x-api-key"] == SECRET  # an endpoint without headers of its own: the env's
    keyed = yaml_keyed.requests[-1][0]
    assert keyed["authorization"] == "Bearer yaml" and "x-api-key" not in keyed
    assert from_env.requests == []  # otlp_endpoints set: the variable's endpoint is not used, even at shutdown
    assert set(yaml_keyed.paths) == {f"/v1/metrics?api_key={QUERY_KEY}"}  # sent as configured
    log = agent.log.read_text()
    assert f"{yaml_keyed.url}/v1/metrics (http/protobuf)" in log and QUERY_KEY not in log and SECRET not in log


def test_protocol_grpc_exports_to_a_grpc_collector(demo_repo: Path, tmp_path: Path, captures: list[Capture]) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.metric_exporter")
    collector = GrpcCollector()
    http = _capture(captures)
    env = {**_no_otel_env(), "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": collector.url, "OTEL_EXPORTER_OTLP_ENDPOINT": http.url,
           "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={SECRET}", "OTEL_METRIC_EXPORT_INTERVAL": "200"}  # fmt: skip
    try:
        agent = start_agent(demo_repo, tmp_path, env=env, intra_op_threads=1, agent_id="edge-grpc")
        try:
            _serve_some(agent, 2)
            collector.wait_for_requests("local", 1, 2)
        finally:
            stop_agent(agent)
        assert collector.requests[-1][0]["x-api-key"] == SECRET
        assert collector.resource()["service.instance.id"] == "edge-grpc"
        assert http.requests == []
    finally:
        collector.server.stop(grace=None)


def test_a_variable_the_agent_cannot_use_stops_it_at_start_with_one_line(demo_repo: Path, tmp_path: Path) -> None:
    env = {**os.environ, **_no_otel_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "spillway.cli", "agent", "serve", "--model-repository", str(demo_repo), "--port", "0",
         "--grpc-port", "-1"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=http/json: the agent exports metrics over http/protobuf or grpc" in done.stderr
    assert "Traceback" not in done.stderr


class GrpcCollector(Received):
    """A real OTLP/gRPC metrics service on loopback that keeps what it is sent (with its metadata)."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

        super().__init__()
        collector = self

        class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                collector.requests.append(({k.lower(): v for k, v in context.invocation_metadata()}, request))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{port}"
