"""One agent's recent telemetry read back from its minute rollups: request rates and outcome mix, latency
percentiles, queue and compute times, batch sizes, queue depths and device gauges.

Histograms keep OTLP's explicit-bucket layout (bucket i holds (bounds[i-1], bounds[i]], the last one is +Inf).
Percentiles are estimated like Prometheus' `histogram_quantile`: linear interpolation inside the bucket that holds
the rank, so an estimate is always within the bucket of the true value. Rollups of one metric with different
layouts (the agent's buckets changed) are merged exactly onto the boundaries they share.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, MetricRollup, utcnow
from controlplane.errors import NotFound, ValidationFailed
from spillway.contract.names import (
    BATCH_SIZE,
    COMPUTE_DURATION,
    QUEUE_DEPTH,
    QUEUE_DURATION,
    REQUEST_DURATION,
    REQUESTS,
)
from spillway.contract.names import DURATIONS as _DURATIONS
from spillway.contract.names import LOCAL as SERVED

"""Latency, queue and compute times are those of requests the device served itself, as the latency SLI counts
them: a request refused after waiting (a deadline that passed in the queue) would otherwise read as a slow one."""

MIN_WINDOW_S = 60


def histogram_quantile(buckets: Sequence[float], bounds: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of explicit-bucket counts, as Prometheus' `histogram_quantile` estimates it.

    Args:
        buckets: per-bucket (not cumulative) counts, `len(bounds) + 1` of them; the last is the +Inf bucket.
        bounds: the finite upper bounds, increasing.
        q: the quantile.

    Returns:
        None without observations or without a finite bound; the highest finite bound when the rank falls in the
        +Inf bucket; the upper bound of the first bucket when it is not above 0; otherwise the rank's position
        interpolated linearly inside its bucket (the first bucket starting at 0).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is not between 0 and 1")
    if len(buckets) != len(bounds) + 1:
        raise ValueError(f"{len(buckets)} bucket counts do not fit {len(bounds)} bounds (need one more)")
    total = float(sum(buckets))
    if total <= 0 or not bounds:
        return None
    rank = q * total
    index, cumulative = 0, 0.0  # the first finite bucket whose cumulative count reaches the rank, else +Inf
    while index < len(bounds) and cumulative + buckets[index] < rank:
        cumulative += buckets[index]
        index += 1
    if index == len(bounds):
        return float(bounds[-1])
    upper = float(bounds[index])
    if index == 0 and upper <= 0:
        return upper
    lower = float(bounds[index - 1]) if index > 0 else 0.0
    count = float(buckets[index])
    if count <= 0:
        return lower
    return lower + (upper - lower) * (rank - cumulative) / count


@dataclass(frozen=True)
class Histogram:
    """Explicit-bucket counts with their finite upper bounds, observation count and sum."""

    bounds: tuple[float, ...]
    buckets: tuple[float, ...]
    count: float
    total: float

    @classmethod
    def of(cls, bounds: Any, buckets: Any, count: Any, total: Any) -> Histogram | None:
        """A checked histogram from stored values, or None when they are not a well-formed layout."""
        try:
            b = tuple(float(v) for v in bounds)
            c = tuple(float(v) for v in buckets)
        except (TypeError, ValueError):
            return None
        well_formed = (
            len(c) == len(b) + 1
            and all(math.isfinite(v) for v in b)
            and all(x < y for x, y in pairwise(b))
            and all(math.isfinite(v) and v >= 0 for v in c)
        )
        return cls(b, c, float(count or 0), float(total or 0.0)) if well_formed else None

    def onto(self, bounds: tuple[float, ...]) -> Histogram:
        """The same observations on coarser `bounds`, a subset of this layout's: exact, no interpolation."""
        buckets = [0.0] * (len(bounds) + 1)
        for upper, count in zip((*self.bounds, math.inf), self.buckets, strict=True):
            buckets[bisect_left(bounds, upper)] += count
        return Histogram(bounds, tuple(buckets), self.count, self.total)

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(self.buckets, self.bounds, q)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


def merge_histograms(histograms: Iterable[Histogram]) -> Histogram | None:
    """One histogram of all observations, on the boundaries every layout shares (exact); None for none."""
    items = list(histograms)
    if not items:
        return None
    shared = set(items[0].bounds).intersection(*(h.bounds for h in items[1:]))
    bounds = tuple(sorted(shared))
    buckets = [0.0] * (len(bounds) + 1)
    for histogram in items:
        rebased = histogram if histogram.bounds == bounds else histogram.onto(bounds)
        buckets = [a + b for a, b in zip(buckets, rebased.buckets, strict=True)]
    return Histogram(bounds, tuple(buckets), sum(h.count for h in items), sum(h.total for h in items))


