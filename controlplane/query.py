"""The minute rollups read back: one reader that every part decoding them uses (`read_rollups`, `RollupReader`),
and one agent's recent telemetry summarised from them: request rates and outcome mix, latency percentiles, queue
and compute times, batch sizes, queue depths and device gauges, and for generative models their OTel GenAI
figures (time to first token and per output token, tokens per second, KV-cache use, preemptions, open streams).

Metrics and attributes are read under their current names: rows stored before agents' attribute names were
namespaced carry the old ones (`model`, `outcome`, ...), and rows stored before `spillway.kv.blocks.total` became
`spillway.kv.blocks.limit` the old metric name; a selection by metric selects the old names too, renamed here as the
receiver renames them in what it stores now, and such a row's series is the one its renamed metric and attributes
hash to, so old and new rows of one series are one series.

Request metrics carry the tenant a request belonged to (`spillway.tenant`); a rollup without it (an agent from before
tenants) is the `default` tenant's (`tenant_of`). The summary can be narrowed to one tenant (its request, latency and
GenAI figures; batches, queue depths, device and generation gauges are the device's, whoever queued) and lists every
tenant's requests, outcomes, share of the requests served on the device and latency (`by_tenant`).

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
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

import orjson
from sqlalchemy import ColumnElement, String, and_, func, or_, select, type_coerce
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, MetricRollup, utcnow
from controlplane.errors import NotFound, ValidationFailed
from controlplane.ingest.attributes import current_metric, current_names, series_key, with_legacy_metrics
from spillway.contract.names import (
    ACTIVE_STREAMS,
    ATTR_GENAI_MODEL,
    ATTR_GENAI_TOKEN_TYPE,
    ATTR_MODEL,
    ATTR_OUTCOME,
    ATTR_PRIORITY,
    ATTR_TENANT,
    ATTR_VERSION,
    BATCH_SIZE,
    COMPUTE_DURATION,
    GENAI_METRICS,
    GENAI_REQUEST_DURATION,
    GENAI_TOKEN_USAGE,
    GENAI_TPOT,
    GENAI_TTFT,
    KV_BLOCKS_TOTAL,
    KV_BLOCKS_USED,
    PREEMPTIONS,
    QUEUE_DEPTH,
    QUEUE_DURATION,
    REQUEST_DURATION,
    REQUESTS,
)
from spillway.contract.names import DURATIONS as _DURATIONS
from spillway.contract.names import LOCAL as SERVED
from spillway.contract.tenants import DEFAULT_TENANT

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
        return cls.on(_bounds(bounds), buckets, count, total)

    @classmethod
    def on(cls, bounds: tuple[float, ...] | None, buckets: Any, count: Any, total: Any) -> Histogram | None:
        """`of`, with bounds checked already (by `_bounds`: None if they are not well-formed)."""
        if bounds is None:
            return None
        try:
            c = tuple(map(float, buckets))
        except (TypeError, ValueError):
            return None
        if len(c) != len(bounds) + 1 or not all(map(math.isfinite, c)) or min(c) < 0:
            return None
        return cls(bounds, c, float(count or 0), float(total or 0.0))

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


def _bounds(values: Any) -> tuple[float, ...] | None:
    """Finite, strictly increasing bucket bounds, or None."""
    try:
        bounds = tuple(map(float, values))
    except (TypeError, ValueError):
        return None
    return bounds if all(map(math.isfinite, bounds)) and all(x < y for x, y in pairwise(bounds)) else None


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
    depth_by_minute: dict[datetime, dict[str, tuple[float, float]]] = field(default_factory=dict)  # minute -> series
    # -> (last, max); the series of one minute add up (one per model version)


_GENAI_HISTOGRAMS = (GENAI_TTFT, GENAI_TPOT, GENAI_REQUEST_DURATION)  # seconds, by gen_ai.request.model
_GENERATION_GAUGES = (KV_BLOCKS_USED, KV_BLOCKS_TOTAL, ACTIVE_STREAMS)  # by model
GENERATION_METRICS = (*GENAI_METRICS, PREEMPTIONS, *_GENERATION_GAUGES)
"""Every metric a generative model reports beside `spillway.requests`: what `agent_metrics` reads for them."""


@dataclass
class _Generation:
    """One generative model of an agent: its GenAI histograms, tokens by type, generation gauges and preemptions.
    The OTel GenAI metrics name the model `gen_ai.request.model`, Spillway's own ones `spillway.model`: one name
    here."""

    histograms: dict[str, _Layouts] = field(default_factory=lambda: defaultdict(_Layouts))
    tokens: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # gen_ai.token.type -> tokens
    # metric -> minute -> series -> (last, last)
    gauges: dict[str, dict[datetime, dict[str, tuple[float, float]]]] = field(default_factory=lambda: defaultdict(dict))
    preemptions: float = 0.0


TENANT_METRICS = frozenset((REQUESTS, *_DURATIONS, *GENAI_METRICS))
"""The metrics whose points carry the request's tenant: what a tenant filter narrows."""


