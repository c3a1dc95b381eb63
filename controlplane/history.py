"""Telemetry over time, for charts: an agent's (or the whole fleet's) minute rollups of a window read once, cut into
steps of whole minutes, and each step summarised as `/agents/{id}/metrics` summarises a window (`query.summarise`).

`Steps` is the time axis every history shares (the SLO history too): the last step ends with the current minute, the
others go back from it a step at a time, so that every step is whole and the last one holds what happens now.
Bounded: at most 7 days and 720 steps an answer; a window and step the caller leaves out get sensible defaults.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from itertools import chain
from operator import add
from typing import Any

from sqlalchemy.orm import Session

from controlplane.db.models import Agent
from controlplane.errors import NotFound, ValidationFailed
from controlplane.query import Histogram, Rollup, RollupReader, merge_histograms, summarise, tenant_of
from spillway.contract.names import (
    ATTR_GENAI_MODEL,
    ATTR_MODEL,
    ATTR_OUTCOME,
    GENAI_REQUEST_DURATION,
    GENAI_TOKEN_USAGE,
    GENAI_TPOT,
    GENAI_TTFT,
    LOCAL,
    QUEUE_DEPTH,
    REQUEST_DURATION,
    REQUESTS,
)

MAX_WINDOW_S = 7 * 86400
MAX_POINTS = 720
DEFAULT_WINDOW_S = 3600
DEFAULT_STEPS_S = (60, 300, 900, 3600, 21600)  # the default: the smallest of these giving at most DEFAULT_POINTS
DEFAULT_POINTS = 360
HISTORY_METRICS = (REQUESTS, REQUEST_DURATION, QUEUE_DEPTH, GENAI_TTFT, GENAI_TPOT, GENAI_REQUEST_DURATION,
                   GENAI_TOKEN_USAGE)  # fmt: skip
"""What a point is made of; an agent's history reads every gauge besides (its device readings)."""


def epoch_minute(moment: datetime) -> int:
    if moment.tzinfo is None:  # SQLite hands back naive datetimes; everything stored is UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp()) // 60


def minute_start(minute: int) -> datetime:
    return datetime.fromtimestamp(minute * 60, tz=timezone.utc)


@dataclass(frozen=True)
class Steps:
    """`count` steps of `step` seconds (whole minutes), the last ending with epoch minute `last` (included)."""

    window: int
    step: int
    count: int
    last: int

    @classmethod
    def of(cls, window_s: int | None, step_s: int | None, now: datetime, *, min_step_beyond: tuple[int, int] | None
           = None) -> Steps:  # fmt: skip
        """The steps of a window ending now, checked: a window of 1m..7d (default 1h), a step of whole minutes that
        divides it (default: the smallest of 1m, 5m, 15m, 1h, 6h giving at most 360 points, the window then grown to
        whole steps, as the answer's `window` says) and at most 720 points.
        `min_step_beyond` (seconds, step): windows longer than the first need a step of at least the second.

        Raises:
            ValidationFailed: naming `query.window` or `query.step`.
        """
        window = DEFAULT_WINDOW_S if window_s is None else int(window_s)
        if not 60 <= window <= MAX_WINDOW_S:
            raise ValidationFailed.field("query.window", "must be from 1m to 7d")
        if step_s is None:
            step = next((s for s in DEFAULT_STEPS_S if math.ceil(window / s) <= DEFAULT_POINTS), DEFAULT_STEPS_S[-1])
            if min_step_beyond is not None and window > min_step_beyond[0]:
                step = max(step, min_step_beyond[1])
        else:
            step = int(step_s)
            if step < 60 or step % 60:
                raise ValidationFailed.field("query.step", "must be whole minutes, at least 1m")
        if step > window:
            raise ValidationFailed.field("query.step", "must be at most the window")
        if step_s is not None and window % step:
            raise ValidationFailed.field("query.step", "must divide the window into whole steps (1h by 7m does not)")
        count = math.ceil(window / step)  # a default step that does not divide the window: it grows to whole steps
        if count > MAX_POINTS:
            least = math.ceil(window / MAX_POINTS / 60) * 60
            raise ValidationFailed.field(
                "query.step", f"gives {count} points over the window, at most {MAX_POINTS}: use at least {least // 60}m"
            )
        if (
            min_step_beyond is not None
            and window > min_step_beyond[0]
            and (step < min_step_beyond[1] or step % min_step_beyond[1])
        ):
            raise ValidationFailed.field(
                "query.step", f"must be a whole number of {min_step_beyond[1] // 60}m for a window longer than "
                f"{min_step_beyond[0] // 3600}h"
            )  # fmt: skip
        return cls(count * step, step, count, epoch_minute(now))

    @property
    def minutes(self) -> int:
        """Minutes per step."""
        return self.step // 60

    @property
    def first(self) -> int:
        """The first minute of the first step."""
        return self.last - self.count * self.minutes + 1

    def start(self, index: int) -> int:
        """The first minute of step `index` (0: the oldest)."""
        return self.first + index * self.minutes

    def index(self, minute: int) -> int | None:
        """The step holding an epoch minute, or None outside the steps."""
        if not self.first <= minute <= self.last:
            return None
        return (minute - self.first) // self.minutes