class _Layouts:
    """Histogram rows summed per bucket layout, merged at the end."""

    def __init__(self) -> None:
        self.by_bounds: dict[tuple[float, ...], Histogram] = {}

    def add(self, histogram: Histogram) -> None:
        seen = self.by_bounds.get(histogram.bounds)
        if seen is not None:
            histogram = Histogram(
                seen.bounds,
                tuple(a + b for a, b in zip(seen.buckets, histogram.buckets, strict=True)),
                seen.count + histogram.count,
                seen.total + histogram.total,
            )
        self.by_bounds[histogram.bounds] = histogram

    def merged(self) -> Histogram | None:
        return merge_histograms(self.by_bounds.values())


@dataclass
class _Traffic:
    """One (model, priority) of an agent."""

    versions: set[str] = field(default_factory=set)
    outcomes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    durations: dict[str, _Layouts] = field(default_factory=lambda: defaultdict(_Layouts))
    depth_by_minute: dict[datetime, list[float]] = field(default_factory=dict)  # minute -> [sum of last, of max]


@dataclass
class _Gauge:
    metric: str
    attributes: dict[str, Any]
    last: float | None = None
    at: datetime | None = None
    min: float | None = None
    max: float | None = None


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _plain(value: Any) -> Any:
    """Attribute values as JSON can carry them (NaN and Infinity, which an exporter may send, as strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _priority(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _model(value: Any) -> str | None:
    return None if value is None else str(value)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else _finite(seconds * 1000.0)


def window_start(now: datetime, window_s: int) -> datetime:
    """The start of the minute that holds `now - window`: the window widened to whole minute rollups."""
    start = now - timedelta(seconds=window_s)
    return start.replace(second=0, microsecond=0)


def read_rollups(session: Session, agent_id: str, since: datetime) -> Iterable[Any]:
    """The agent's rollups this summary reads (its request metrics and every gauge), streamed."""
    columns = (MetricRollup.metric, MetricRollup.kind, MetricRollup.attributes, MetricRollup.minute,
               MetricRollup.count, MetricRollup.total, MetricRollup.buckets, MetricRollup.bounds,
               MetricRollup.last, MetricRollup.min, MetricRollup.max)  # fmt: skip
    query = select(*columns).where(
        MetricRollup.agent_id == agent_id,
        MetricRollup.minute >= since,
        or_(MetricRollup.metric.in_((REQUESTS, *_DURATIONS, BATCH_SIZE)), MetricRollup.kind == "gauge"),
    )
    return session.execute(query.execution_options(yield_per=2000))


def summarise(rows: Iterable[Any], *, since: datetime, until: datetime) -> dict[str, Any]:
    """The summary of `rows` (minute rollups from `since` to `until`); pure, so it is checked without a database."""
    traffic: dict[tuple[str | None, int | None], _Traffic] = defaultdict(_Traffic)
    batches: dict[str | None, _Layouts] = defaultdict(_Layouts)
    gauges: dict[tuple[str, str], _Gauge] = {}
    for row in rows:
        attributes = row.attributes if isinstance(row.attributes, dict) else {}
        model = _model(attributes.get("model"))
        if row.metric == BATCH_SIZE and row.kind == "histogram":
            histogram = Histogram.of(row.bounds, row.buckets, row.count, row.total)
            if histogram is not None:  # a malformed layout gives nothing to estimate from
                batches[model].add(histogram)
            continue
        if row.kind == "gauge" and not row.metric.startswith("spillway."):
            _fold_gauge(gauges, row, attributes)
            continue
        group = _fold_traffic(traffic, row, attributes)
        if group is not None and "model.version" in attributes:
            group.versions.add(str(attributes["model.version"]))
    seconds = max((until - since).total_seconds(), 1.0)
    outcomes: dict[str, float] = defaultdict(float)
    for group in traffic.values():
        for outcome, n in group.outcomes.items():
            outcomes[outcome] += n
    requests = sum(outcomes.values())
    return {
        "since": since,
        "until": until,
        "requests": requests,
        "rps": requests / seconds,
        "outcomes": dict(sorted(outcomes.items())),
        "traffic": [_traffic(key, traffic[key], seconds) for key in sorted(traffic, key=_order)],
        "batches": [_batches(model, batches[model]) for model in sorted(batches, key=lambda m: m or "")],
        "device": [_gauge(g) for _, g in sorted(gauges.items())],
    }


