"""`GET /api/v1/agents/{id}/metrics`: latencies of a known distribution go through the agent's real recorder and
OTLP exporter into the control plane, and come back as percentiles within the bucket of the true quantile."""

from __future__ import annotations

import math
from bisect import bisect_left
from datetime import datetime, timezone

import httpx
import numpy as np
import pytest
from opentelemetry.metrics import CallbackOptions, Observation

from controlplane.query import Histogram, histogram_quantile, merge_histograms, summarise
from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.telemetry.metrics import BATCH_BUCKETS
from spillway.contract.names import ATTR_MODEL, ATTR_OUTCOME, ATTR_PRIORITY, ATTR_VERSION, DEFAULT_LATENCY_BUCKETS_MS
from tests.conftest import Plane
from tests.utils.builders import make_agent

BOUNDS_S = [ms / 1000 for ms in DEFAULT_LATENCY_BUCKETS_MS]


# ---- histogram_quantile, hand-computed ---------------------------------------------------------


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    bounds = [0.01, 0.05, 0.1]
    buckets = [10, 20, 10, 0]  # 40 observations: <=10 ms, <=50 ms, <=100 ms, slower
    # rank 20 of 40: 10 in the first bucket, so 10 of the 20 in (0.01, 0.05]: halfway.
    assert histogram_quantile(buckets, bounds, 0.5) == pytest.approx(0.03)
    # rank 4: 4/10 of the first bucket, which starts at 0.
    assert histogram_quantile(buckets, bounds, 0.1) == pytest.approx(0.004)
    # rank 38: 8 of the 10 in (0.05, 0.1].
    assert histogram_quantile(buckets, bounds, 0.95) == pytest.approx(0.09)
    assert histogram_quantile(buckets, bounds, 1.0) == pytest.approx(0.1)
    # A rank in the +Inf bucket answers the highest finite bound.
    assert histogram_quantile([1, 1, 1, 7], bounds, 0.5) == pytest.approx(0.1)
    # A first bucket whose upper bound is not above 0 answers that bound.
    assert histogram_quantile([5, 5], [-1.0], 0.2) == -1.0
    # No observations, or no finite bound: no estimate.
    assert histogram_quantile([0, 0, 0, 0], bounds, 0.5) is None
    assert histogram_quantile([3], [], 0.5) is None


def test_histogram_quantile_refuses_what_is_not_a_histogram() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        histogram_quantile([1, 1], [1.0], 1.5)
    with pytest.raises(ValueError, match="need one more"):
        histogram_quantile([1, 1], [1.0, 2.0], 0.5)


def test_layouts_merge_exactly_onto_their_shared_boundaries() -> None:
    fine = Histogram.of([0.01, 0.02, 0.05, 0.1], [1, 2, 3, 4, 5], 15, 1.0)
    coarse = Histogram.of([0.02, 0.1, 0.5], [10, 20, 30, 40], 100, 9.0)
    assert fine is not None and coarse is not None
    merged = merge_histograms([fine, coarse])
    assert merged is not None
    assert merged.bounds == (0.02, 0.1)
    # fine: (<=0.02) 1+2, (0.02, 0.1] 3+4, above 5; coarse: 10, 20, 30+40.
    assert merged.buckets == (13.0, 27.0, 75.0)
    assert (merged.count, merged.total) == (115.0, 10.0)
    assert merge_histograms([]) is None


def test_malformed_rollups_are_skipped_not_a_500() -> None:
    assert Histogram.of([0.1, 0.05], [1, 1, 1], 3, 0.3) is None  # bounds not increasing
    assert Histogram.of([0.1], [1, 1, 1], 3, 0.3) is None  # one count too many
    assert Histogram.of([math.nan], [1, 1], 2, 0.3) is None
    assert Histogram.of("oops", [1], 1, 0.0) is None

    class Row:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    minute = datetime(2024, 1, 1, tzinfo=timezone.utc)
    base = {"count": 0, "total": 0.0, "buckets": [], "bounds": [], "last": None, "min": None, "max": None,
            "minute": minute}  # fmt: skip
    rows = [
        Row(**{**base, "metric": "spillway.request.duration", "kind": "histogram", "count": 3, "total": math.inf,
               "attributes": {ATTR_MODEL: "m", ATTR_PRIORITY: 1, ATTR_OUTCOME: "local"}, "buckets": [1, 2],
               "bounds": [0.1]}),
        Row(**{**base, "metric": "spillway.request.duration", "kind": "histogram", "count": 3,
               "attributes": {ATTR_MODEL: "m", ATTR_PRIORITY: "x", ATTR_OUTCOME: "local"}, "buckets": [1],
               "bounds": [0.1]}),
        Row(**{**base, "metric": "hw.temperature", "kind": "gauge", "last": math.nan, "min": 1.0, "max": math.inf,
               "attributes": {"hw.id": math.nan}}),
    ]  # fmt: skip
    summary = summarise(rows, since=minute, until=minute.replace(minute=5))
    (traffic,) = summary["traffic"]
    assert traffic["latency_ms"]["count"] == 3 and traffic["latency_ms"]["mean"] is None  # an infinite sum
    assert traffic["latency_ms"]["p50"] == pytest.approx(100.0)
    (gauge,) = summary["device"]
    assert (gauge["last"], gauge["min"], gauge["max"], gauge["attributes"]) == (None, 1.0, None, {"hw.id": "nan"})


