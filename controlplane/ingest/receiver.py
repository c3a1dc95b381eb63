"""OTLP metrics in, minute rollups out: decode, check the sender, convert cumulative streams to deltas, and
add each minute's deltas (and gauge samples) to the database.

Refusals of part of the data (unsupported metric types, series beyond an agent's cardinality limit) are
counted and reported back through OTLP's `partial_success`; nothing else is ever dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import Agent, MetricRollup, utcnow
from controlplane.errors import Forbidden, UndecodableMetrics, UnsupportedMediaType
from controlplane.ingest.deltas import DeltaTracker, Point

CUMULATIVE = 2


def prune(session: Session, older_than: datetime) -> int:
    """Delete rollups of minutes before `older_than` (retention); returns how many went."""
    result = session.execute(delete(MetricRollup).where(MetricRollup.minute < older_than))
    return int(getattr(result, "rowcount", 0) or 0)


def decode(body: bytes, content_type: str, content_encoding: str, max_bytes: int) -> ExportMetricsServiceRequest:
    """OTLP/HTTP protobuf or JSON, optionally gzip; a gzip bomb is cut at `max_bytes` decompressed."""
    if content_encoding.strip().lower() == "gzip":
        try:
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            body = inflater.decompress(body, max_bytes + 1)
        except zlib.error as exc:
            raise UndecodableMetrics(f"the body is not valid gzip: {exc}") from None
        if len(body) > max_bytes:
            raise UndecodableMetrics(f"the body inflates to more than {max_bytes} bytes")
    elif content_encoding.strip() not in ("", "identity"):
        raise UnsupportedMediaType(f"content encoding '{content_encoding}' is not supported; use gzip or none")
    message = ExportMetricsServiceRequest()
    media = content_type.split(";")[0].strip().lower()
    try:
        if media == "application/x-protobuf":
            message.ParseFromString(body)
        elif media == "application/json":
            json_format.Parse(body.decode("utf-8"), message, ignore_unknown_fields=True)
        else:
            raise UnsupportedMediaType(f"content type '{media}' is not OTLP: use application/x-protobuf or json")
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
        raise UndecodableMetrics(f"the body is not an OTLP metrics export: {exc}") from None
    return message


def _value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind in ("array_value", "kvlist_value", "bytes_value"):
        return json_format.MessageToDict(any_value)
    return getattr(any_value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _minute(time_unix_nano: int) -> datetime:
    seconds = time_unix_nano // 1_000_000_000
    return datetime.fromtimestamp(seconds - seconds % 60, tz=timezone.utc)


@dataclass
class _Rollup:
    metric: str
    attributes: dict[str, Any]
    kind: str
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=list)
    bounds: list[float] = field(default_factory=list)
    last: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    rejected: int
    message: str = ""


class Ingestor:
    """One per control-plane process; thread-safe (routes run in a thread pool)."""

    def __init__(self, factory: sessionmaker[Session], *, max_series_per_agent: int = 10_000) -> None:
        self.factory = factory
        self.max_series_per_agent = max_series_per_agent
        self.tracker = DeltaTracker()
        self._series: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def ingest(self, agent_id: str, message: ExportMetricsServiceRequest) -> IngestResult:
        for resource_metrics in message.resource_metrics:
            sender = _attributes(resource_metrics.resource.attributes).get("service.instance.id")
            if sender != agent_id:
                raise Forbidden(f"resource service.instance.id '{sender}' is not this token's agent '{agent_id}'")
        rollups: dict[tuple[str, datetime], _Rollup] = {}
        accepted = rejected = 0
        reasons: set[str] = set()
        with self._lock:
            known = self._series[agent_id]
            for resource_metrics in message.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        kind = metric.WhichOneof("data")
                        if kind not in ("sum", "gauge", "histogram"):
                            points = len(getattr(metric, kind).data_points) if kind else 0
                            rejected += points
                            reasons.add(f"metric type {kind} is not supported ({metric.name})")
                            continue
                        data = getattr(metric, kind)
                        cumulative = getattr(data, "aggregation_temporality", 0) == CUMULATIVE
                        for dp in data.data_points:
                            attributes = _attributes(dp.attributes)
                            series = hashlib.sha256(
                                json.dumps([metric.name, attributes], sort_keys=True, default=str).encode()
                            ).hexdigest()
                            if series not in known and len(known) >= self.max_series_per_agent:
                                rejected += 1
                                reasons.add(f"cardinality limit of {self.max_series_per_agent} series per agent")
                                continue
                            known.add(series)
                            accepted += 1
                            self._fold(rollups, agent_id, series, metric.name, kind, attributes, dp, cumulative)
            if rollups:
                self._write(agent_id, rollups)
        return IngestResult(accepted, rejected, "; ".join(sorted(reasons)))

    def _fold(self, rollups: dict[tuple[str, datetime], _Rollup], agent_id: str, series: str, name: str, kind: str,
              attributes: dict[str, Any], dp: Any, cumulative: bool) -> None:  # fmt: skip
        key = (series, _minute(dp.time_unix_nano))
        if kind == "gauge":
            value = float(dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int)
            roll = rollups.setdefault(key, _Rollup(name, attributes, "gauge"))
            roll.count += 1
            roll.total += value
            roll.last = value
            roll.min = value if roll.min is None else min(roll.min, value)
            roll.max = value if roll.max is None else max(roll.max, value)
            return
        if kind == "sum":
            value = float(dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int)
            point = Point((agent_id, series), "sum", dp.start_time_unix_nano, dp.time_unix_nano, value=value,
                          cumulative=cumulative)  # fmt: skip
        else:
            point = Point((agent_id, series), "histogram", dp.start_time_unix_nano, dp.time_unix_nano,
                          count=dp.count, total=dp.sum, buckets=tuple(dp.bucket_counts),
                          bounds=tuple(dp.explicit_bounds), cumulative=cumulative)  # fmt: skip
        delta = self.tracker.delta(point)
        if delta is None:
            return
        roll = rollups.setdefault(key, _Rollup(name, attributes, kind, bounds=list(delta.bounds)))
        if kind == "sum":
            roll.total += delta.value
            return
        if roll.bounds != list(delta.bounds):
            return  # a layout change inside one minute: keep the first layout's data for this minute
        roll.count += delta.count
        roll.total += delta.total
        roll.buckets = (
            [a + b for a, b in zip(roll.buckets, delta.buckets, strict=True)] if roll.buckets else list(delta.buckets)
        )

    def _write(self, agent_id: str, rollups: dict[tuple[str, datetime], _Rollup]) -> None:
        with self.factory() as session, session.begin():
            series = {s for s, _ in rollups}
            minutes = {m for _, m in rollups}
            existing = {
                (row.series, row.minute): row
                for row in session.scalars(
                    select(MetricRollup)
                    .where(MetricRollup.agent_id == agent_id, MetricRollup.series.in_(series),
                           MetricRollup.minute.in_(minutes))
                    .with_for_update()
                )
            }  # fmt: skip
            for (series_key, minute), roll in rollups.items():
                row = existing.get((series_key, minute))
                if row is None:
                    session.add(MetricRollup(agent_id=agent_id, series=series_key, minute=minute, **asdict(roll)))
                    continue
                row.count += roll.count
                row.total += roll.total
                if roll.buckets and len(row.buckets) == len(roll.buckets):
                    row.buckets = [a + b for a, b in zip(row.buckets, roll.buckets, strict=True)]
                elif roll.buckets and not row.buckets:
                    row.buckets = roll.buckets
                if roll.kind == "gauge":
                    row.last = roll.last
                    row.min = roll.min if row.min is None or roll.min is None else min(row.min, roll.min)
                    row.max = roll.max if row.max is None or roll.max is None else max(row.max, roll.max)
            session.execute(update(Agent).where(Agent.id == agent_id).values(last_seen=utcnow()))


__all__ = ["IngestResult", "Ingestor", "decode", "prune"]
