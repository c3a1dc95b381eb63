"""The one metric reader of the agent's meter provider and the OTLP push behind it.

Every measurement is aggregated once, in one reader, however many places the metrics go (the SDK aggregates a
measurement again in each reader it has: that is per-request cost on the event loop). The reader's own periodic ticks
push to each OTLP destination (the SDK's real exporters: http/protobuf always; grpc through the optional
opentelemetry-exporter-otlp-proto-grpc, imported only when a destination asks for it), on its own thread with
bounded timeouts, a failed export logged and dropped; a `/metrics` scrape collects from the same reader without
pushing (prometheus.py). Temporality is cumulative everywhere, as Prometheus needs."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)

from edge_agent.telemetry import environment
from edge_agent.telemetry.settings import OtlpDestination, TelemetryConfigError, TelemetrySettings, redacted

log = logging.getLogger("spillway.agent.telemetry")


class SharedReader(PeriodicExportingMetricReader):
    """The provider's one reader: its ticks (every `interval_s`, only when there is somewhere to push) export to
    every exporter; `snapshot()` collects for a scrape and pushes nothing."""

    def __init__(self, exporters: Sequence[MetricExporter], interval_s: float, timeout_s: float) -> None:
        super().__init__(
            FanOutExporter(exporters),
            export_interval_millis=interval_s * 1000 if exporters else math.inf,  # inf: no ticking thread
            export_timeout_millis=timeout_s * 1000,
        )
        self._scraping = threading.local()

    def snapshot(self, timeout_millis: float = 10_000) -> MetricsData | None:
        """Every instrument now (the observable gauges are read), for a scrape; None before the provider is set."""
        self._scraping.data = None
        self._scraping.active = True
        try:
            self.collect(timeout_millis=timeout_millis)
        finally:
            self._scraping.active = False
        data, self._scraping.data = self._scraping.data, None
        return data

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        if getattr(self._scraping, "active", False):
            self._scraping.data = metrics_data
            return
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)


class FanOutExporter(MetricExporter):
    """The same collection to each destination in turn (the control plane first), each bounded by its timeout; one
    failing costs the others nothing. Cumulative temporality (the MetricExporter default), whatever an exporter or
    OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE prefers: the scrape shares the collection."""

    def __init__(self, exporters: Sequence[MetricExporter]) -> None:
        super().__init__()
        self.exporters = list(exporters)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        result = MetricExportResult.SUCCESS
        for exporter in self.exporters:
            try:
                if exporter.export(metrics_data, timeout_millis=timeout_millis) is not MetricExportResult.SUCCESS:
                    result = MetricExportResult.FAILURE  # (the exporter logged why)
            except Exception:  # telemetry never takes the host down
                log.warning("exporting metrics with %s failed", type(exporter).__name__, exc_info=True)
                result = MetricExportResult.FAILURE
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return all([exporter.force_flush(timeout_millis=timeout_millis) for exporter in self.exporters])

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        timeout = kwargs.get("timeout", timeout_millis)  # PeriodicExportingMetricReader passes `timeout`
        for exporter in self.exporters:
            try:
                exporter.shutdown(timeout_millis=timeout)
            except Exception:
                log.warning("closing the %s failed", type(exporter).__name__, exc_info=True)


def otlp_exporters(settings: TelemetrySettings) -> list[MetricExporter]:
    """An exporter per destination (TelemetryConfigError: a grpc destination without the gRPC exporter)."""
    return [exporter(destination, settings.export_timeout_s) for destination in settings.destinations()]


def exporter(destination: OtlpDestination, timeout_s: float) -> MetricExporter:
    headers = dict(destination.headers)
    if destination.protocol == environment.GRPC:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter
        except ImportError:
            raise TelemetryConfigError(
                f"OTLP destination {redacted(destination.endpoint)} uses protocol grpc, which needs the gRPC "
                "exporter: pip install 'spillway[otlp-grpc]' (or use http/protobuf)"
            ) from None
        # (With no headers of its own, the SDK's gRPC exporter reads OTEL_EXPORTER_OTLP_[METRICS_]HEADERS, which
        # are then exactly the ones resolved for it.)
        return GrpcExporter(endpoint=destination.endpoint, headers=headers or None, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    http = OTLPMetricExporter(endpoint=destination.endpoint, headers=headers, timeout=timeout_s)
    _only_these_headers(http, destination, os.environ)
    return http


def _only_these_headers(http: Any, destination: OtlpDestination, env: Mapping[str, str]) -> None:
    """The SDK's HTTP exporter adds OTEL_EXPORTER_OTLP_[METRICS_]HEADERS to the headers it is given, whatever its
    endpoint; a destination gets exactly its own (a collector's API key never goes to the control plane).
    tests/agent/test_otel_env.py fails if an SDK upgrade moves what this reaches into."""
    extra = set(environment.headers(env)) - {key.lower() for key, _ in destination.headers}
    sent = getattr(getattr(http, "_client", None), "_headers", None)
    if extra and not isinstance(sent, dict):
        raise TelemetryConfigError(
            f"this opentelemetry-exporter-otlp-proto-http would send {environment.METRICS_HEADERS} / "
            f"{environment.HEADERS} to {redacted(destination.endpoint)} too, which has headers of its own: unset them"
        )
    for key in extra:
        sent.pop(key, None)  # type: ignore[union-attr]


def describe(settings: TelemetrySettings) -> str:
    """Where the metrics go, for the start-up log line (no headers, no tokens, no user info, queries or fragments)."""
    places = []
    for destination in settings.destinations():
        places.append(f"{redacted(destination.endpoint)} ({destination.protocol})")
    return ", ".join(places)
