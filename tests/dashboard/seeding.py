"""A seeded control plane for the dashboard tests: the example fleet through the REST API, one extra rule that
fires at once, a generative agent (`tiny-lm`) with a TTFT SLO, a rule that caps max_tokens on a full KV cache and an
`openai` backend, and a minute of telemetry from every agent through the real OTLP endpoint (`POST /v1/metrics`,
with each agent's token), so the pages have names and numbers to show. History comes the same way, with past
timestamps: the same traffic 20 and 30 minutes ago (outside the pages' 5-minute windows; the same mix, so every ratio,
burn rate and budget stays as the current minute makes it) and the gauges in each of the last five minutes (the same
readings), so a chart opened once already has points to draw."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from controlplane.app import create_app
from controlplane.settings import Settings
from spillway.contract import names
from tests.conftest import make_keys
from tests.utils.server import serving

MODEL, VERSION, PRIORITY, OUTCOME = names.ATTR_MODEL, names.ATTR_VERSION, names.ATTR_PRIORITY, names.ATTR_OUTCOME
EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"
LATENCY_BOUNDS_S = [ms / 1000 for ms in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)]
BATCH_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GIB = 2**30
GAUGE_EXPORT_INTERVAL_S = 5.0
PAST_TRAFFIC_MIN = (30, 20)  # minutes ago: each agent's traffic once more (the SLO page's charts have a history)
PAST_GAUGES_MIN = (5, 4, 3, 2, 1)  # minutes ago: each agent's gauges (the device page's charts, in its 5m window)

# A rule that fires on the first control-loop cycle: the seeded queue depth (80) is over its threshold.
FIRING_RULE = {
    "name": "shed-on-deep-queue",
    "description": "a deep queue in Berlin refuses priority 3",
    "selector": {"labels": {"site": "berlin"}, "model": "mlp"},
    "condition": {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 32},
    "action": {"kind": "shed", "priority_at_or_below": 3, "retry_after_s": 7},
    "hysteresis": {"for": "0s", "recover_after": "10m"},
}

# A Jetson that serves a small chat model: the OTel GenAI metrics, its KV cache filling up, a TTFT SLO on it, a
# rule that caps max_tokens when the KV cache is 70 % full (96 of 128 blocks are held: it fires at once), and a cloud
# that speaks the OpenAI API to overflow its streams to.
GENERATIVE_AGENT = {"name": "orin-chat-01", "device_class": "jetson", "labels": {"site": "munich", "tier": "edge"}}
GENERATIVE_MODEL = "tiny-lm"
TTFT_SLO = {
    "name": "tiny-lm-ttft",
    "description": "99 % of tiny-lm streams get their first token within 500 ms",
    "selector": {"model": GENERATIVE_MODEL},
    "sli_kind": "ttft",
    "threshold_ms": 500,
    "objective": 99,
    "window": "28d",
}
CAP_RULE = {
    "name": "cap-tokens-on-full-kv",
    "description": "a nearly full KV cache first shortens the answers",
    "selector": {"labels": {"site": "munich"}, "model": GENERATIVE_MODEL},
    "condition": {"kind": "gauge", "metric": "kv_cache_use_ratio", "op": ">", "threshold": 0.7},
    "action": {"kind": "cap_max_tokens", "max_tokens": 128},
    "hysteresis": {"for": "0s", "recover_after": "10m"},
}
OPENAI_BACKEND = {
    "name": "cloud-vllm-eu",
    "protocol": "openai",
    "url": "http://127.0.0.1:8501",
    "models": [GENERATIVE_MODEL],
    "model_map": {GENERATIVE_MODEL: "Qwen2.5-7B-Instruct"},
    "max_concurrency": 32,
    "timeout_ms": 30000,
}
# The generative agent's 30 s: streams per (priority, outcome) (local and overflowed ones have tokens), and the GenAI
# histograms of the 390 streams with tokens: seconds (or tokens) -> count, on the semantic conventions' buckets.
STREAMS: dict[tuple[int, str], int] = {(1, "local"): 200, (3, "local"): 150, (3, "overflow"): 40, (3, "rejected"): 10}
GENAI: dict[str, tuple[tuple[float, ...], dict[float, int]]] = {
    names.GENAI_TTFT: (names.GENAI_TTFT_BUCKETS, {0.04: 100, 0.1: 150, 0.25: 100, 0.5: 30, 1.0: 10}),
    names.GENAI_TPOT: (names.GENAI_TPOT_BUCKETS, {0.025: 200, 0.05: 150, 0.1: 40}),
    names.GENAI_REQUEST_DURATION: (names.GENAI_DURATION_BUCKETS, {0.64: 100, 1.28: 200, 2.56: 90}),
}
TOKENS = {"input": (64, 40), "output": (64, 64)}  # per stream: (its bucket's bound, tokens): 15600 in, 24960 out
PREEMPTED = 12

# What each agent reports, per (priority, outcome): request count and its latency histogram (ms -> count).
TRAFFIC: dict[str, dict[tuple[int, str], tuple[int, dict[float, int]]]] = {
    "jetson-berlin-01": {
        (1, "local"): (600, {10: 120, 20: 380, 50: 80, 100: 20}),
        (3, "local"): (300, {20: 100, 50: 140, 100: 40, 200: 20}),
        (3, "rejected"): (45, {1: 45}),
    },
    "desktop-gpu-lab": {
        (1, "local"): (240, {5: 200, 10: 40}),
        (2, "local"): (120, {5: 80, 10: 40}),
    },
}
GAUGES: dict[str, list[tuple[str, float, dict[str, Any]]]] = {
    "jetson-berlin-01": [
        ("spillway.queue.depth", 80, {MODEL: "mlp", VERSION: "1", PRIORITY: 3}),
        ("spillway.queue.depth", 4, {MODEL: "mlp", VERSION: "1", PRIORITY: 1}),
        ("hw.gpu.memory.usage", 5.25 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.gpu.memory.limit", 8 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.gpu.utilization", 0.87, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.temperature", 71.5, {"hw.id": "gpu0", "hw.type": "gpu"}),
    ],
    "desktop-gpu-lab": [
        ("spillway.queue.depth", 2, {MODEL: "mlp", VERSION: "1", PRIORITY: 1}),
        ("hw.gpu.memory.usage", 3 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.gpu.memory.limit", 24 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.temperature", 58.0, {"hw.id": "gpu0", "hw.type": "gpu"}),
    ],
    "orin-chat-01": [
        (names.KV_BLOCKS_USED, 96, {MODEL: GENERATIVE_MODEL}),
        (names.KV_BLOCKS_TOTAL, 128, {MODEL: GENERATIVE_MODEL}),
        (names.ACTIVE_STREAMS, 6, {MODEL: GENERATIVE_MODEL}),
        ("hw.gpu.memory.usage", 6 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
        ("hw.gpu.memory.limit", 8 * GIB, {"hw.id": "gpu0", "hw.type": "gpu"}),
    ],
}


@dataclass
class SeededPlane:
    url: str
    keys: dict[str, str]
    agents: dict[str, str]  # name -> id
    slos: dict[str, str]
    rules: dict[str, str]
    backends: dict[str, str]
    tokens: dict[str, str]  # agent name -> its token

    def export(self, *, traffic: bool, ago_s: float = 0.0) -> None:
        """Each agent reports, as its OTLP exporter would (`ago_s` seconds ago: a late export, past history)."""
        at = time.time_ns() - int(ago_s * 1e9)
        for name, ident in self.agents.items():
            response = httpx.post(f"{self.url}/v1/metrics", content=export_body(ident, name, traffic=traffic, at=at),
                                  headers={"Authorization": f"Bearer {self.tokens[name]}",
                                           "Content-Type": "application/x-protobuf"}, timeout=10)  # fmt: skip
            assert response.status_code == 200, response.text
            answer = ExportMetricsServiceResponse.FromString(response.content).partial_success
            assert answer.rejected_data_points == 0, answer.error_message  # every seeded point stored

    def client(self, role: str = "admin") -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.keys[role]}"}, timeout=10)

    def get(self, path: str, role: str = "admin") -> Any:
        with self.client(role) as client:
            response = client.get(f"/api/v1{path}")
            response.raise_for_status()
            return response.json()


def _attributes(values: dict[str, Any]) -> list[KeyValue]:
    out = []
    for key, value in values.items():
        any_value = AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=str(value))
        out.append(KeyValue(key=key, value=any_value))
    return out


def _histogram(name: str, unit: str, points: list[tuple[dict[str, Any], list[float], list[int], float]],
               start: int, now: int) -> Metric:  # fmt: skip
    return Metric(name=name, unit=unit, histogram=Histogram(
        aggregation_temporality=AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA,
        data_points=[HistogramDataPoint(attributes=_attributes(attrs), start_time_unix_nano=start, time_unix_nano=now,
                                        count=sum(counts), sum=total, explicit_bounds=bounds, bucket_counts=counts)
                     for attrs, bounds, counts, total in points],
    ))  # fmt: skip


def _counts(bounds: tuple[float, ...], by_bound: dict[float, int]) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for bound, n in by_bound.items():
        counts[bounds.index(bound)] += n
    return counts


def generative_metrics(counters: list[NumberDataPoint], start: int, now: int) -> list[Metric]:
    """The generative agent's 30 s as its GenerationRecorder reports it: `spillway.requests` per outcome (added to
    `counters`), the GenAI histograms by `gen_ai.request.model`, token usage by type, and preemptions."""
    model = {"gen_ai.request.model": GENERATIVE_MODEL, "gen_ai.operation.name": "chat"}
    for (priority, outcome), n in STREAMS.items():
        attrs = {MODEL: GENERATIVE_MODEL, VERSION: "1", PRIORITY: priority, OUTCOME: outcome}
        counters.append(NumberDataPoint(attributes=_attributes(attrs), start_time_unix_nano=start,
                                        time_unix_nano=now, as_double=float(n)))  # fmt: skip
    metrics = []
    for metric, (bounds, by_bound) in GENAI.items():
        total = sum(bound * 0.8 * n for bound, n in by_bound.items())
        metrics.append(_histogram(metric, "s", [(model, list(bounds), _counts(bounds, by_bound), total)], start, now))
    streams = sum(GENAI[names.GENAI_TTFT][1].values())
    usage = []
    for kind, (bound, per_stream) in TOKENS.items():
        bounds = tuple(float(b) for b in names.GENAI_TOKEN_BUCKETS)
        counts = _counts(bounds, {float(bound): streams})
        usage.append(({**model, "gen_ai.token.type": kind}, list(bounds), counts, float(per_stream * streams)))
    metrics.append(_histogram(names.GENAI_TOKEN_USAGE, "{token}", usage, start, now))
    metrics.append(Metric(name=names.PREEMPTIONS, unit="{sequence}", sum=Sum(
        aggregation_temporality=AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA, is_monotonic=True,
        data_points=[NumberDataPoint(attributes=_attributes({MODEL: GENERATIVE_MODEL}), start_time_unix_nano=start,
                                     time_unix_nano=now, as_double=float(PREEMPTED))])))  # fmt: skip
    return metrics


def export_body(agent_id: str, name: str, *, traffic: bool = True, at: int | None = None) -> bytes:
    """One OTLP export (delta temporality: what happened in the 30 s before `at`, in ns, default now) of the agent's
    seeded traffic and gauges; `traffic=False`: the gauges alone (a later export of an idle agent: counts stay as
    they were)."""
    now = time.time_ns() if at is None else at
    start = now - 30 * 10**9
    durations, queued, computed, counters, batches = [], [], [], [], []
    for (priority, outcome), (n, by_ms) in TRAFFIC.get(name, {}).items():
        attrs = {MODEL: "mlp", VERSION: "1", PRIORITY: priority, OUTCOME: outcome}
        counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        total = 0.0
        for ms, count in by_ms.items():
            counts[LATENCY_BOUNDS_S.index(ms / 1000)] += count
            total += count * ms * 0.8 / 1000  # within the bucket under its upper bound
        durations.append((attrs, LATENCY_BOUNDS_S, counts, total))
        if outcome == "local":  # of each request's time, 40 % queued and 50 % computing
            queued.append((attrs, LATENCY_BOUNDS_S, counts, total * 0.4))
            computed.append((attrs, LATENCY_BOUNDS_S, counts, total * 0.5))
        counters.append(NumberDataPoint(attributes=_attributes(attrs), start_time_unix_nano=start,
                                        time_unix_nano=now, as_double=float(n)))  # fmt: skip
    metrics: list[Metric] = []
    if traffic and name == GENERATIVE_AGENT["name"]:
        metrics += generative_metrics(counters, start, now)
    elif traffic:
        batch_counts = [0, 10, 20, 60, 30, 0, 0, 0, 0, 0]
        batches.append(({MODEL: "mlp", VERSION: "1"}, [float(b) for b in BATCH_BOUNDS], batch_counts, 900.0))
        metrics += [
            _histogram("spillway.request.duration", "s", durations, start, now),
            _histogram("spillway.queue.duration", "s", queued, start, now),
            _histogram("spillway.compute.duration", "s", computed, start, now),
            _histogram("spillway.batch.size", "{row}", batches, start, now),
        ]
    if traffic:
        metrics.append(Metric(name="spillway.requests", unit="{request}", sum=Sum(
            aggregation_temporality=AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA, is_monotonic=True,
            data_points=counters)))  # fmt: skip
    for metric, value, attrs in GAUGES[name]:
        metrics.append(Metric(name=metric, gauge=Gauge(data_points=[
            NumberDataPoint(attributes=_attributes(attrs), time_unix_nano=now, as_double=float(value))])))  # fmt: skip
    resource = Resource(attributes=_attributes({"service.name": "spillway-edge-agent", "service.instance.id": agent_id,
                                                "host.name": name}))  # fmt: skip
    request = ExportMetricsServiceRequest(resource_metrics=[
        ResourceMetrics(resource=resource, scope_metrics=[ScopeMetrics(metrics=metrics)])])  # fmt: skip
    return request.SerializeToString()


def seed(url: str, keys: dict[str, str]) -> SeededPlane:
    """The example fleet and the firing rule through the REST API, then each agent's past exports and one now."""
    fleet = yaml.safe_load(EXAMPLE_FLEET.read_text())
    fleet["agents"].append(GENERATIVE_AGENT)
    fleet["slos"].append(TTFT_SLO)
    fleet["rules"] += [FIRING_RULE, CAP_RULE]
    fleet["backends"].append(OPENAI_BACKEND)
    made: dict[str, dict[str, str]] = {"agents": {}, "slos": {}, "rules": {}, "backends": {}}
    tokens: dict[str, str] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=10) as client:
        for kind in ("agents", "slos", "rules", "backends"):
            for item in fleet[kind]:
                response = client.post(f"/api/v1/{kind}", json=item)
                assert response.status_code == 201, response.text
                body = response.json()
                if kind == "agents":
                    tokens[item["name"]] = body["token"]
                    body = body["agent"]
                made[kind][item["name"]] = body["id"]
    plane = SeededPlane(url, keys, made["agents"], made["slos"], made["rules"], made["backends"], tokens)
    for minutes in PAST_TRAFFIC_MIN:
        plane.export(traffic=True, ago_s=minutes * 60)
    for minutes in PAST_GAUGES_MIN:
        plane.export(traffic=False, ago_s=minutes * 60)
    plane.export(traffic=True)
    return plane


