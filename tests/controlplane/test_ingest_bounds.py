"""Histogram bounds at ingest: a histogram the control plane reads is stored on the bounds it expects (as sent, or
re-bucketed exactly from finer ones, or, for latency, an agent's own coarser subset), and anything else is refused
through OTLP's partial_success with a message that says how to fix it, never turned into wrong percentiles. Through
the real OpenTelemetry SDK and its OTLP/HTTP exporter into a real control plane."""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest
import requests
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics import Meter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from sqlalchemy import select

from controlplane.app import create_app
from controlplane.db.models import MetricRollup
from controlplane.ingest.bounds import BATCH_SIZE_BUCKETS, Layouts
from controlplane.ingest.receiver import Ingestor
from controlplane.settings import Settings
from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.telemetry.metrics import BATCH_BUCKETS
from spillway.contract import names
from tests.conftest import Plane

EXPECTED_S = tuple(ms / 1000 for ms in names.DEFAULT_LATENCY_BUCKETS_MS)
SDK_DEFAULT = (0.0, 5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 250.0, 500.0, 750.0, 1000.0, 2500.0, 5000.0, 7500.0, 10000.0)
SERVED = {names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: 1, names.ATTR_OUTCOME: "local"}


def _counts(samples: Sequence[float], bounds: Sequence[float]) -> list[int]:
    """Explicit-bucket counts as the SDK makes them: bucket i holds (bounds[i-1], bounds[i]]."""
    counts = [0] * (len(bounds) + 1)
    for value in samples:
        counts[bisect_left(bounds, value)] += 1
    return counts


# ---- the fit of a sent layout, pure ------------------------------------------------------------------------------


def test_finer_bounds_are_rebucketed_exactly() -> None:
    rng = np.random.default_rng(15)
    layouts = Layouts()
    for _ in range(50):
        extra = rng.choice([0.0005, 0.0015, 0.003, 0.007, 0.03, 0.15, 0.3, 0.75, 3.0, 7.5, 30.0], size=4)
        finer = tuple(sorted({*EXPECTED_S, *map(float, extra)}))
        samples = [float(v) for v in rng.lognormal(math.log(0.02), 1.5, size=500)] + list(finer)  # and the edges
        fit = layouts.fit(names.REQUEST_DURATION, "s", finer)
        assert fit.problem is None and fit.bounds == EXPECTED_S
        assert list(fit.buckets(_counts(samples, finer))) == _counts(samples, EXPECTED_S)


def test_the_expected_bounds_an_agents_coarser_latency_bounds_and_rounding_are_stored_as_sent() -> None:
    layouts = Layouts()
    fit = layouts.fit(names.REQUEST_DURATION, "s", EXPECTED_S)
    assert (fit.problem, fit.bounds, fit.buckets([1] * 14)) == (None, EXPECTED_S, (1,) * 14)
    # An agent's own latency_buckets_ms, fewer of the same boundaries: exact, kept as sent.
    assert layouts.fit(names.QUEUE_DURATION, "s", (0.01, 0.1)).bounds == (0.01, 0.1)
    # Bounds typed by hand or computed as ms / 1000 on the other side are the same bounds; stored as expected.
    nudged = tuple(b * (1 + 1e-12) for b in EXPECTED_S)
    assert layouts.fit(names.REQUEST_DURATION, "", nudged).bounds == EXPECTED_S
    # The GenAI histograms have no "own buckets" of an agent: coarser is refused, the same or finer is stored.
    ttft = names.GENAI_TTFT_BUCKETS
    assert layouts.fit(names.GENAI_TTFT, "s", ttft[::2]).problem is not None
    assert layouts.fit(names.GENAI_TTFT, "s", tuple(sorted({*ttft, 0.003}))).bounds == ttft
    assert layouts.fit(names.GENAI_TOKEN_USAGE, "{token}", names.GENAI_TOKEN_BUCKETS).problem is None
    assert layouts.fit(names.STEP_TOKENS, "{token}", names.STEP_TOKEN_BUCKETS).problem is None
    assert layouts.fit(names.BATCH_SIZE, "{row}", tuple(map(float, BATCH_BUCKETS))).problem is None
    # Metrics the control plane does not read are stored as they come.
    assert layouts.fit("my.own.histogram", "ms", SDK_DEFAULT).bounds == SDK_DEFAULT


