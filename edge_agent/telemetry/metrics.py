"""The agent's OpenTelemetry meter provider: instruments named as in ARCHITECTURE.md ("Metric names"), explicit
histogram buckets (so that every SLO latency threshold is a bucket boundary), always pulled at `/metrics`
(prometheus.py) and pushed over OTLP to each configured destination (otlp.py), never blocking or crashing serving."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from edge_agent import __version__
from edge_agent.telemetry.otlp import SharedReader, otlp_exporters
from edge_agent.telemetry.probes import register_probes
from edge_agent.telemetry.prometheus import PrometheusExposition
from edge_agent.telemetry.settings import OtlpDestination, TelemetryConfigError, TelemetrySettings
from spillway.contract import names
from spillway.contract.names import DURATIONS
from spillway.contract.tenants import DEFAULT_TENANT

log = logging.getLogger("spillway.agent.telemetry")

BATCH_BUCKETS = names.BATCH_SIZE_BUCKETS

__all__ = ["AgentTelemetry", "GenerationRecorder", "ModelRecorder", "OtlpDestination", "TelemetryConfigError",
           "TelemetrySettings", "resource_for"]  # fmt: skip


def resource_for(settings: TelemetrySettings) -> Resource:
    """The agent's resource: OTEL_RESOURCE_ATTRIBUTES under the agent's own attributes (which win)."""
    attributes: dict[str, Any] = {
        **settings.resource_attributes,
        "service.name": names.SERVICE_NAME,
        "service.version": __version__,
        "service.instance.id": settings.agent_id,
        "host.name": socket.gethostname(),
        names.ATTR_DEVICE_CLASS: settings.device_class,
    }
    attributes.update({f"spillway.label.{key}": value for key, value in settings.labels.items()})
    return Resource.create(attributes)


class AgentTelemetry:
    """The meter provider and the agent's instruments; `recorder(model, version)` gives each model its hooks."""

    def __init__(
        self, settings: TelemetrySettings, *, readers: Sequence[MetricReader] | None = None, probes: bool = True
    ) -> None:
        """Args:
        settings: who the agent is, where the OTLP push goes, the buckets and the interval.
        readers: readers instead of the OTLP push of `settings` (tests: an in-memory reader); `/metrics` is always
            there.
        probes: the host and GPU gauges.
        """
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
        exporters = otlp_exporters(settings) if readers is None else []
        self.reader = SharedReader(exporters, settings.export_interval_s, settings.export_timeout_s)
        self._export_timeout_s = settings.export_timeout_s
        self.exposition = PrometheusExposition(self.reader.snapshot)
        self.provider = MeterProvider(resource=resource_for(settings), metric_readers=[self.reader, *(readers or ())],
                                      views=views)  # fmt: skip
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
        meter.create_observable_gauge(names.POLICY_VERSION, callbacks=[self._observe_policy], unit="{version}",
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
        # A request's tenant as its attribute says it: the tenants registry's `label` (a known tenant, `default` or
        # `other`), so the attribute's values stay bounded whatever names come and go.
        self.tenant_label: Callable[[str], str] = _as_is
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
            yield Observation(version, {names.ATTR_POLICY_SOURCE: source})

    def metrics_text(self) -> tuple[bytes, str]:
        """`GET /metrics`: the Prometheus text of every instrument now, and its content type."""
        return self.exposition.text()

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush once and stop; bounded (by default by the export timeout and a second: the last export gets the time
        any export gets), and safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.provider.shutdown(
                timeout_millis=(self._export_timeout_s + 1 if timeout_s is None else timeout_s) * 1000
            )
            self.exposition.close()
        except Exception:  # telemetry never takes the host down
            log.warning("telemetry shutdown failed", exc_info=True)


def _as_is(name: str) -> str:
    return name


class ModelRecorder:
    """One model version's hooks, with its attribute sets built once per (priority, outcome, tenant)."""

    def __init__(self, telemetry: AgentTelemetry, model: str, version: str) -> None:
        self.telemetry = telemetry
        self.model, self.version = model, version
        self._attributes: dict[tuple[int, str, str], dict[str, Any]] = {}
        self._batch_attributes = {names.ATTR_MODEL: model, names.ATTR_VERSION: version}

    def attributes(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        key = (priority, outcome, self.telemetry.tenant_label(tenant))
        found = self._attributes.get(key)
        if found is None:
            found = {names.ATTR_MODEL: self.model, names.ATTR_VERSION: self.version, names.ATTR_PRIORITY: priority,
                     names.ATTR_OUTCOME: outcome, names.ATTR_TENANT: key[2]}  # fmt: skip
            self._attributes[key] = found
        return found

    def outcome(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> None:
        self.telemetry.requests.add(1, self.attributes(priority, outcome, tenant))

    def durations(self, priority: int, outcome: str, queue_s: float, compute_s: float, total_s: float,
                  tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        attributes = self.attributes(priority, outcome, tenant)
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

    def outcome(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> None:
        self.telemetry.requests.add(1, {names.ATTR_MODEL: self.model, names.ATTR_VERSION: self.version,
                                        names.ATTR_PRIORITY: priority, names.ATTR_OUTCOME: outcome,
                                        names.ATTR_TENANT: self.telemetry.tenant_label(tenant)})  # fmt: skip

    def finished(self, priority: int, outcome: str | None, *, operation: str, prompt_tokens: int,
                 completion_tokens: int, ttft_s: float | None, duration_s: float,
                 tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        """One stream's end: its outcome in `spillway.requests` (None: counted elsewhere, as an async job is when
        accepted) and its GenAI histograms, each with the request's tenant."""
        if outcome is not None:
            self.outcome(priority, outcome, tenant)
        t = self.telemetry
        attributes = {names.ATTR_GENAI_MODEL: self.model, names.ATTR_GENAI_OPERATION: operation,
                      names.ATTR_TENANT: t.tenant_label(tenant)}  # fmt: skip
        t.genai_duration.record(duration_s, attributes)
        if ttft_s is not None:
            t.ttft.record(ttft_s, attributes)
            if completion_tokens > 1:
                t.tpot.record((duration_s - ttft_s) / (completion_tokens - 1), attributes)
        t.token_usage.record(prompt_tokens, {**attributes, names.ATTR_GENAI_TOKEN_TYPE: "input"})
        t.token_usage.record(completion_tokens, {**attributes, names.ATTR_GENAI_TOKEN_TYPE: "output"})