def tenant_of(attributes: Mapping[str, Any]) -> str:
    """The tenant of a request metric's rollup: its `spillway.tenant`, `default` without one (an older agent)."""
    tenant = attributes.get(ATTR_TENANT)
    return DEFAULT_TENANT if tenant is None else str(tenant)


@dataclass
class _Tenant:
    """One tenant of an agent: its outcomes, the durations of its requests served locally, its GenAI streams."""

    outcomes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    latency: _Layouts = field(default_factory=_Layouts)
    ttft: _Layouts = field(default_factory=_Layouts)
    tokens_out: float = 0.0


def _fold_tenant(tenant: _Tenant, rollup: Rollup) -> None:
    attributes, metric = rollup.attributes, rollup.metric
    if metric == REQUESTS and rollup.kind == "sum":
        tenant.outcomes[str(attributes.get(ATTR_OUTCOME))] += _finite(rollup.total) or 0.0
    elif rollup.kind != "histogram":
        return
    elif metric == REQUEST_DURATION and attributes.get(ATTR_OUTCOME) == SERVED and rollup.histogram is not None:
        tenant.latency.add(rollup.histogram)
    elif metric == GENAI_TTFT and rollup.histogram is not None:
        tenant.ttft.add(rollup.histogram)
    elif metric == GENAI_TOKEN_USAGE and attributes.get(ATTR_GENAI_TOKEN_TYPE) == "output":
        tenant.tokens_out += _finite(rollup.total) or 0.0


def _tenants(tenants: dict[str, _Tenant], seconds: float, only: str | None) -> list[dict[str, Any]]:
    """Per tenant (only `only`, if given), its traffic; its share is of every tenant's requests served locally."""
    served_total = sum(t.outcomes.get(SERVED, 0.0) for t in tenants.values())
    out = []
    for name in sorted(tenants):
        if only is not None and name != only:
            continue
        tenant = tenants[name]
        requests = sum(tenant.outcomes.values())
        served = tenant.outcomes.get(SERVED, 0.0)
        latency = tenant.latency.merged()
        ttft = tenant.ttft.merged()
        out.append({
            "tenant": name, "requests": requests, "rps": requests / seconds,
            "outcomes": dict(sorted(tenant.outcomes.items())), "served": served,
            "share": served / served_total if served_total > 0 else None,
            "rejected": tenant.outcomes.get("rejected", 0.0),
            "latency_ms": {
                "count": latency.count if latency else 0.0, "mean": _ms(latency.mean) if latency else None,
                "p50": _ms(latency.quantile(0.50)) if latency else None,
                "p95": _ms(latency.quantile(0.95)) if latency else None,
                "p99": _ms(latency.quantile(0.99)) if latency else None,
            },
            "ttft_ms": _percentiles_ms(ttft), "tokens_out_per_s": tenant.tokens_out / seconds,
        })  # fmt: skip
    return out


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