def _fold_traffic(
    traffic: dict[tuple[str | None, int | None], _Traffic], row: Any, attributes: dict[str, Any]
) -> _Traffic | None:
    """Adds a request, duration or queue-depth rollup to its (model, priority); None for anything else."""
    key = (_model(attributes.get("model")), _priority(attributes.get("priority")))
    if row.metric == REQUESTS and row.kind == "sum":
        group = traffic[key]
        group.outcomes[str(attributes.get("outcome"))] += _finite(row.total) or 0.0
        return group
    if row.metric in _DURATIONS and row.kind == "histogram":
        histogram = Histogram.of(row.bounds, row.buckets, row.count, row.total)
        if histogram is None:
            return None
        group = traffic[key]
        if attributes.get("outcome") == SERVED:
            group.durations[row.metric].add(histogram)
        return group
    if row.metric == QUEUE_DEPTH and row.kind == "gauge":
        last, high = _finite(row.last), _finite(row.max)
        if last is None or high is None:
            return None
        group = traffic[key]
        sums = group.depth_by_minute.setdefault(row.minute, [0.0, 0.0])
        sums[0] += last  # one series per model version: their queues add up
        sums[1] += high
        return group
    return None


def _order(key: tuple[str | None, int | None]) -> tuple[str, int]:
    return (key[0] or "", -1 if key[1] is None else key[1])


def _fold_gauge(gauges: dict[tuple[str, str], _Gauge], row: Any, attributes: dict[str, Any]) -> None:
    ident = (row.metric, json.dumps(attributes, sort_keys=True, default=str))
    gauge = gauges.setdefault(ident, _Gauge(row.metric, _plain(attributes)))
    last, low, high = _finite(row.last), _finite(row.min), _finite(row.max)
    if last is not None and (gauge.at is None or row.minute > gauge.at):
        gauge.last, gauge.at = last, row.minute
    if low is not None:
        gauge.min = low if gauge.min is None else min(gauge.min, low)
    if high is not None:
        gauge.max = high if gauge.max is None else max(gauge.max, high)


def _traffic(key: tuple[str | None, int | None], group: _Traffic, seconds: float) -> dict[str, Any]:
    requests = sum(group.outcomes.values())
    latency = group.durations[REQUEST_DURATION].merged() if REQUEST_DURATION in group.durations else None
    queue = group.durations[QUEUE_DURATION].merged() if QUEUE_DURATION in group.durations else None
    compute = group.durations[COMPUTE_DURATION].merged() if COMPUTE_DURATION in group.durations else None
    depth = None
    if group.depth_by_minute:
        latest = max(group.depth_by_minute)
        depth = {"last": group.depth_by_minute[latest][0], "max": max(v[1] for v in group.depth_by_minute.values())}
    return {
        "model": key[0],
        "priority": key[1],
        "versions": sorted(group.versions),
        "requests": requests,
        "rps": requests / seconds,
        "outcomes": dict(sorted(group.outcomes.items())),
        "latency_ms": {
            "count": latency.count if latency else 0.0,
            "mean": _ms(latency.mean) if latency else None,
            "p50": _ms(latency.quantile(0.50)) if latency else None,
            "p95": _ms(latency.quantile(0.95)) if latency else None,
            "p99": _ms(latency.quantile(0.99)) if latency else None,
        },
        "queue_ms_mean": _ms(queue.mean) if queue else None,
        "compute_ms_mean": _ms(compute.mean) if compute else None,
        "queue_depth": depth,
    }


def _batches(model: str | None, layouts: _Layouts) -> dict[str, Any]:
    sizes = layouts.merged()
    return {
        "model": model,
        "batches": sizes.count if sizes else 0.0,
        "mean": _finite(sizes.mean) if sizes else None,
        "p50": sizes.quantile(0.50) if sizes else None,
        "p99": sizes.quantile(0.99) if sizes else None,
    }


def _gauge(gauge: _Gauge) -> dict[str, Any]:
    return {"metric": gauge.metric, "attributes": gauge.attributes, "last": gauge.last, "at": gauge.at,
            "min": gauge.min, "max": gauge.max}  # fmt: skip


def agent_metrics(
    session: Session, agent_id: str, window_s: int, *, retention_s: float, now: datetime | None = None
) -> dict[str, Any]:
    """The summary of one agent's last `window_s` seconds of telemetry.

    Raises:
        NotFound: no agent with this id.
        ValidationFailed: a window shorter than a minute or longer than the rollups are kept.
    """
    if window_s < MIN_WINDOW_S:
        raise ValidationFailed.field("query.window", f"must be at least {MIN_WINDOW_S} s (one minute rollup)")
    if window_s > retention_s:
        raise ValidationFailed.field(
            "query.window", f"must be at most the retention of minute rollups ({retention_s / 86400:g} days)"
        )
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise NotFound(f"no agent with id '{agent_id}'")
    now = (now or utcnow()).astimezone(timezone.utc)
    since = window_start(now, window_s)
    summary = summarise(read_rollups(session, agent.id, since), since=since, until=now)
    return {"agent": agent.id, "name": agent.name, "window": window_s, **summary}


__all__ = [
    "Histogram",
    "agent_metrics",
    "histogram_quantile",
    "merge_histograms",
    "read_rollups",
    "summarise",
    "window_start",
]