# ---- end to end: the real agent recorder and OTLP exporter into the real control plane -----------


def _bucket_of(value: float, bounds: list[float]) -> tuple[float, float]:
    """(lower, upper] of the explicit bucket that holds `value`."""
    index = bisect_left(bounds, value)
    lower = bounds[index - 1] if index > 0 else 0.0
    upper = bounds[index] if index < len(bounds) else math.inf
    return lower, upper


def _assert_within_bucket(estimate: float, samples: np.ndarray, q: float, bounds: list[float], scale: float) -> None:
    true = float(np.quantile(samples, q, method="inverted_cdf"))  # an observed value, like a histogram's rank
    lower, upper = _bucket_of(true, bounds)
    assert lower * scale - 1e-9 <= estimate <= upper * scale + 1e-9, (q, true * scale, estimate, lower, upper)


def test_percentiles_rates_outcomes_queues_and_gauges_from_real_telemetry(plane: Plane) -> None:
    rng = np.random.default_rng(20240607)
    fast = rng.lognormal(mean=math.log(0.030), sigma=0.6, size=2000)  # priority 1: median 30 ms, p99 ~120 ms
    slow = rng.uniform(0.100, 0.400, size=1000)  # priority 3: 100..400 ms
    queue = rng.uniform(0.0, 0.010, size=3000)
    compute = rng.uniform(0.002, 0.004, size=3000)
    rows = rng.integers(1, 33, size=500)  # batch sizes 1..32

    settings = TelemetrySettings(agent_id=plane.agent_id, control_plane=plane.url, agent_token=plane.token,
                                 export_interval_s=3600)  # the agent's default latency buckets  # fmt: skip
    telemetry = AgentTelemetry(settings, probes=True)  # host gauges from the real probes
    depths = {1: 0, 3: 0}
    telemetry.watch_queue(
        lambda: [({ATTR_MODEL: "mlp", ATTR_VERSION: "1", ATTR_PRIORITY: p}, depth) for p, depth in depths.items()]
    )
    gpu_celsius = [0.0]  # no GPU here: a device gauge as NVML would report it, through the same SDK

    def temperature(_options: CallbackOptions) -> list[Observation]:
        return [Observation(gpu_celsius[0], {"hw.id": "test-gpu", "hw.type": "gpu"})]

    telemetry.provider.get_meter("test.device").create_observable_gauge("hw.temperature", callbacks=[temperature])

    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    for i, total_s in enumerate(fast):
        stats.request(1, "local", float(queue[i]), float(compute[i]), float(total_s))
    for i, total_s in enumerate(slow, start=len(fast)):
        stats.request(3, "local", float(queue[i]), float(compute[i]), float(total_s))
    for _ in range(60):  # deadlines that passed in the queue: 5 s, which must not count as served latency
        stats.request(1, "rejected", 5.0, 0.0, 5.0)
    for _ in range(50):  # refused at admission: an outcome without durations
        stats.outcome(3, "rejected")
    for size in rows:
        stats.batch(int(size), 0.003, ok=True)
    stats.batch(256, 0.003, ok=False)  # a failed batch is not a batch size

    for p1, p3, celsius in ((7, 0, 55.0), (12, 40, 63.0), (3, 25, 61.0)):
        depths[1], depths[3], gpu_celsius[0] = p1, p3, celsius
        assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()

    viewer = httpx.post(f"{plane.url}/api/v1/keys", json={"name": "watcher", "role": "viewer"},
                        headers={"Authorization": f"Bearer {plane.admin}"}).json()["key"]  # fmt: skip
    response = httpx.get(f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics", params={"window": "5m"},
                         headers={"Authorization": f"Bearer {viewer}"})  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["agent"], body["window"]) == (plane.agent_id, "5m")

    since, until = (datetime.fromisoformat(body[k].replace("Z", "+00:00")) for k in ("since", "until"))  # 3.10
    seconds = (until - since).total_seconds()
    assert 300 <= seconds < 360  # the window widened to whole minute rollups
    assert body["requests"] == 2000 + 60 + 1000 + 50
    assert body["rps"] == pytest.approx(3110 / seconds)
    assert body["outcomes"] == {"local": 3000, "rejected": 110}

    by_priority = {t["priority"]: t for t in body["traffic"]}
    assert set(by_priority) == {1, 3} and all(t["model"] == "mlp" for t in body["traffic"])
    one, three = by_priority[1], by_priority[3]
    assert one["versions"] == ["1"]
    assert one["outcomes"] == {"local": 2000, "rejected": 60} and three["outcomes"] == {"local": 1000, "rejected": 50}
    assert one["rps"] == pytest.approx(2060 / seconds) and three["rps"] == pytest.approx(1050 / seconds)

    # Percentiles of served requests, each within the bucket of the true quantile of what was recorded.
    for group, samples in ((one, fast), (three, slow)):
        latency = group["latency_ms"]
        assert latency["count"] == len(samples)
        assert latency["mean"] == pytest.approx(samples.mean() * 1000, rel=1e-6)
        for q, key in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            _assert_within_bucket(latency[key], samples, q, BOUNDS_S, 1000)
    assert one["latency_ms"]["p99"] < 200  # the 5 s timeouts (3 % of priority 1) are not served latency
    assert three["latency_ms"]["p50"] > 100  # and priority 3's slow requests stay out of priority 1

    assert one["queue_ms_mean"] == pytest.approx(queue[:2000].mean() * 1000, rel=1e-6)
    assert three["queue_ms_mean"] == pytest.approx(queue[2000:].mean() * 1000, rel=1e-6)
    assert one["compute_ms_mean"] == pytest.approx(compute[:2000].mean() * 1000, rel=1e-6)
    assert one["queue_depth"] == {"last": 3, "max": 12}
    assert three["queue_depth"] == {"last": 25, "max": 40}

    (batches,) = body["batches"]
    assert batches["model"] == "mlp" and batches["batches"] == 500
    assert batches["mean"] == pytest.approx(rows.mean())
    for q, key in ((0.5, "p50"), (0.99, "p99")):
        _assert_within_bucket(batches[key], rows.astype(float), q, [float(b) for b in BATCH_BUCKETS], 1)

    gauges = {(g["metric"], tuple(sorted(g["attributes"].items()))): g for g in body["device"]}
    gpu = gauges[("hw.temperature", (("hw.id", "test-gpu"), ("hw.type", "gpu")))]
    assert (gpu["last"], gpu["min"], gpu["max"]) == (61.0, 55.0, 63.0)
    memory = {dict(attrs)["system.memory.state"]: g["last"] for (name, attrs), g in gauges.items()
              if name == "system.memory.usage"}  # fmt: skip
    assert set(memory) == {"used", "free"} and all(v > 0 for v in memory.values())
    assert not any(name.startswith("spillway.") for name, _ in gauges)