# ---- the one reader of the minute rollups ---------------------------------------------------------------------


@dataclass(slots=True)
class Rollup:
    """One series' minute rollup, decoded: what every reader of the rollups works from. A value, not to be changed
    (left unfrozen only because a frozen dataclass costs four times as much to make, and the SLO evaluator makes
    one for every recent rollup of the fleet on every cycle)."""

    agent: str
    metric: str
    kind: str  # sum | histogram | gauge
    series: str  # hashes the metric and its attributes
    minute: datetime  # the minute's start, UTC
    attributes: Mapping[str, Any]  # the series' attributes (shared by its rollups: do not change them)
    count: float  # histogram observations, or gauge samples
    total: float  # a sum's increase, a histogram's sum of observations, or a gauge's sum of samples
    histogram: Histogram | None = None  # a histogram's buckets and bounds; None without a well-formed layout
    last: float | None = None  # a gauge's readings in the minute, each None unless a finite number
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, row: Any) -> Rollup:
        """From a row read with the ORM's types (a `MetricRollup`, or some of its columns: agent_id and series
        may be left out)."""
        gauge = row.kind == "gauge"
        series = getattr(row, "series", "")
        stored = row.attributes if isinstance(row.attributes, dict) else {}
        attributes, metric = current_names(stored), current_metric(row.metric)
        if (attributes is not stored or metric != row.metric) and series:  # stored before a rename: its series now
            series = series_key(metric, attributes)
        return cls(
            getattr(row, "agent_id", ""), metric, row.kind, series, _raw_minute(row.minute),
            attributes, float(row.count or 0), float(row.total or 0.0),
            Histogram.of(row.bounds, row.buckets, row.count, row.total) if row.kind == "histogram" else None,
            _finite(row.last) if gauge else None, _finite(row.min) if gauge else None,
            _finite(row.max) if gauge else None,
        )  # fmt: skip


_HEAD = (MetricRollup.id, MetricRollup.agent_id, MetricRollup.metric, MetricRollup.kind, MetricRollup.series,
         type_coerce(MetricRollup.minute, String), MetricRollup.count, MetricRollup.total)  # fmt: skip
_HISTOGRAM = (type_coerce(MetricRollup.buckets, String), type_coerce(MetricRollup.bounds, String))
_GAUGE = (MetricRollup.last, MetricRollup.min, MetricRollup.max)
"""Columns read raw (JSON and timestamps as the driver hands them over) and decoded here, each only as far as
needed: the SLO evaluator re-reads the last minutes of every agent on every cycle. A histogram's or a gauge's own
columns are read only where the selection may hold one."""


