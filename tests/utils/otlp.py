"""OTLP exports built by hand (no SDK): an agent's cumulative `spillway.requests` and `spillway.request.duration`,
whose stored totals a test can predict exactly."""

from __future__ import annotations

import time

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from spillway.contract import names

BOUNDS_S = [b / 1000 for b in names.DEFAULT_LATENCY_BUCKETS_MS]


def _attrs(**values: str | int) -> list[KeyValue]:
    return [
        KeyValue(key=k, value=AnyValue(int_value=v) if isinstance(v, int) else AnyValue(string_value=v))
        for k, v in values.items()
    ]


def _series(outcome: str) -> list[KeyValue]:
    return _attrs(**{names.ATTR_MODEL: "mlp", names.ATTR_PRIORITY: 1, names.ATTR_OUTCOME: outcome})


def cumulative_export(agent_id: str, start_ns: int, k: int) -> bytes:
    """The k-th cumulative export of an agent (k from 1) in the run begun at `start_ns`: 3k requests served and k
    refused (`spillway.requests`: 4k in all), 2k request durations (`spillway.request.duration`'s count)."""
    message = ExportMetricsServiceRequest()
    resource = message.resource_metrics.add()
    resource.resource.attributes.extend(_attrs(**{"service.instance.id": agent_id}))
    metrics = resource.scope_metrics.add().metrics
    now = time.time_ns()
    requests = metrics.add(name=names.REQUESTS, unit="{request}")
    requests.sum.aggregation_temporality = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    requests.sum.is_monotonic = True
    for outcome, value in (("local", 3 * k), ("rejected", k)):
        point = requests.sum.data_points.add(start_time_unix_nano=start_ns, time_unix_nano=now, as_int=value)
        point.attributes.extend(_series(outcome))
    duration = metrics.add(name=names.REQUEST_DURATION, unit="s")
    duration.histogram.aggregation_temporality = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    buckets = [0] * (len(BOUNDS_S) + 1)
    buckets[2], buckets[5] = k, k
    point = duration.histogram.data_points.add(
        start_time_unix_nano=start_ns, time_unix_nano=now, count=2 * k, sum=0.053 * k, bucket_counts=buckets,
        explicit_bounds=BOUNDS_S,
    )  # fmt: skip
    point.attributes.extend(_series("local"))
    return message.SerializeToString()
