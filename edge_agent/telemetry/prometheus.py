"""`GET /metrics`: the same instruments as the OTLP push, in the Prometheus text format through the OpenTelemetry
Prometheus exporter, collected at each scrape from the provider's one reader (otlp.SharedReader), on a registry of
this pipeline's own (two agents in one process, or the old and the new pipeline while a policy rebuilds it, never
meet in prometheus_client's global REGISTRY)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import Gauge, Metric, MetricReader, MetricsData
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

RATIO_UNIT = "1"


class PrometheusExposition:
    """The text a scrape gets from `source` (a collection of every instrument, taken when asked)."""

    def __init__(self, source: Callable[[], MetricsData | None]) -> None:
        self.registry = CollectorRegistry()
        self.reader = PulledPrometheusReader(self.registry, source)
        # One scrape at a time: the exporter's collector queues each collection and turns the queue into families,
        # so two at once could each see the other's points.
        self._lock = threading.Lock()

    def text(self) -> tuple[bytes, str]:
        """The body and content type of a `/metrics` answer."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        self.reader.shutdown()


class PulledPrometheusReader(PrometheusMetricReader):
    """The OTel Prometheus exporter fed from `source` rather than from a meter provider's storage of its own (which
    would aggregate every measurement a second time), with Prometheus' convention where this exporter's names miss
    it: a gauge of unit `1` ends in `_ratio` (OTel's Prometheus compatibility spec; the exporter leaves the suffix
    out, so the agent's names would differ from a collector's). The instruments' names are the OTLP stream's as
    they are (no gauge ends in `.total`, which Prometheus keeps for counters: the KV budget is `.limit`)."""

    def __init__(self, registry: CollectorRegistry, source: Callable[[], MetricsData | None]) -> None:
        super().__init__(registry=registry)
        self._source = source
        # Where a meter provider would hook its collection in, `source` is: the reader's own collect() (which a
        # scrape calls through the exporter's collector) then runs as it does for any reader.
        self._set_collect_callback(self._pull)  # type: ignore[arg-type]  # (the SDK's hint misnames the timeout)

    def _pull(self, _reader: MetricReader, timeout_millis: float = 10_000) -> MetricsData | None:
        data = self._source()
        return None if data is None else conventional(data)


def conventional(data: MetricsData) -> MetricsData:
    """`data` with the gauges' units as PulledPrometheusReader says (the same object when none needs it)."""
    if not any(
        _with_ratio_unit(m) is not m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    ):
        return data
    return replace(data, resource_metrics=[
        replace(rm, scope_metrics=[
            replace(sm, metrics=[_with_ratio_unit(m) for m in sm.metrics]) for sm in rm.scope_metrics
        ])
        for rm in data.resource_metrics
    ])  # fmt: skip


def _with_ratio_unit(metric: Metric) -> Metric:
    if not isinstance(metric.data, Gauge) or metric.unit != RATIO_UNIT:
        return metric
    return replace(metric, unit="ratio")