def test_the_control_planes_batch_buckets_are_the_agents() -> None:
    assert tuple(BATCH_BUCKETS) == BATCH_SIZE_BUCKETS


@pytest.mark.parametrize(
    ("metric", "unit", "bounds", "says"),
    [
        (names.REQUEST_DURATION, "s", SDK_DEFAULT, "[0, 5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000"),
        (names.REQUEST_DURATION, "s", (0.003, 0.03), "[0.003, 0.03]"),  # neither finer nor a subset
        (names.REQUEST_DURATION, "s", (), "[]"),  # no buckets: no percentile, no latency SLO
        (names.COMPUTE_DURATION, "ms", names.DEFAULT_LATENCY_BUCKETS_MS, "unit 'ms'"),
        (names.GENAI_TPOT, "s", SDK_DEFAULT, names.GENAI_TPOT),
        (names.GENAI_TOKEN_USAGE, "{token}", SDK_DEFAULT, "[1, 4, 16, 64, 256"),
        (names.STEP_TOKENS, "{token}", (1.0, 10.0, 100.0), "[1, 2, 4, 8"),
        (names.BATCH_SIZE, "{row}", SDK_DEFAULT, "[1, 2, 4, 8, 16, 32, 64, 128, 256]"),
    ],
)
def test_other_bounds_are_refused_with_what_to_send(metric: str, unit: str, bounds: tuple[float, ...],
                                                    says: str) -> None:  # fmt: skip
    problem = Layouts().fit(metric, unit, bounds).problem
    assert problem is not None and metric in problem and says in problem


def test_many_refused_layouts_are_each_counted_and_said_up_to_a_bound(factory: Any) -> None:
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    sender = resource.resource.attributes.add()
    sender.key, sender.value.string_value = "service.instance.id", "a1"
    metric = resource.scope_metrics.add().metrics.add()
    metric.name, metric.unit = names.REQUEST_DURATION, "s"
    metric.histogram.aggregation_temporality = 1  # delta
    for bounds in [[1.5 + i] for i in range(30)] + [[float(b) for b in range(1, 1001)]]:
        point = metric.histogram.data_points.add()
        point.time_unix_nano, point.count, point.sum = time.time_ns(), 1, 0.5
        point.explicit_bounds.extend(bounds)
        point.bucket_counts.extend([1] + [0] * len(bounds))
    result = Ingestor(factory).ingest("a1", message)
    assert (result.accepted, result.rejected) == (0, 31)
    assert result.message.count("with explicit bounds") == 20 and result.message.endswith("; and 11 more")
    long = Layouts().fit(names.REQUEST_DURATION, "s", tuple(float(b) for b in range(1, 1001))).problem
    assert (
        long is not None and "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, ... (1000" in long
    )


def test_a_control_plane_with_its_own_latency_buckets_expects_those() -> None:
    layouts = Layouts([250.0, 75.0])
    assert layouts.expected[names.REQUEST_DURATION].bounds == (0.075, 0.25)
    assert layouts.fit(names.REQUEST_DURATION, "s", (0.025, 0.075, 0.25, 1.0)).buckets([1, 2, 3, 4, 5]) == (3, 3, 9)
    problem = layouts.fit(names.REQUEST_DURATION, "s", EXPECTED_S).problem  # the defaults lack 75 ms and 250 ms
    assert problem is not None and "[0.075, 0.25]" in problem and "SPILLWAY_LATENCY_BUCKETS_MS" in problem


# ---- through the real SDK and exporter into a real control plane ----------------------------------------------