class RollupReader:
    """Selects minute rollups and decodes each into a `Rollup`.

    A series' attributes never change (its key hashes them), so a reader decodes them once per series, from one of
    its rows, and remembers them: keep one reader to re-read the same series cheaply (as the SLO windows do). A series
    stored under a legacy metric name or legacy attribute names is read under the current ones, as the series they
    hash to (and selecting a metric selects its legacy names too).
    """

    CHUNK = 500  # agents, or series, in one IN (...)
    BATCH = 5000  # rows fetched at a time

    def __init__(self) -> None:
        self._attributes: dict[str, dict[str, Any]] = {}
        self._renamed: dict[str, str] = {}  # stored series -> the series of its renamed metric and attributes

    def read(self, session: Session, *, since: datetime, until: datetime | None = None,
             agents: Collection[str] | None = None, metrics: Collection[str] | None = None,
             kinds: Collection[str] | None = None, every_gauge: bool = False) -> Iterator[Rollup]:  # fmt: skip
        """The rollups of the minutes from `since` (to `until`, both included) of `agents` (None: every agent),
        of `metrics` and `kinds` (None: any), and with `every_gauge` every gauge as well, whatever its metric;
        streamed, in no particular order."""
        where: list[ColumnElement[bool]] = [MetricRollup.minute >= since]
        if until is not None:
            where.append(MetricRollup.minute <= until)
        chosen: list[ColumnElement[bool]] = []
        if metrics is not None:
            chosen.append(MetricRollup.metric.in_(with_legacy_metrics(metrics)))
        if kinds is not None:
            chosen.append(MetricRollup.kind.in_(kinds))
        if chosen and every_gauge:
            where.append(or_(and_(*chosen), MetricRollup.kind == "gauge"))
        else:
            where.extend(chosen)  # nothing chosen: every rollup, gauges included
        histograms = kinds is None or "histogram" in kinds
        gauges = kinds is None or "gauge" in kinds or every_gauge
        columns = (*_HEAD, *(_HISTOGRAM if histograms else ()), *(_GAUGE if gauges else ()))
        at = len(_HEAD) + (len(_HISTOGRAM) if histograms else 0)  # where a gauge's columns start
        minutes: dict[Any, datetime] = {}  # raw minute -> decoded
        layouts: dict[Any, tuple[float, ...] | None] = {}  # raw bounds -> checked
        connection, known, renamed = session.connection(), self._attributes, self._renamed
        for chunk in [None] if agents is None else _chunks(sorted(agents), self.CHUNK):
            query = select(*columns).where(*where, *([] if chunk is None else [MetricRollup.agent_id.in_(chunk)]))
            for rows in connection.execute(query.execution_options(yield_per=self.BATCH)).partitions():
                self._learn(connection, rows)
                for row in rows:
                    kind, minute = row[3], minutes.get(row[5])
                    if minute is None:
                        minute = minutes[row[5]] = _raw_minute(row[5])
                    histogram = None
                    if histograms and kind == "histogram":  # only a histogram's buckets and bounds are parsed
                        raw = row[9]
                        if not isinstance(raw, str | bytes):  # parsed already (JSONB): not a key
                            bounds = _bounds(raw)
                        elif raw in layouts:  # one layout (each agent's, as a rule): parsed and checked once
                            bounds = layouts[raw]
                        else:
                            bounds = layouts[raw] = _bounds(_raw_json(raw))
                        histogram = Histogram.on(bounds, _raw_json(row[8]), row[6], row[7])
                    last = low = high = None
                    if gauges and kind == "gauge":
                        last, low, high = _finite(row[at]), _finite(row[at + 1]), _finite(row[at + 2])
                    series: str = row[4]
                    yield Rollup(row[1], current_metric(row[2]), kind,
                                 renamed.get(series, series) if renamed else series, minute, known[series],
                                 float(row[6] or 0), float(row[7] or 0.0), histogram, last, low, high)  # fmt: skip

    def read_summed(self, session: Session, *, since: datetime, until: datetime | None = None,
                    metrics: Collection[str], kinds: Collection[str] = ("sum", "gauge")
                    ) -> Iterator[Rollup]:  # fmt: skip
        """The sum and gauge rollups of `metrics` from `since` (to `until`) of every agent, added up in the database
        per series and minute (agent ""): count, total, and a gauge's last, min and max readings each summed over
        the agents. What a fleet-wide figure needs, for a fraction of the rows (and of the time) `read` would take."""
        where: list[ColumnElement[bool]] = [MetricRollup.minute >= since, MetricRollup.kind.in_(kinds),
                                            MetricRollup.metric.in_(with_legacy_metrics(metrics))]  # fmt: skip
        if until is not None:
            where.append(MetricRollup.minute <= until)
        minute = type_coerce(MetricRollup.minute, String)
        query = (
            select(func.min(MetricRollup.id), MetricRollup.metric, MetricRollup.kind, MetricRollup.series, minute,
                   func.sum(MetricRollup.count), func.sum(MetricRollup.total), func.sum(MetricRollup.last),
                   func.sum(MetricRollup.min), func.sum(MetricRollup.max))
            .where(*where)
            .group_by(MetricRollup.metric, MetricRollup.kind, MetricRollup.series, minute)
        )  # fmt: skip
        connection, known, renamed = session.connection(), self._attributes, self._renamed
        rows = connection.execute(query).all()
        # `_learn` reads a row's id at 0 and its series at 4: here the series is at 3.
        self._learn(connection, [(row[0], None, None, None, row[3]) for row in rows])
        for row in rows:
            series: str = row[3]
            gauge = row[2] == "gauge"
            yield Rollup("", current_metric(row[1]), row[2], renamed.get(series, series) if renamed else series,
                         _raw_minute(row[4]), known[series], float(row[5] or 0), float(row[6] or 0.0), None,
                         _finite(row[7]) if gauge else None, _finite(row[8]) if gauge else None,
                         _finite(row[9]) if gauge else None)  # fmt: skip

    def _learn(self, connection: Connection, rows: Sequence[Any]) -> None:
        """Decode the attributes of the series among `rows` not seen before, each from one of its rows."""
        unknown = {row[4]: row[0] for row in rows if row[4] not in self._attributes}
        for chunk in _chunks(list(unknown.values()), self.CHUNK):
            query = select(MetricRollup.series, MetricRollup.metric, type_coerce(MetricRollup.attributes, String))
            for series, metric, attributes in connection.execute(query.where(MetricRollup.id.in_(chunk))):
                decoded = _raw_json(attributes)
                stored = decoded if isinstance(decoded, dict) else {}
                current = self._attributes[series] = current_names(stored)
                if current is not stored or current_metric(metric) != metric:
                    self._renamed[series] = series_key(current_metric(metric), current)