def _chosen(rollup: Rollup, model: str | None, tenant: str | None) -> bool:
    """A rollup of the model asked for (rollups naming no model, the device's, always), and of the tenant."""
    attributes = rollup.attributes
    if model is not None:
        named = attributes.get(ATTR_GENAI_MODEL, attributes.get(ATTR_MODEL))
        if named is not None and str(named) != model:
            return False
    # Only the served latency is narrowed here: `summarise` narrows the other request metrics itself.
    return tenant is None or rollup.metric != REQUEST_DURATION or tenant_of(attributes) == tenant


def metrics_history(session: Session, steps: Steps, *, agent: str | None, now: datetime, model: str | None = None,
                    tenant: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One agent's (`agent`) or the whole fleet's (None: every agent summed) telemetry per step.

    Raises:
        NotFound: no agent with this id.
    """
    if agent is not None and session.get(Agent, agent) is None:
        raise NotFound(f"no agent with id '{agent}'")
    since, until = minute_start(steps.first), minute_start(steps.last)
    reader = RollupReader()
    rows: Iterable[Rollup]
    if agent is not None:
        rows = reader.read(session, since=since, until=until, agents=(agent,), metrics=HISTORY_METRICS,
                           every_gauge=True)  # fmt: skip
    else:  # the fleet's sums and gauges added up in the database; histograms read one by one
        rows = chain(
            reader.read_summed(session, since=since, until=until, metrics=HISTORY_METRICS),
            reader.read(session, since=since, until=until, metrics=HISTORY_METRICS, kinds=("histogram",)),
        )
    steps_of: list[_Step] = [_Step(fleet=agent is None) for _ in range(steps.count)]
    minutes: dict[datetime, int | None] = {}
    for rollup in rows:
        index = minutes.get(rollup.minute, -1)
        if index == -1:
            index = minutes[rollup.minute] = steps.index(epoch_minute(rollup.minute))
        if index is not None and _chosen(rollup, model, tenant):
            steps_of[index].add(rollup)
    points = []
    for index, step in enumerate(steps_of):
        start = minute_start(steps.start(index))
        # Rates divide by the whole step, the current minute counted whole: an export lands in the minute it arrives
        # with what happened up to an export interval before, so dividing by the seconds elapsed in the minute so far
        # would show a burst that never happened (a 30 s export read 5 s into a minute, as 6x its rate).
        end = minute_start(steps.start(index) + steps.minutes)
        points.append(_point(step.rollups(), start, end, tenant, device=agent is not None))
    return {"agent": agent, "window": steps.window, "step": steps.step, "since": since, "until": now,
            "points": points}  # fmt: skip


class _Step:
    """The rollups of one step. The fleet's are summed over agents as they arrive (one rollup per series and
    histogram layout, and per series and minute for gauges), so that a thousand agents cost a sum each, not a pass
    through the summary: the summary cannot tell agents apart (a series is its metric and attributes) and would
    take one agent's gauge reading for another's."""

    def __init__(self, *, fleet: bool) -> None:
        self.fleet = fleet
        self.rows: list[Rollup] = []
        self.sums: dict[tuple[str, tuple[float, ...] | None], list[Any]] = {}  # -> [first, count, total, buckets]
        self.gauges: dict[tuple[str, datetime], dict[str, Rollup]] = {}  # (series, minute) -> agent -> rollup

    def add(self, rollup: Rollup) -> None:
        if not self.fleet:
            self.rows.append(rollup)
        elif rollup.kind == "gauge":
            by_agent = self.gauges.setdefault((rollup.series, rollup.minute), {})
            seen = by_agent.get(rollup.agent)  # a series read twice in a minute (before and after a rename): once
            if seen is None or (rollup.last or 0.0) > (seen.last or 0.0):
                by_agent[rollup.agent] = rollup
        else:
            histogram = rollup.histogram
            if rollup.kind == "histogram" and histogram is None:
                return  # a malformed layout gives nothing to count
            key = (rollup.series, None if histogram is None else histogram.bounds)
            acc = self.sums.get(key)
            if acc is None:
                self.sums[key] = [rollup, rollup.count, rollup.total, None if histogram is None else histogram.buckets]
            else:
                acc[1] += rollup.count
                acc[2] += rollup.total
                if histogram is not None:
                    acc[3] = tuple(map(add, acc[3], histogram.buckets))

    def rollups(self) -> list[Rollup]:
        if not self.fleet:
            return self.rows
        out = []
        for (_, bounds), (first, count, total, buckets) in self.sums.items():
            histogram = None if bounds is None else Histogram(bounds, buckets, count, total)
            out.append(replace(first, agent="", count=count, total=total, histogram=histogram))
        for by_agent in self.gauges.values():
            readings = list(by_agent.values())

            def summed(values: list[float | None]) -> float | None:
                known = [v for v in values if v is not None]
                return sum(known) if known else None

            out.append(replace(
                readings[0], agent="", count=sum(r.count for r in readings), total=sum(r.total for r in readings),
                last=summed([r.last for r in readings]), min=summed([r.min for r in readings]),
                max=summed([r.max for r in readings]),
            ))  # fmt: skip
        return out


def _point(rows: list[Rollup], start: datetime, end: datetime, tenant: str | None, *, device: bool) -> dict[str, Any]:
    summary = summarise(rows, since=start, until=end, tenant=tenant)
    latency = merge_histograms(r.histogram for r in rows if r.metric == REQUEST_DURATION and r.histogram is not None
                               and r.attributes.get(ATTR_OUTCOME) == LOCAL)  # fmt: skip

    def ms(q: float) -> float | None:
        value = latency.quantile(q) if latency is not None else None
        return None if value is None else value * 1000.0

    groups = [{
        "model": t["model"], "priority": t["priority"], "requests": t["requests"], "rps": t["rps"],
        "p50_ms": t["latency_ms"]["p50"], "p95_ms": t["latency_ms"]["p95"], "p99_ms": t["latency_ms"]["p99"],
        "queue_depth": t["queue_depth"]["last"] if t["queue_depth"] else None,
    } for t in summary["traffic"]]  # fmt: skip
    generation = [{
        "model": g["model"], "streams": g["duration_ms"]["count"], "ttft_p50_ms": g["ttft_ms"]["p50"],
        "ttft_p99_ms": g["ttft_ms"]["p99"], "tpot_p50_ms": g["tpot_ms"]["p50"], "tpot_p99_ms": g["tpot_ms"]["p99"],
        "tokens_out_per_s": g["tokens_out_per_s"],
    } for g in summary["generation"]]  # fmt: skip
    point: dict[str, Any] = {
        "ts": start, "requests": summary["requests"], "rps": summary["rps"], "outcomes": summary["outcomes"],
        "p50_ms": ms(0.50), "p95_ms": ms(0.95), "p99_ms": ms(0.99), "groups": groups, "generation": generation,
    }  # fmt: skip
    if device:
        point["device"] = [{"metric": d["metric"], "attributes": d["attributes"], "last": d["last"], "max": d["max"]}
                           for d in summary["device"]]  # fmt: skip
    return point


__all__ = ["MAX_POINTS", "MAX_WINDOW_S", "Steps", "epoch_minute", "metrics_history", "minute_start"]