@contextmanager
def plain_sdk(plane: Plane, *views: View) -> Iterator[tuple[Meter, list[requests.Response]]]:
    """A plain OpenTelemetry SDK (no Spillway code) exporting to the control plane as the plane's agent; yields a
    meter and the control plane's answers to the exports (one per flush), which the SDK itself does not surface."""
    answers: list[requests.Response] = []
    session = requests.Session()
    session.hooks["response"].append(lambda response, *args, **kwargs: answers.append(response))
    exporter = OTLPMetricExporter(endpoint=f"{plane.url}/v1/metrics", session=session, timeout=10,
                                  headers={"Authorization": f"Bearer {plane.token}"})  # fmt: skip
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    resource = Resource.create({"service.name": "a-plain-sdk", "service.instance.id": plane.agent_id})
    provider = MeterProvider(resource=resource, metric_readers=[reader], views=list(views))
    try:
        yield provider.get_meter("a-plain-sdk"), answers
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()


def _partial(answer: requests.Response) -> Any:
    assert answer.status_code == 200, answer.text  # a partial success is a success (OTLP/HTTP)
    return ExportMetricsServiceResponse.FromString(answer.content).partial_success


def _get(plane: Plane, path: str) -> Any:
    response = httpx.get(f"{plane.url}/api/v1{path}", params={"window": "5m"},
                         headers={"Authorization": f"Bearer {plane.admin}"}, timeout=10)  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()


def _durations(plane: Plane) -> tuple[list[float], list[int], int]:
    """The stored request-duration rollups, summed over minutes: bounds, bucket counts and count."""
    rows = plane.rollups(names.REQUEST_DURATION)
    assert rows and all(row.bounds == rows[0].bounds for row in rows)
    buckets = [sum(column) for column in zip(*(row.buckets for row in rows), strict=True)]
    return rows[0].bounds, buckets, sum(row.count for row in rows)