def read_rollups(session: Session, *, since: datetime, until: datetime | None = None,
                 agents: Collection[str] | None = None, metrics: Collection[str] | None = None,
                 kinds: Collection[str] | None = None, every_gauge: bool = False) -> Iterator[Rollup]:  # fmt: skip
    """`RollupReader.read` with a reader of its own."""
    return RollupReader().read(session, since=since, until=until, agents=agents, metrics=metrics, kinds=kinds,
                               every_gauge=every_gauge)  # fmt: skip


def _raw_minute(value: Any) -> datetime:
    """A minute column read raw: a datetime (PostgreSQL) or SQLite's ISO text; UTC either way."""
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _raw_json(value: Any) -> Any:
    """A JSON column read raw: text (SQLite) or already parsed (PostgreSQL's JSONB, or a row read with the ORM)."""
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ---- one agent's summary --------------------------------------------------------------------------------------


def summarise(
    rows: Iterable[Rollup | Any], *, since: datetime, until: datetime, tenant: str | None = None
) -> dict[str, Any]:
    """The summary of `rows` (minute rollups from `since` to `until`: decoded, or rows for `Rollup.of`); pure, so
    it is checked without a database. With `tenant`, the request metrics (`TENANT_METRICS`) of that tenant only,
    and `by_tenant` lists that tenant only (its share still of every tenant's requests served locally)."""
    traffic: dict[tuple[str | None, int | None], _Traffic] = defaultdict(_Traffic)
    batches: dict[str | None, _Layouts] = defaultdict(_Layouts)
    gauges: dict[tuple[str, str], _Gauge] = {}
    generation: dict[str, _Generation] = defaultdict(_Generation)
    tenants: dict[str, _Tenant] = defaultdict(_Tenant)
    for row in rows:
        rollup = row if isinstance(row, Rollup) else Rollup.of(row)
        if rollup.metric in TENANT_METRICS:
            who = tenant_of(rollup.attributes)
            _fold_tenant(tenants[who], rollup)
            if tenant is not None and who != tenant:
                continue
        if rollup.metric in GENERATION_METRICS:
            _fold_generation(generation, rollup)
            continue
        if rollup.metric == BATCH_SIZE and rollup.kind == "histogram":
            if rollup.histogram is not None:  # a malformed layout gives nothing to estimate from
                batches[_model(rollup.attributes.get(ATTR_MODEL))].add(rollup.histogram)
            continue
        if rollup.kind == "gauge" and not rollup.metric.startswith("spillway."):
            _fold_gauge(gauges, rollup)
            continue
        group = _fold_traffic(traffic, rollup)
        if group is not None and ATTR_VERSION in rollup.attributes:
            group.versions.add(str(rollup.attributes[ATTR_VERSION]))
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
        "generation": [_generation(model, generation[model], traffic, seconds) for model in sorted(generation)],
        "by_tenant": _tenants(tenants, seconds, tenant),
    }


