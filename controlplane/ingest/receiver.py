"""OTLP metrics in, minute rollups out: decode, check the sender, rename legacy metric and attribute names
(`attributes`), bring histograms onto the bounds the control plane reads them on (`bounds`), convert cumulative
streams to deltas, and add each minute's deltas (and gauge samples) to the database.

Refusals of part of the data (unsupported metric types, malformed points, histograms on bounds that cannot be
re-bucketed exactly, series beyond an agent's cardinality limit) are counted and reported back through OTLP's
`partial_success`; nothing else is ever dropped silently.

The tenant of a point (`spillway.tenant`, on the request metrics) is kept as one of its attributes, so a tenant's
series are series of their own. The agent bounds it (its configured tenants, `default` and `other`); the control
plane bounds it again, per agent: a tenant that is not a tenant name (the contract's NAME_PATTERN), or a new one
beyond `max_tenants_per_agent` distinct names since this process started, is stored as `other`. A point without
the attribute (an agent from before tenants) is stored as sent and read as tenant `default` (`query.tenant_of`).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import MetricRollup
from controlplane.errors import Forbidden, UndecodableMetrics, UnsupportedMediaType
from controlplane.ingest.attributes import current_metric, current_names, layout_key, series_key
from controlplane.ingest.bounds import Fit, Layouts
from controlplane.ingest.deltas import DeltaTracker, Point
from controlplane.ingest.store import add_rollups, mark_seen
from spillway.contract.names import ATTR_TENANT, DEFAULT_LATENCY_BUCKETS_MS
from spillway.contract.tenants import DEFAULT_TENANT, MAX_TENANTS, NAME_PATTERN, OTHER_TENANT

CUMULATIVE = 2
_SERIES_CACHE_SIZE = 100_000  # (metric, attributes as sent) -> series key; cleared when it grows past this
_LOGGED_KEPT = 10_000  # (agent, reason) refusals logged once; forgotten (logged again) past this
_REASONS_SAID = 20  # distinct reasons in one answer's partial_success.error_message, at most
_TENANT_NAME = re.compile(NAME_PATTERN)
_ALWAYS_TENANTS = frozenset({DEFAULT_TENANT, OTHER_TENANT})  # never counted against the cap
log = logging.getLogger("spillway.controlplane")


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


@dataclass(frozen=True, slots=True)
class _Series:
    """A point's series (its metric and attributes: what the cardinality limit counts), the `series` column of its
    rows (a histogram's: with its layout, `layout_key`) and its attributes under the current names."""

    series: str
    row: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    rejected: int
    message: str = ""


@dataclass(eq=False)
class _Pending:
    """One export's rows, waiting to be written; `done` once its transaction ended (`error` if it failed)."""

    agent_id: str
    rows: list[dict[str, Any]]
    done: bool = False
    error: BaseException | None = None


class Ingestor:
    """One per control-plane process; thread-safe (routes run in a thread pool).

    Exports are folded one at a time, in arrival order, and written with group commit: an export that finds
    no write running writes every export queued so far in one transaction, the others wait for the write that
    holds theirs. So an answer still means "stored", exports of one agent are written in the order they were
    folded, and a busy control plane pays one commit (one fsync) for many exports instead of one each.
    """

    def __init__(self, factory: sessionmaker[Session], *, max_series_per_agent: int = 10_000,
                 latency_buckets_ms: Iterable[float] = DEFAULT_LATENCY_BUCKETS_MS,
                 max_tenants_per_agent: int = MAX_TENANTS) -> None:  # fmt: skip
        self.factory = factory
        self.max_series_per_agent = max_series_per_agent
        self.max_tenants_per_agent = max_tenants_per_agent  # beyond: `other` (an agent may configure MAX_TENANTS)
        self.layouts = Layouts(latency_buckets_ms)  # the histograms' bounds, as the agents' policies set them
        # Runs begun before this process started may have been counted by its predecessor: a baseline each.
        self.tracker = DeltaTracker(horizon_ns=time.time_ns())
        self._known: dict[str, set[str]] = defaultdict(set)
        # agent -> the tenant names kept as they came (`default` and `other` always, beside the capped ones)
        self._tenants: dict[str, set[str]] = defaultdict(lambda: set(_ALWAYS_TENANTS))
        self._as_other: dict[str, _Series] = {}  # a row key -> the same series with tenant `other`
        # The series key, row key and attributes (legacy names renamed) of each attribute list (and histogram layout)
        # as sent: agents send the same few hundred again every export, so hashing them once saves most of the
        # per-point work. Keyed by the protobuf encoding of each attribute, which determines the decoded
        # attributes, so a hit is exactly what a miss computes.
        self._series_cache: dict[tuple[str, tuple[bytes, ...], tuple[float, ...] | None], _Series] = {}
        self._logged: set[tuple[str, str]] = set()  # (agent, refusal reason) logged once
        self._lock = threading.Lock()  # the tracker, the series sets, the write queue
        self._written = threading.Condition(self._lock)  # notified when a write ends
        self._queue: list[_Pending] = []  # folded, not yet being written
        self._writing = False

    def _series(self, metric: str, pairs: Any, bounds: tuple[float, ...] | None) -> _Series:
        """The series of a point (a histogram's on the bounds it is stored on: its rows are keyed by them too)."""
        key = (metric, tuple(kv.SerializeToString() for kv in pairs), bounds)
        found = self._series_cache.get(key)
        if found is None:
            attributes = current_names(_attributes(pairs))
            series = series_key(metric, attributes)
            found = _Series(series, series if bounds is None else layout_key(series, bounds), attributes)
            if len(self._series_cache) >= _SERIES_CACHE_SIZE:
                self._series_cache.clear()
            self._series_cache[key] = found
        return found

    def _tenant(self, tenants: set[str], tenant: Any, found: _Series, metric: str, fit: Fit | None) -> _Series:
        """A point's series with a tenant this agent has not sent before (under the lock): kept as it came while
        the agent's distinct tenants stay within the cap and it is a tenant name, else the series of tenant
        `other`."""
        room = len(tenants) < self.max_tenants_per_agent + len(_ALWAYS_TENANTS)
        if room and isinstance(tenant, str) and _TENANT_NAME.fullmatch(tenant):
            tenants.add(tenant)
            return found
        other = self._as_other.get(found.row)
        if other is None:
            attributes = {**found.attributes, ATTR_TENANT: OTHER_TENANT}
            series = series_key(metric, attributes)
            other = _Series(series, series if fit is None else layout_key(series, fit.bounds), attributes)
            if len(self._as_other) >= _SERIES_CACHE_SIZE:
                self._as_other.clear()
            self._as_other[found.row] = other
        return other

    def ingest(self, agent_id: str, message: ExportMetricsServiceRequest) -> IngestResult:
        for resource_metrics in message.resource_metrics:
            sender = _attributes(resource_metrics.resource.attributes).get("service.instance.id")
            if sender != agent_id:
                raise Forbidden(f"resource service.instance.id '{sender}' is not this token's agent '{agent_id}'")
        rollups: dict[tuple[str, datetime], _Rollup] = {}
        accepted = rejected = 0
        reasons: set[str] = set()
        with self._lock:
            known, tenants = self._known[agent_id], self._tenants[agent_id]
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
                        name = current_metric(metric.name)
                        for dp in data.data_points:
                            problem = _malformed(kind, dp)
                            if problem is not None:
                                rejected += 1
                                reasons.add(f"{problem} ({metric.name})")
                                continue
                            fit = None
                            if kind == "histogram":
                                fit = self.layouts.fit(name, metric.unit, tuple(dp.explicit_bounds))
                                if fit.problem is not None:
                                    rejected += 1
                                    reasons.add(fit.problem)
                                    continue
                            found = stream = self._series(name, dp.attributes, None if fit is None else fit.bounds)
                            tenant = found.attributes.get(ATTR_TENANT)
                            if tenant is not None and (not isinstance(tenant, str) or tenant not in tenants):
                                found = self._tenant(tenants, tenant, found, name, fit)
                            series = found.series
                            if series not in known and len(known) >= self.max_series_per_agent:
                                rejected += 1
                                reasons.add(f"cardinality limit of {self.max_series_per_agent} series per agent")
                                continue
                            known.add(series)
                            accepted += 1
                            # A cumulative stream's deltas are its own (tenants folded into `other` each keep theirs)
                            self._fold(rollups, (agent_id, stream.row), found.row, name, kind, found.attributes, dp,
                                       cumulative, fit)  # fmt: skip
            said = sorted(reasons)[:_REASONS_SAID]  # each refused layout is a reason: an export may bring many
            more = f"; and {len(reasons) - len(said)} more" if len(reasons) > len(said) else ""
            result = IngestResult(accepted, rejected, "; ".join(said) + more)
            fresh = self._not_yet_logged(agent_id, said)
            pending = _Pending(agent_id, _rows(agent_id, rollups)) if rollups else None
            if pending is not None:
                self._queue.append(pending)  # under the lock that folded it: the queue is in fold order
        for reason in fresh:  # an SDK's exporter may not show partial_success to anyone: the operator sees this
            log.warning("agent %s: data points refused (answered in partial_success): %s", agent_id, reason)
        if pending is not None:
            self._store(pending)
        return result

    def _not_yet_logged(self, agent_id: str, reasons: list[str]) -> list[str]:
        """The reasons not logged for this agent yet (remembered up to a bound, then each is logged again)."""
        fresh = sorted(reason for reason in reasons if (agent_id, reason) not in self._logged)
        if len(self._logged) + len(fresh) > _LOGGED_KEPT:
            self._logged.clear()
        self._logged.update((agent_id, reason) for reason in fresh)
        return fresh

    def _store(self, pending: _Pending) -> None:
        """Wait until `pending` is written; when no write is running, write everything queued (group commit)."""
        with self._lock:
            while self._writing and not pending.done:
                self._written.wait()
            batch = None
            if not pending.done:  # nobody took it: it is in the queue, and this thread writes the queue
                batch, self._queue, self._writing = self._queue, [], True
        if batch is not None:
            try:
                self._write(batch)
            finally:
                with self._lock:
                    self._writing = False
                    self._written.notify_all()
        if pending.error is not None:
            raise pending.error

    def _fold(self, rollups: dict[tuple[str, datetime], _Rollup], stream: tuple[str, str], series: str, name: str,
              kind: str, attributes: dict[str, Any], dp: Any, cumulative: bool, fit: Fit | None) -> None:  # fmt: skip
        """Add a point of `stream` (agent, the row key of its series as sent) to its minute's rollup in row `series`
        (a histogram's on the bounds `fit` stores it on)."""
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
            point = Point(stream, "sum", dp.start_time_unix_nano, dp.time_unix_nano, value=value,
                          cumulative=cumulative)  # fmt: skip
        else:
            assert fit is not None
            point = Point(stream, "histogram", dp.start_time_unix_nano, dp.time_unix_nano,
                          count=dp.count, total=dp.sum, buckets=fit.buckets(dp.bucket_counts), bounds=fit.bounds,
                          cumulative=cumulative)  # fmt: skip
        delta = self.tracker.delta(point)
        if delta is None:
            return
        roll = rollups.setdefault(key, _Rollup(name, attributes, kind, bounds=list(delta.bounds)))
        if kind == "sum":
            roll.total += delta.value
            return
        roll.count += delta.count  # (on the row's bounds: a histogram's row key includes its layout)
        roll.total += delta.total
        roll.buckets = (
            [a + b for a, b in zip(roll.buckets, delta.buckets, strict=True)] if roll.buckets else list(delta.buckets)
        )

    def _write(self, batch: list[_Pending]) -> None:
        """Store a batch in one transaction; if that fails, each export alone, so one bad export fails alone."""
        try:
            try:
                self._transaction(batch)
            except Exception as exc:
                if len(batch) == 1:
                    batch[0].error = exc
                    return
                for pending in batch:
                    try:
                        self._transaction([pending])
                    except Exception as alone:
                        pending.error = alone
            except BaseException as exc:  # the interpreter is stopping: nobody in the batch hears "stored"
                for pending in batch:
                    pending.error = exc
                raise
        finally:
            for pending in batch:
                pending.done = True

    def _transaction(self, batch: list[_Pending]) -> None:
        """Add the exports' rollups to the stored ones, export after export, and note the agents as seen.

        Each export's rows are sorted by key and the agents' rows are updated last, in one statement, so that
        two transactions (replicas on PostgreSQL) take their locks in the same order.
        """
        with self.factory() as session, session.begin():
            conn = session.connection()
            for pending in batch:
                add_rollups(conn, pending.rows)
            mark_seen(conn, {pending.agent_id for pending in batch})


def _rows(agent_id: str, rollups: dict[tuple[str, datetime], _Rollup]) -> list[dict[str, Any]]:
    return [
        {"agent_id": agent_id, "series": series, "minute": minute, "metric": roll.metric,
         "attributes": roll.attributes, "kind": roll.kind, "count": roll.count, "total": roll.total,
         "buckets": roll.buckets, "bounds": roll.bounds, "last": roll.last, "min": roll.min, "max": roll.max}
        for (series, minute), roll in sorted(rollups.items(), key=lambda item: item[0])
    ]  # fmt: skip


def _malformed(kind: str, dp: Any) -> str | None:
    """Why a data point cannot be stored faithfully (refused through partial_success), or None."""
    if kind in ("gauge", "sum"):
        value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
        return None if math.isfinite(value) else "a non-finite value"
    bounds, counts = dp.explicit_bounds, dp.bucket_counts
    if counts and len(counts) != len(bounds) + 1:
        return f"{len(counts)} bucket counts for {len(bounds)} explicit bounds (need one more)"
    if not all(math.isfinite(b) for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
        return "explicit bounds that are not finite and increasing"
    if not math.isfinite(dp.sum):
        return "a non-finite sum"
    return None


__all__ = ["IngestResult", "Ingestor", "decode", "prune", "series_key"]
