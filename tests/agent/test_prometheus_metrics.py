"""`GET /metrics` on a real agent process with no control plane and no OTLP endpoint: Prometheus text with the
requests it served, by model, priority and outcome, that `promtool check metrics` accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.conftest import RunningAgent, start_agent, stop_agent

PROMTOOL = "/usr/bin/promtool"


@pytest.fixture(scope="module")
def bare_agent(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    """An agent told nothing about telemetry (no control_plane, no otlp_endpoints, no OTEL_* variables)."""
    quiet = {name: "" for name in os.environ if name.startswith("OTEL_")}  # (empty is unset, as the SDK reads it)
    running = start_agent(demo_repo, tmp_path_factory.mktemp("bare"), env=quiet, intra_op_threads=1,
                          latency_buckets_ms=[5.0, 50.0, 500.0])  # fmt: skip
    yield running
    stop_agent(running)


def _infer(agent: RunningAgent, priority: int | None, rows: int = 1) -> httpx.Response:
    x = np.linspace(-1, 1, rows * 512, dtype=np.float32).reshape(rows, 512)
    body: dict = {"inputs": [{"name": "input", "shape": [rows, 512], "datatype": "FP32", "data": x.ravel().tolist()}]}
    if priority is not None:
        body["parameters"] = {"priority": priority}
    return httpx.post(f"{agent.url}/v2/models/mlp/versions/2/infer", json=body, timeout=30)


def _scrape(agent: RunningAgent) -> httpx.Response:
    answer = httpx.get(f"{agent.url}/metrics", timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=")
    return answer


def _families(agent: RunningAgent) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(_scrape(agent).text)}


def _mlp_v2(families: dict[str, Metric], family: str) -> dict[tuple[str, str | None, str, str], float]:
    """(sample name, le, priority, outcome) -> value of mlp v2's samples of `family`."""
    return {(s.name, s.labels.get("le"), s.labels["spillway_priority"], s.labels["spillway_outcome"]): s.value
            for s in families[family].samples
            if (s.labels["spillway_model"], s.labels["spillway_model_version"]) == ("mlp", "2")}  # fmt: skip


def test_metrics_count_the_requests_by_model_priority_and_outcome(bare_agent: RunningAgent) -> None:
    before = _families(bare_agent)
    for priority in (1, 1, 1, 3, 3, None):
        assert _infer(bare_agent, priority).status_code == 200
    after = _families(bare_agent)

    def added(family: str) -> dict[tuple[str, str | None, str, str], float]:
        old = _mlp_v2(before, family) if family in before else {}
        return {key: value - old.get(key, 0) for key, value in _mlp_v2(after, family).items()
                if value != old.get(key, 0)}  # fmt: skip

    total = "spillway_requests_total"
    # No priority: the model's default level, 2.
    assert added("spillway_requests") == {(total, None, "1", "local"): 3, (total, None, "3", "local"): 2,
                                          (total, None, "2", "local"): 1}  # fmt: skip
    name = "spillway_request_duration_seconds"
    durations = added(name)
    assert durations[(f"{name}_count", None, "1", "local")] == 3
    assert durations[(f"{name}_bucket", "+Inf", "3", "local")] == 2
    bounds = {le for _, le, _, _ in _mlp_v2(after, name) if le is not None}
    assert sorted(bounds, key=float) == ["0.005", "0.05", "0.5", "+Inf"]  # the agent's latency_buckets_ms, in s
    # The other instruments of the OTLP stream are there too (the generative model's, the probes').
    families = after
    assert {"spillway_queue_duration_seconds", "spillway_compute_duration_seconds", "spillway_batch_size",
            "spillway_queue_depth", "spillway_policy_version", "spillway_kv_blocks_used", "spillway_kv_blocks_limit",
            "spillway_generation_streams_active", "system_memory_usage_bytes",
            "target_info"} <= set(families)  # fmt: skip
    (target,) = families["target_info"].samples
    assert target.labels["service_name"] == "spillway-edge-agent"


def test_promtool_accepts_the_metrics(bare_agent: RunningAgent) -> None:
    if not Path(PROMTOOL).exists() and shutil.which("promtool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: CI installs Debian's `prometheus` package (.ci/run)")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    assert _infer(bare_agent, 1).status_code == 200
    assert _infer(bare_agent, 2, rows=2).status_code == 200
    text = _scrape(bare_agent).content
    assert b"\nspillway_kv_blocks_limit{" in text  # the KV budget gauge, a `_total` promtool would refuse on a gauge
    promtool = PROMTOOL if Path(PROMTOOL).exists() else str(shutil.which("promtool"))
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()