def _fold_traffic(traffic: dict[tuple[str | None, int | None], _Traffic], rollup: Rollup) -> _Traffic | None:
    """Adds a request, duration or queue-depth rollup to its (model, priority); None for anything else."""
    attributes = rollup.attributes
    key = (_model(attributes.get(ATTR_MODEL)), _priority(attributes.get(ATTR_PRIORITY)))
    if rollup.metric == REQUESTS and rollup.kind == "sum":
        group = traffic[key]
        group.outcomes[str(attributes.get(ATTR_OUTCOME))] += _finite(rollup.total) or 0.0
        return group
    if rollup.metric in _DURATIONS and rollup.kind == "histogram":
        if rollup.histogram is None:
            return None
        group = traffic[key]
        if attributes.get(ATTR_OUTCOME) == SERVED:
            group.durations[rollup.metric].add(rollup.histogram)
        return group
    if rollup.metric == QUEUE_DEPTH and rollup.kind == "gauge":
        if rollup.last is None or rollup.max is None:
            return None
        group = traffic[key]
        _reading(group.depth_by_minute.setdefault(rollup.minute, {}), rollup.series, rollup.last, rollup.max)
        return group
    return None


def _fold_generation(generation: dict[str, _Generation], rollup: Rollup) -> None:
    """Adds a GenAI histogram, a generation gauge or the preemption counter to its model (rollups of an unexpected
    kind, or without a model, are left out)."""
    attributes, metric = rollup.attributes, rollup.metric
    if metric in GENAI_METRICS:
        model = _model(attributes.get(ATTR_GENAI_MODEL))
        if model is None or rollup.kind != "histogram":
            return
        if metric == GENAI_TOKEN_USAGE:  # the sum of a token histogram is the tokens themselves
            generation[model].tokens[str(attributes.get(ATTR_GENAI_TOKEN_TYPE))] += _finite(rollup.total) or 0.0
        elif rollup.histogram is not None:
            generation[model].histograms[metric].add(rollup.histogram)
        return
    model = _model(attributes.get(ATTR_MODEL))
    if model is None:
        return
    if metric == PREEMPTIONS and rollup.kind == "sum":
        generation[model].preemptions += _finite(rollup.total) or 0.0
    elif rollup.kind == "gauge" and rollup.last is not None:
        by_series = generation[model].gauges[metric].setdefault(rollup.minute, {})
        _reading(by_series, rollup.series, rollup.last, rollup.last)  # one series per engine: they add up


def _generation(model: str, gen: _Generation, traffic: dict[tuple[str | None, int | None], _Traffic],
                seconds: float) -> dict[str, Any]:  # fmt: skip
    outcomes: dict[str, float] = defaultdict(float)
    for (name, _), group in traffic.items():
        if name == model:
            for outcome, n in group.outcomes.items():
                outcomes[outcome] += n
    ttft, tpot, duration = (gen.histograms[m].merged() if m in gen.histograms else None for m in _GENAI_HISTOGRAMS)
    used, total = _summed(gen.gauges.get(KV_BLOCKS_USED, {})), _summed(gen.gauges.get(KV_BLOCKS_TOTAL, {}))
    both = set(used).intersection(total)  # the ratio of one minute's readings, the latest minute with both
    latest = max(both) if both else None
    use = None if latest is None or total[latest] <= 0 else used[latest] / total[latest]
    return {
        "model": model,
        "requests": sum(outcomes.values()),
        "streams_per_s": (duration.count if duration else 0.0) / seconds,
        "ttft_ms": _percentiles_ms(ttft),
        "tpot_ms": _percentiles_ms(tpot),
        "duration_ms": _percentiles_ms(duration),
        "tokens_in_per_s": gen.tokens.get("input", 0.0) / seconds,
        "tokens_out_per_s": gen.tokens.get("output", 0.0) / seconds,
        "kv_blocks_used": _latest(used),
        "kv_blocks_total": _latest(total),
        "kv_cache_use": use,
        "preemptions": gen.preemptions,
        "preemptions_per_min": gen.preemptions * 60.0 / seconds,
        "active_streams": _latest(_summed(gen.gauges.get(ACTIVE_STREAMS, {}))),
        "outcomes": dict(sorted(outcomes.items())),
    }


