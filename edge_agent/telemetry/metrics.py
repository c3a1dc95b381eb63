"""The agent's OpenTelemetry meter provider: instruments named as in ARCHITECTURE.md ("Metric names"), explicit
histogram buckets (so that every SLO latency threshold is a bucket boundary), OTLP/HTTP export that never
blocks or crashes serving (its own thread, bounded timeouts; a failed export is logged and dropped)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from edge_agent import __version__
from edge_agent.telemetry.probes import register_probes
from spillway.contract import names
from spillway.contract.names import DEFAULT_LATENCY_BUCKETS_MS, DURATIONS

log = logging.getLogger("spillway.agent.telemetry")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class TelemetrySettings:
    """Who the agent is and where its metrics go."""

    agent_id: str
    device_class: str = "cpu"
    labels: dict[str, str] = field(default_factory=dict)
    control_plane: str | None = None  # metrics go to <control_plane>/v1/metrics with the agent token
    agent_token: str | None = None
    otlp_endpoints: tuple[str, ...] = ()  # further OTLP/HTTP metrics endpoints (a collector), no token
    export_interval_s: float = 5.0
    export_timeout_s: float = 5.0
    latency_buckets_ms: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS_MS


def resource_for(settings: TelemetrySettings) -> Resource:
    attributes: dict[str, Any] = {
        "service.name": names.SERVICE_NAME,
        "service.version": __version__,
        "service.instance.id": settings.agent_id,
        "host.name": socket.gethostname(),
        names.ATTR_DEVICE_CLASS: settings.device_class,
    }
    attributes.update({f"spillway.label.{key}": value for key, value in settings.labels.items()})
    return Resource.create(attributes)


def otlp_readers(settings: TelemetrySettings) -> list[MetricReader]:
    """One periodic reader per destination, each with the real OTLP/HTTP protobuf exporter."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    destinations: list[tuple[str, dict[str, str]]] = []
    if settings.control_plane:
        headers = {"Authorization": f"Bearer {settings.agent_token}"} if settings.agent_token else {}
        destinations.append((settings.control_plane.rstrip("/") + "/v1/metrics", headers))
    destinations += [(endpoint, {}) for endpoint in settings.otlp_endpoints]
    return [
        PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, headers=headers, timeout=settings.export_timeout_s),
            export_interval_millis=settings.export_interval_s * 1000,
            export_timeout_millis=settings.export_timeout_s * 1000,
        )
        for endpoint, headers in destinations
    ]