def wait_for(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    """Poll `check()` until it returns something truthy (a real process must catch up), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def seeded_plane(db_url: str) -> Iterator[SeededPlane]:
    """A real control plane on loopback (its control loop every second), seeded; the firing rule is in force.
    The agents keep reporting their gauges every few seconds, like live ones, so the gauge rule stays met
    (gauge conditions read the last two minutes) however long the tests take; request counts stay as seeded."""
    keys = make_keys(db_url)
    settings = Settings(database_url=db_url, control_loop_interval_s=1, evaluation_interval_s=0, stale_after_s=3600)
    with serving(create_app(settings)) as url:
        plane = seed(url, keys)
        berlin, orin = plane.agents["jetson-berlin-01"], plane.agents[str(GENERATIVE_AGENT["name"])]
        wait_for(lambda: plane.get(f"/agents/{berlin}/policy")["causes"], "the firing rule to reach the policy")
        wait_for(lambda: plane.get(f"/agents/{orin}/policy")["causes"], "the max_tokens cap to reach the policy")
        stop = threading.Event()

        def keep_reporting() -> None:
            while not stop.wait(GAUGE_EXPORT_INTERVAL_S):
                plane.export(traffic=False)

        reporter = threading.Thread(target=keep_reporting, name="gauge-exports", daemon=True)
        reporter.start()
        try:
            yield plane
        finally:
            stop.set()
            reporter.join(timeout=15)