def _percentiles_ms(histogram: Histogram | None) -> dict[str, Any]:
    if histogram is None:
        return {"count": 0.0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {"count": histogram.count, "mean": _ms(histogram.mean), "p50": _ms(histogram.quantile(0.50)),
            "p90": _ms(histogram.quantile(0.90)), "p99": _ms(histogram.quantile(0.99))}  # fmt: skip


def _reading(by_series: dict[str, tuple[float, float]], series: str, last: float, high: float) -> None:
    """A gauge series' (last, max) in one minute. A series read twice in a minute (rows stored before and after the
    attribute rename: one series, two rows) counts once, with the higher readings."""
    seen = by_series.get(series)
    by_series[series] = (last, high) if seen is None else (max(seen[0], last), max(seen[1], high))


def _summed(by_minute: Mapping[datetime, Mapping[str, tuple[float, float]]]) -> dict[datetime, float]:
    """Each minute's last readings, added up over the series."""
    return {minute: sum(last for last, _ in by_series.values()) for minute, by_series in by_minute.items()}


def _latest(by_minute: Mapping[datetime, float]) -> float | None:
    return by_minute[max(by_minute)] if by_minute else None


def _order(key: tuple[str | None, int | None]) -> tuple[str, int]:
    return (key[0] or "", -1 if key[1] is None else key[1])


def _fold_gauge(gauges: dict[tuple[str, str], _Gauge], rollup: Rollup) -> None:
    ident = (rollup.metric, json.dumps(rollup.attributes, sort_keys=True, default=str))
    gauge = gauges.setdefault(ident, _Gauge(rollup.metric, _plain(dict(rollup.attributes))))
    last, low, high = rollup.last, rollup.min, rollup.max
    if last is not None and (gauge.at is None or rollup.minute > gauge.at):
        gauge.last, gauge.at = last, rollup.minute
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
        by_minute = group.depth_by_minute
        highest = max(sum(high for _, high in by_series.values()) for by_series in by_minute.values())
        depth = {"last": sum(last for last, _ in by_minute[max(by_minute)].values()), "max": highest}
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
    session: Session,
    agent_id: str,
    window_s: int,
    *,
    retention_s: float,
    now: datetime | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The summary of one agent's last `window_s` seconds of telemetry (of one tenant's requests, with `tenant`).

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
    metrics = (REQUESTS, *_DURATIONS, BATCH_SIZE, *GENAI_METRICS, PREEMPTIONS)
    rollups = read_rollups(session, since=since, agents=(agent.id,), metrics=metrics,
                           every_gauge=True)  # its request and generation metrics and every gauge  # fmt: skip
    summary = summarise(rollups, since=since, until=now, tenant=tenant)
    return {"agent": agent.id, "name": agent.name, "window": window_s, "tenant": tenant, **summary}


__all__ = [
    "GENERATION_METRICS",
    "TENANT_METRICS",
    "Histogram",
    "Rollup",
    "RollupReader",
    "agent_metrics",
    "histogram_quantile",
    "merge_histograms",
    "read_rollups",
    "summarise",
    "tenant_of",
    "window_start",
]