def test_an_agent_without_telemetry_has_an_empty_summary(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    quiet = httpx.post(f"{plane.url}/api/v1/agents", json=make_agent(), headers=admin).json()["agent"]["id"]
    body = httpx.get(f"{plane.url}/api/v1/agents/{quiet}/metrics", headers=admin).json()
    assert body["window"] == "5m"  # the default
    assert (body["requests"], body["rps"], body["outcomes"]) == (0, 0, {})
    assert (body["traffic"], body["batches"], body["device"]) == ([], [], [])


@pytest.mark.parametrize(
    ("window", "says"),
    [
        ("30s", "greater than or equal to 60"),
        ("0", "greater than or equal to 60"),
        ("abc", "is not a duration"),
        ("-5m", "is not a duration"),
        ("36d", "retention"),  # rollups are kept 35 days
        ("", "is not a duration"),
    ],
)
def test_a_bad_window_is_a_422_naming_it(plane: Plane, window: str, says: str) -> None:
    r = httpx.get(f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics", params={"window": window},
                  headers={"Authorization": f"Bearer {plane.admin}"})  # fmt: skip
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "validation_error"
    assert r.json()["details"][0]["field"] == "query.window" and says in r.json()["message"]


def test_windows_in_seconds_and_units(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    url = f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics"
    assert httpx.get(url, params={"window": "3600"}, headers=admin).json()["window"] == "1h"
    assert httpx.get(url, params={"window": "35d"}, headers=admin).json()["window"] == "35d"


def test_unknown_agent_404_and_who_may_read(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    missing = httpx.get(f"{plane.url}/api/v1/agents/nope/metrics", headers=admin)
    assert missing.status_code == 404
    assert missing.json() == {"error": "not_found", "message": "no agent with id 'nope'", "details": None}
    url = f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {plane.token}"}).status_code == 403  # agents: no