def test_the_sdks_default_buckets_are_refused_not_shown_as_wrong_percentiles(
    plane: Plane, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: 4 ms requests on the SDK's default bounds read as p50 2500 ms. Now the histogram points are
    refused (and said why, to the exporter and once in the log), the rest of the export is stored, and no percentile
    is made up."""
    caplog.set_level(logging.WARNING, logger="spillway.controlplane")
    with plain_sdk(plane) as (meter, answers):
        duration = meter.create_histogram(names.REQUEST_DURATION, unit="s")
        counter = meter.create_counter(names.REQUESTS, unit="{request}")
        for _ in range(10):
            duration.record(0.004, SERVED)
            counter.add(1, SERVED)
    partial = _partial(answers[0])
    assert partial.rejected_data_points == 1
    message = partial.error_message
    assert f"{names.REQUEST_DURATION} with explicit bounds {list(map(int, SDK_DEFAULT))}" in message
    assert "[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10]" in message
    assert (
        f'View(instrument_name="{names.REQUEST_DURATION}", aggregation=ExplicitBucketHistogramAggregation(' in message
    )
    assert plane.rollups(names.REQUEST_DURATION) == []
    assert len(answers) == 2 and _partial(answers[1]).rejected_data_points == 1  # the flush, then the shutdown's
    logged = [r.getMessage() for r in caplog.records if names.REQUEST_DURATION in r.getMessage()]
    assert len(logged) == 1 and plane.agent_id in logged[0] and message in logged[0]

    (traffic,) = _get(plane, f"/agents/{plane.agent_id}/metrics")["traffic"]
    assert traffic["requests"] == 10 and traffic["outcomes"] == {"local": 10}  # the counter was stored
    assert traffic["latency_ms"] == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None}
    live = _get(plane, "/status")["live"]
    assert (live["requests"], live["p50_ms"], live["p99_ms"]) == (10, None, None)

    # Configured as the message says, the same SDK is accepted, and its percentiles sit in the 4 ms bucket.
    view = View(instrument_name=names.REQUEST_DURATION, aggregation=ExplicitBucketHistogramAggregation(EXPECTED_S))
    with plain_sdk(plane, view) as (meter, answers):
        duration = meter.create_histogram(names.REQUEST_DURATION, unit="s")
        for _ in range(10):
            duration.record(0.004, SERVED)
    assert all(_partial(answer).rejected_data_points == 0 for answer in answers)
    (traffic,) = _get(plane, f"/agents/{plane.agent_id}/metrics")["traffic"]
    latency = traffic["latency_ms"]
    assert latency["count"] == 10 and latency["mean"] == pytest.approx(4.0)
    assert all(2.0 < latency[p] <= 5.0 for p in ("p50", "p95", "p99"))
    live = _get(plane, "/status")["live"]
    assert 2.0 < live["p50_ms"] <= 5.0 and 2.0 < live["p99_ms"] <= 5.0


def test_finer_buckets_from_an_sdk_are_rebucketed_exactly(plane: Plane) -> None:
    finer = tuple(sorted({*EXPECTED_S, 0.0005, 0.003, 0.0075, 0.03, 0.3, 3.0, 30.0}))
    samples = [float(v) for v in np.random.default_rng(7).lognormal(math.log(0.02), 1.2, size=3000)]
    view = View(instrument_name=names.REQUEST_DURATION, aggregation=ExplicitBucketHistogramAggregation(finer))
    with plain_sdk(plane, view) as (meter, answers):
        duration = meter.create_histogram(names.REQUEST_DURATION, unit="s")
        for value in samples:
            duration.record(value, SERVED)
    assert answers and all(_partial(answer).rejected_data_points == 0 for answer in answers)
    bounds, buckets, count = _durations(plane)
    assert (bounds, buckets, count) == (list(EXPECTED_S), _counts(samples, EXPECTED_S), len(samples))
    latency = _get(plane, f"/agents/{plane.agent_id}/metrics")["traffic"][0]["latency_ms"]
    assert latency["count"] == len(samples) and latency["mean"] == pytest.approx(np.mean(samples) * 1000)


@pytest.mark.parametrize(
    ("buckets_ms", "stored"),
    [
        ((10.0, 100.0), [0.01, 0.1]),  # fewer of the control plane's boundaries: as sent
        ((*names.DEFAULT_LATENCY_BUCKETS_MS, 3.0, 30.0, 300.0), list(EXPECTED_S)),  # more: re-bucketed
    ],
)
def test_an_agents_own_latency_buckets_are_still_accepted(plane: Plane, buckets_ms: tuple[float, ...],
                                                          stored: list[float]) -> None:  # fmt: skip
    """An agent exports with its configured `latency_buckets_ms` until its first policy sets the control plane's."""
    settings = TelemetrySettings(agent_id=plane.agent_id, control_plane=plane.url, agent_token=plane.token,
                                 export_interval_s=3600, latency_buckets_ms=buckets_ms)  # fmt: skip
    telemetry = AgentTelemetry(settings, probes=False)
    samples = [0.0025, 0.004, 0.009, 0.025, 0.04, 0.2, 0.35, 3.0]
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    for value in samples:
        stats.request(1, "local", 0.001, 0.001, value)
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()
    bounds, buckets, count = _durations(plane)
    assert (bounds, buckets, count) == (stored, _counts(samples, stored), len(samples))


def test_an_ingestor_with_the_control_planes_own_buckets_rebuckets_onto_them(factory: Any) -> None:
    """SPILLWAY_LATENCY_BUCKETS_MS of 75 and 250 ms: the agents' policies send those; finer ones re-bucket."""
    ingestor = Ingestor(factory, latency_buckets_ms=[75.0, 250.0])  # first: runs begun before it are baselines
    reader = InMemoryMetricReader()
    view = View(instrument_name=names.REQUEST_DURATION,
                aggregation=ExplicitBucketHistogramAggregation((0.025, 0.075, 0.1, 0.25)))  # fmt: skip
    provider = MeterProvider(resource=Resource.create({"service.instance.id": "a1"}), metric_readers=[reader],
                             views=[view])  # fmt: skip
    duration = provider.get_meter("t").create_histogram(names.REQUEST_DURATION, unit="s")
    for value in (0.01, 0.05, 0.09, 0.2, 0.5):
        duration.record(value, SERVED)
    data = reader.get_metrics_data()
    assert data is not None
    result = ingestor.ingest("a1", encode_metrics(data))
    assert (result.accepted, result.rejected) == (1, 0)
    with factory() as session:
        (row,) = session.scalars(select(MetricRollup).where(MetricRollup.metric == names.REQUEST_DURATION))
    assert (row.bounds, row.buckets) == ([0.075, 0.25], [2, 2, 1])
    provider.shutdown()


def test_the_app_expects_its_configured_latency_buckets(sqlite_url: str) -> None:
    app = create_app(Settings(database_url=sqlite_url, latency_buckets_ms=[75.0, 250.0], control_loop_interval_s=0))
    with TestClient(app):
        assert app.state.ingestor.layouts.expected[names.REQUEST_DURATION].bounds == (0.075, 0.25)


def _pinned(message: ExportMetricsServiceRequest, at_ns: int) -> ExportMetricsServiceRequest:
    """`message` with every histogram point taken at `at_ns` (both exports in one minute, whenever the test runs)."""
    for resource in message.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.histogram.data_points:
                    point.time_unix_nano = at_ns
    return message


def test_mixed_layouts_in_one_window_are_exact_on_the_bounds_they_share(plane: Plane) -> None:
    """The agent exports on its own latency_buckets_ms (10 and 100 ms, a subset of the control plane's), then its
    first policy rebuilds its pipeline on the control plane's 13 bounds: one series, both layouts in the same minute.
    Percentiles and SLO counts over the window are those of every sample on the shared bounds, 10 and 100 ms, as
    counted by hand; a threshold on a bound only one layout has counts conservatively (never a slow request good)."""
    admin = {"Authorization": f"Bearer {plane.admin}"}
    slos = {threshold: httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json={
        "name": f"within-{threshold}", "selector": {"labels": {"site": "berlin"}, "model": "mlp"},
        "sli_kind": "latency", "threshold_ms": threshold, "objective": 90, "window": "1d"}).json()["id"]
        for threshold in (5, 10, 100)}  # fmt: skip
    before = [0.003, 0.008, 0.02, 0.05, 0.09, 0.15, 2.0]  # on (10, 100) ms
    after = [0.0015, 0.004, 0.009, 0.012, 0.03, 0.07, 0.2, 0.6]  # on the 13 bounds
    minute_ns = time.time_ns() // 60_000_000_000 * 60_000_000_000
    for at_s, buckets_ms, samples in ((1, (10.0, 100.0), before), (2, names.DEFAULT_LATENCY_BUCKETS_MS, after)):
        reader = InMemoryMetricReader()
        settings = TelemetrySettings(agent_id=plane.agent_id, latency_buckets_ms=buckets_ms)
        telemetry = AgentTelemetry(settings, readers=[reader], probes=False)
        stats = ModelStats(listener=telemetry.recorder("mlp", 1))
        for value in samples:
            stats.request(1, "local", 0.0, 0.0, value)
        data = reader.get_metrics_data()
        assert data is not None
        result = plane.app.state.ingestor.ingest(
            plane.agent_id, _pinned(encode_metrics(data), minute_ns + at_s * 10**9)
        )
        assert result.rejected == 0
        telemetry.shutdown()

    # By hand, on (10 ms, 100 ms): 5 samples at or under 10 ms, 6 in (10, 100], 4 above; 15 in all.
    latency = _get(plane, f"/agents/{plane.agent_id}/metrics")["traffic"][0]["latency_ms"]
    assert latency["count"] == 15 and latency["mean"] == pytest.approx(sum(before + after) / 15 * 1000)
    assert latency["p50"] == pytest.approx(10 + 90 * (7.5 - 5) / 6)  # rank 7.5: 2.5 into the 6 of (10, 100]
    assert latency["p95"] == latency["p99"] == 100  # in the +Inf bucket: the highest shared bound
    counted = {}
    for threshold, slo in slos.items():
        (row,) = httpx.get(f"{plane.url}/api/v1/slos/{slo}/agents", headers=admin).json()
        counted[threshold] = (row["good"], row["total"])
    assert counted[10] == (5, 15) and counted[100] == (11, 15)  # exact: shared bounds
    assert counted[5] == (2, 15)  # 3 samples are under 5 ms; the subset layout cannot tell 3 ms from 8 ms