class AgentTelemetry:
    """The meter provider and the agent's instruments; `recorder(model, version)` gives each model its hooks."""

    def __init__(
        self, settings: TelemetrySettings, *, readers: Sequence[MetricReader] | None = None, probes: bool = True
    ) -> None:
        buckets_s = tuple(ms / 1000 for ms in sorted(settings.latency_buckets_ms))
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(buckets_s))
                 for name in DURATIONS]  # fmt: skip
        views.append(View(instrument_name=names.BATCH_SIZE,
                          aggregation=ExplicitBucketHistogramAggregation(BATCH_BUCKETS)))  # fmt: skip
        for name, bounds in ((names.GENAI_TTFT, names.GENAI_TTFT_BUCKETS), (names.GENAI_TPOT, names.GENAI_TPOT_BUCKETS),
                             (names.GENAI_REQUEST_DURATION, names.GENAI_DURATION_BUCKETS),
                             (names.GENAI_TOKEN_USAGE, names.GENAI_TOKEN_BUCKETS),
                             (names.STEP_TOKENS, names.STEP_TOKEN_BUCKETS)):  # fmt: skip
            views.append(View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(bounds)))
        all_readers = list(readers) if readers is not None else otlp_readers(settings)
        self.provider = MeterProvider(resource=resource_for(settings), metric_readers=all_readers, views=views)
        meter = self.provider.get_meter("spillway.edge_agent", __version__)
        self.requests = meter.create_counter(names.REQUESTS, unit="{request}", description="requests by outcome")
        self.request_duration = meter.create_histogram(
            names.REQUEST_DURATION, unit="s", description="arrival at the agent to answer"
        )
        self.queue_duration = meter.create_histogram(names.QUEUE_DURATION, unit="s", description="time queued")
        self.compute_duration = meter.create_histogram(
            names.COMPUTE_DURATION, unit="s", description="model run time of the request's batch"
        )
        self.batch_size = meter.create_histogram(names.BATCH_SIZE, unit="{row}", description="rows per batch")
        self._queue_sources: list[Callable[[], Iterable[tuple[dict[str, Any], int]]]] = []
        meter.create_observable_gauge(names.QUEUE_DEPTH, callbacks=[self._observe_queues], unit="{request}",
                                      description="requests queued, per model and priority")  # fmt: skip
        self.policy_refusals = meter.create_counter(
            names.POLICY_REFUSALS, unit="{document}", description="policy documents refused (invalid or unfit)"
        )
        self._policy_source: Callable[[], tuple[int, str]] | None = None
        meter.create_observable_gauge(names.POLICY_VERSION, callbacks=[self._observe_policy], unit="1",
                                      description="version of the active policy document (0: none)")  # fmt: skip
        self.ttft = meter.create_histogram(names.GENAI_TTFT, unit="s", description="time to the first token")
        self.tpot = meter.create_histogram(names.GENAI_TPOT, unit="s", description="time per output token after it")
        self.genai_duration = meter.create_histogram(names.GENAI_REQUEST_DURATION, unit="s",
                                                     description="arrival to the last token")  # fmt: skip
        self.token_usage = meter.create_histogram(names.GENAI_TOKEN_USAGE, unit="{token}",
                                                  description="input and output tokens per request")  # fmt: skip
        self._engine_sources: list[Callable[[], Iterable[tuple[str, dict[str, Any]]]]] = []
        meter.create_observable_gauge(names.KV_BLOCKS_USED, callbacks=[self._observe("used")], unit="{block}",
                                      description="KV-cache blocks held by sequences")  # fmt: skip
        meter.create_observable_gauge(names.KV_BLOCKS_TOTAL, callbacks=[self._observe("total")], unit="{block}",
                                      description="KV-cache blocks of the budget")  # fmt: skip
        self.step_tokens = meter.create_histogram(names.STEP_TOKENS, unit="{token}",
                                                  description="tokens one generation step computed")  # fmt: skip
        meter.create_observable_gauge(names.ACTIVE_STREAMS, callbacks=[self._observe("active")], unit="{sequence}",
                                      description="sequences admitted and not yet finished")  # fmt: skip
        meter.create_observable_counter(names.PREEMPTIONS, callbacks=[self._observe("preemptions")],
                                        unit="{sequence}", description="sequences preempted (recomputed)")  # fmt: skip
        if probes:
            register_probes(meter)
        self._closed = False

    def watch_engines(self, source: Callable[[], Iterable[tuple[str, dict[str, Any]]]]) -> None:
        """`source()` yields (model, engine.json()) pairs when the generative gauges are read."""
        self._engine_sources.append(source)

    def _observe(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for source in self._engine_sources:
                for model, state in source():
                    value = state[key] if key in ("preemptions", "active") else state["kv_blocks"][key]
                    yield Observation(value, {names.ATTR_MODEL: model})

        return observe

    def generation(self, model: str, version: str = "1") -> GenerationRecorder:
        return GenerationRecorder(self, model, version)

    def recorder(self, model: str, version: int) -> ModelRecorder:
        return ModelRecorder(self, model, str(version))

    def watch_queue(self, source: Callable[[], Iterable[tuple[dict[str, Any], int]]]) -> None:
        """`source()` yields (attributes, depth) pairs when the gauge is read."""
        self._queue_sources.append(source)

    def _observe_queues(self, _options: CallbackOptions) -> Iterable[Observation]:
        for source in self._queue_sources:
            for attributes, depth in source():
                yield Observation(depth, attributes)

    def watch_policy(self, source: Callable[[], tuple[int, str]]) -> None:
        """`source()` gives the active policy's (version, source) when the gauge is read."""
        self._policy_source = source

    def _observe_policy(self, _options: CallbackOptions) -> Iterable[Observation]:
        if self._policy_source is not None:
            version, source = self._policy_source()
            yield Observation(version, {"policy.source": source})

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush once and stop; bounded, and safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # telemetry never takes the host down
            log.warning("telemetry shutdown failed", exc_info=True)


class ModelRecorder:
    """One model version's hooks, with its attribute sets built once per (priority, outcome)."""

    def __init__(self, telemetry: AgentTelemetry, model: str, version: str) -> None:
        self.telemetry = telemetry
        self.model, self.version = model, version
        self._attributes: dict[tuple[int, str], dict[str, Any]] = {}
        self._batch_attributes = {names.ATTR_MODEL: model, names.ATTR_VERSION: version}

    def attributes(self, priority: int, outcome: str) -> dict[str, Any]:
        key = (priority, outcome)
        found = self._attributes.get(key)
        if found is None:
            found = {names.ATTR_MODEL: self.model, names.ATTR_VERSION: self.version, names.ATTR_PRIORITY: priority,
                     names.ATTR_OUTCOME: outcome}  # fmt: skip
            self._attributes[key] = found
        return found

    def outcome(self, priority: int, outcome: str) -> None:
        self.telemetry.requests.add(1, self.attributes(priority, outcome))

    def durations(self, priority: int, outcome: str, queue_s: float, compute_s: float, total_s: float) -> None:
        attributes = self.attributes(priority, outcome)
        t = self.telemetry
        t.request_duration.record(total_s, attributes)
        t.queue_duration.record(queue_s, attributes)
        if outcome == names.LOCAL:
            t.compute_duration.record(compute_s, attributes)

    def batch(self, rows: int, compute_s: float, ok: bool) -> None:
        if ok:
            self.telemetry.batch_size.record(rows, self._batch_attributes)


class GenerationRecorder:
    """One generative model's hooks: the GenAI histograms and `spillway.requests`, called from its engine thread
    (the SDK's instruments are thread-safe)."""

    def __init__(self, telemetry: AgentTelemetry, model: str, version: str) -> None:
        self.telemetry = telemetry
        self.model, self.version = model, version

    def step(self, tokens: int) -> None:
        self.telemetry.step_tokens.record(tokens, {names.ATTR_MODEL: self.model})

    def outcome(self, priority: int, outcome: str) -> None:
        self.telemetry.requests.add(1, {names.ATTR_MODEL: self.model, names.ATTR_VERSION: self.version,
                                        names.ATTR_PRIORITY: priority, names.ATTR_OUTCOME: outcome})  # fmt: skip

    def finished(self, priority: int, outcome: str | None, *, operation: str, prompt_tokens: int,
                 completion_tokens: int, ttft_s: float | None, duration_s: float) -> None:  # fmt: skip
        """One stream's end: its outcome in `spillway.requests` (None: counted elsewhere, as an async job is when
        accepted) and its GenAI histograms."""
        if outcome is not None:
            self.outcome(priority, outcome)
        t = self.telemetry
        attributes = {names.ATTR_GENAI_MODEL: self.model, names.ATTR_GENAI_OPERATION: operation}
        t.genai_duration.record(duration_s, attributes)
        if ttft_s is not None:
            t.ttft.record(ttft_s, attributes)
            if completion_tokens > 1:
                t.tpot.record((duration_s - ttft_s) / (completion_tokens - 1), attributes)
        t.token_usage.record(prompt_tokens, {**attributes, names.ATTR_GENAI_TOKEN_TYPE: "input"})
        t.token_usage.record(completion_tokens, {**attributes, names.ATTR_GENAI_TOKEN_TYPE: "output"})
