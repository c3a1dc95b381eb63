"""Recent SLO windows in memory, fed from the database's minute rollups, so that evaluating every SLO for
every agent it selects is a handful of array sums instead of a scan of weeks of rollups.

For each SLO the evaluator keeps, per selected agent, the good and total event counts of each minute of the
last six hours (minute resolution) and of each hour of the SLO's longest window (hour resolution). A window
of up to six hours is summed exactly from minutes; a longer one (the SLO window, a 3-day alert window) from
whole hours, the current partial hour included, so its far edge is exact to within an hour.

The database stays the only source of truth: every refresh re-reads the rollups of the current and the
previous minute (which exports may still be adding to; a late cumulative export lands in the current one)
and *replaces* those minutes here, so replicas that each keep their own windows agree and a restart loses
nothing. A change of the SLO (its version) or of the agents it selects reloads what changed from the database.
A rollup of an older minute that changes later (an out-of-order export) counts once the SLO is next read whole.

`SloWindows.counts` hands out one SLO's counts summed over its agents (`SloCounts`), for its history: the count of
any window ending at any minute, exact from the minutes of the last six hours and from whole hours beyond.

An SLO whose selector names a `tenant` counts that tenant's requests (streams) only: rollups whose `spillway.tenant`
is that name (`default`: also those without the attribute, from agents before tenants; `query.tenant_of`).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, Rule, Slo, utcnow
from controlplane.query import Rollup, RollupReader, tenant_of
from controlplane.schemas.rules import ErrorRatioCondition, LatencyCondition, RuleSpec, parse_rules
from controlplane.slo.maths import (
    GOOD_OUTCOMES,
    Counts,
    budget_remaining,
    burn_rate,
    error_budget,
    firing,
    good_under_threshold,
    sli,
)
from spillway.contract.names import (
    ATTR_GENAI_MODEL,
    ATTR_MODEL,
    ATTR_OUTCOME,
    GENAI_TPOT,
    GENAI_TTFT,
    LOCAL,
    REQUEST_DURATION,
    REQUESTS,
)

FINE_MINUTES = 6 * 60  # minute resolution this far back
REREAD_MINUTES = 1  # minutes before the current one re-read on every refresh (exports may still add to them)
# SLI kind -> the metric whose rollups count its events, and their rollup kind.
_ROLLUPS = {
    "latency": (REQUEST_DURATION, "histogram"),
    "availability": (REQUESTS, "sum"),
    "ttft": (GENAI_TTFT, "histogram"),
    "tpot": (GENAI_TPOT, "histogram"),
}
# The GenAI kinds: every stream the agent answered with tokens (local or overflowed) is an event, judged by its time
# to first token or mean time per output token; their histograms name the model `gen_ai.request.model` and carry no
# outcome (a stream refused before its first token is the availability SLI's business).
_GENAI_KINDS = frozenset({"ttft", "tpot"})


def epoch_minute(moment: datetime) -> int:
    if moment.tzinfo is None:  # SQLite hands back naive datetimes; everything stored is UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp()) // 60


def minutes_of(seconds: int) -> int:
    return max(1, math.ceil(seconds / 60))


@dataclass(frozen=True)
class SloSpec:
    """What evaluation needs from an SLO row; a new version of the SLO is a new spec."""

    id: str
    version: int
    name: str
    sli_kind: str
    threshold_s: float | None
    model: str | None
    labels: dict[str, str]
    objective: float
    window: int
    alerts: tuple[dict[str, Any], ...]
    source: str = "slo"  # slo | rule (a rule's latency or error-ratio condition, counted the same way)
    tenant: str | None = None  # only this tenant's events (the selector's `tenant`); None: every tenant's

    @classmethod
    def of_rule(cls, rule: RuleSpec) -> SloSpec | None:
        """A latency condition (share of requests, or of generative streams by their time to first token or per
        output token, within the threshold) or an error-ratio condition (share of good outcomes) counts exactly
        like a latency, ttft, tpot or availability SLO over the condition's window."""
        sli_kind: str
        threshold_s: float | None
        match rule.condition:
            case LatencyCondition(metric=metric, threshold_ms=threshold_ms, window=window):
                sli_kind, threshold_s = ("latency" if metric == "request" else metric), threshold_ms / 1000
            case ErrorRatioCondition(window=window):
                sli_kind, threshold_s = "availability", None
            case _:
                return None
        return cls(
            id=f"rule:{rule.id}", version=rule.version, name=rule.name, sli_kind=sli_kind, threshold_s=threshold_s,
            model=rule.selector.model, labels=dict(rule.selector.labels), objective=0.0, window=window, alerts=(),
            source="rule", tenant=_tenant(getattr(rule.selector, "tenant", None)),
        )  # fmt: skip

    @classmethod
    def of(cls, row: Slo) -> SloSpec:
        selector = row.selector or {}
        return cls(
            id=row.id, version=row.version, name=row.name, sli_kind=row.sli_kind,
            threshold_s=None if row.threshold_ms is None else row.threshold_ms / 1000, model=selector.get("model"),
            labels=dict(selector.get("labels") or {}), objective=row.objective, window=row.window,
            alerts=tuple(dict(a) for a in row.alert_windows), tenant=_tenant(selector.get("tenant")),
        )  # fmt: skip

    @property
    def rollups(self) -> tuple[str, str]:
        """The metric whose rollups count this SLO's events, and their kind."""
        return _ROLLUPS[self.sli_kind]

    @property
    def longest(self) -> int:
        return max([self.window, *(a["long"] for a in self.alerts)])

    def selects(self, labels: dict[str, Any]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels.items())

    def counts(self, rollup: Rollup) -> tuple[float, float] | None:
        """(good, total) events of one rollup for this SLO, or None when the rollup is not its business."""
        genai = self.sli_kind in _GENAI_KINDS
        if self.tenant is not None and tenant_of(rollup.attributes) != self.tenant:
            return None
        if self.model is not None and rollup.attributes.get(ATTR_GENAI_MODEL if genai else ATTR_MODEL) != self.model:
            return None
        outcome = rollup.attributes.get(ATTR_OUTCOME)
        if genai or self.sli_kind == "latency":
            if not genai and outcome != LOCAL:
                return None  # latency judges answered requests; availability judges the rest
            assert self.threshold_s is not None
            histogram = rollup.histogram  # without buckets, no observation is known to be fast enough
            good = good_under_threshold(histogram.buckets, histogram.bounds, self.threshold_s) if histogram else 0.0
            return good, rollup.count
        return (rollup.total if outcome in GOOD_OUTCOMES else 0.0), rollup.total


def _tenant(value: Any) -> str | None:
    """A selector's tenant as stored (the API checked it against the contract's NAME_PATTERN); none: every tenant."""
    return None if value is None or value == "" else str(value)


@dataclass
class SloWindow:
    """One SLO's counts: rows are agents, columns ring slots (minutes and hours)."""

    spec: SloSpec
    agents: list[str]
    hours: int
    fine: np.ndarray = field(init=False)  # (2, agents, FINE_MINUTES): good, total
    coarse: np.ndarray = field(init=False)  # (2, agents, hours)

    def __post_init__(self) -> None:
        self.row = {agent: i for i, agent in enumerate(self.agents)}
        self.fine = np.zeros((2, len(self.agents), FINE_MINUTES))
        self.coarse = np.zeros((2, len(self.agents), self.hours))

    @classmethod
    def for_spec(cls, spec: SloSpec, agents: list[str]) -> SloWindow:
        return cls(spec, agents, hours=math.ceil(minutes_of(spec.longest) / 60) + 1)

    def clear_minutes(self, first: int, last: int) -> None:
        """Forget minutes first..last (inclusive) and the hours that start inside them: their slots are reused."""
        if last - first + 1 >= FINE_MINUTES:
            self.fine[:] = 0
        else:
            self.fine[:, :, [m % FINE_MINUTES for m in range(first, last + 1)]] = 0
        first_hour, last_hour = (first + 59) // 60, last // 60
        if last_hour - first_hour + 1 >= self.hours:
            self.coarse[:] = 0
        elif last_hour >= first_hour:
            self.coarse[:, :, [h % self.hours for h in range(first_hour, last_hour + 1)]] = 0

    def forget(self, first: int, last: int) -> None:
        """Take recent minutes first..last (the newest the windows hold) out of every agent's counts."""
        for minute in range(max(first, last - FINE_MINUTES + 1), last + 1):
            slot, hour = minute % FINE_MINUTES, (minute // 60) % self.hours
            self.coarse[:, :, hour] -= self.fine[:, :, slot]
            self.fine[:, :, slot] = 0

    def add(self, row: int, minute: int, latest: int, good: float, total: float) -> None:
        """Add to one agent's counts of one minute (kept at minute resolution if recent, else only in hours)."""
        if minute <= latest - self.hours * 60 or minute > latest:
            return
        hour = (minute // 60) % self.hours
        self.coarse[0, row, hour] += good
        self.coarse[1, row, hour] += total
        if minute > latest - FINE_MINUTES:
            slot = minute % FINE_MINUTES
            self.fine[0, row, slot] += good
            self.fine[1, row, slot] += total

    def sums(self, seconds: int, latest: int) -> np.ndarray:
        """(2, agents): good and total per agent over the last `seconds` ending with minute `latest`."""
        minutes = minutes_of(seconds)
        if minutes <= FINE_MINUTES:
            slots = np.arange(latest - minutes + 1, latest + 1) % FINE_MINUTES
            return self.fine[:, :, slots].sum(axis=2)
        hours = min(math.ceil(minutes / 60), self.hours)
        slots = np.arange(latest // 60 - hours + 1, latest // 60 + 1) % self.hours
        return self.coarse[:, :, slots].sum(axis=2)

    def first_counted(self, seconds: int, latest: int) -> int:
        """The first minute of the window that `sums` counts."""
        minutes = minutes_of(seconds)
        if minutes <= FINE_MINUTES:
            return latest - minutes + 1
        return (latest // 60 - min(math.ceil(minutes / 60), self.hours) + 1) * 60

    def first_minutes(self, seconds: int, latest: int) -> np.ndarray:
        """(agents,): per agent, the epoch minute of its first minute with events in the window that `sums` counts
        (-1 without any). Exact within the last six hours; beyond, the start of the first hour with events."""
        minutes = minutes_of(seconds)
        fine_first = latest - min(minutes, FINE_MINUTES) + 1
        fine = self.fine[1][:, np.arange(fine_first, latest + 1) % FINE_MINUTES] > 0  # (agents, minutes)
        first = np.where(fine.any(axis=1), fine_first + fine.argmax(axis=1), -1)
        if minutes <= FINE_MINUTES:
            return first
        hours = min(math.ceil(minutes / 60), self.hours)
        first_hour = latest // 60 - hours + 1
        coarse = self.coarse[1][:, np.arange(first_hour, latest // 60 + 1) % self.hours] > 0
        hour_start = np.where(coarse.any(axis=1), (first_hour + coarse.argmax(axis=1)) * 60, -1)
        # An hour that starts before the minutes kept may hold events before them: its start is the best known.
        older = (hour_start >= 0) & ((hour_start < fine_first) | (first < 0))
        return np.where(older, hour_start, first)


@dataclass
class Evaluation:
    """One SLO evaluated at one moment: fleet-wide and per agent."""

    spec: SloSpec
    agents: list[str]
    at: datetime
    window: np.ndarray  # (2, agents)
    alerts: list[tuple[dict[str, Any], np.ndarray, np.ndarray]]  # pair, long sums, short sums
    first: np.ndarray | None = None  # (agents,): epoch minute of each agent's first minute with events, -1 if none
    window_first: int | None = None  # the first minute the SLO window counts

    def __post_init__(self) -> None:
        self._column = {agent: i for i, agent in enumerate(self.agents)}

    def status(self, agent: str | None = None) -> dict[str, Any]:
        """The SLO's status over all its agents, or over one of them."""
        columns: Any = slice(None)
        if agent is not None:
            columns = [self._column[agent]] if agent in self._column else []
        objective = self.spec.objective

        def counts_of(sums: np.ndarray) -> Counts:
            return Counts(float(sums[0, columns].sum()), float(sums[1, columns].sum()))

        window = counts_of(self.window)
        observed_since, observed = self._observed(columns)
        alerts = []
        for pair, long, short in self.alerts:
            long_rate, short_rate = burn_rate(counts_of(long), objective), burn_rate(counts_of(short), objective)
            alerts.append({
                "long": pair["long"], "short": pair["short"], "threshold": pair["burn_rate"],
                "severity": pair.get("severity", "page"), "long_burn_rate": long_rate, "short_burn_rate": short_rate,
                "firing": firing(long_rate, short_rate, pair["burn_rate"]),
            })  # fmt: skip
        return {
            "slo": self.spec.id,
            "name": self.spec.name,
            "agents": len(self.agents) if agent is None else len(columns),
            "window": self.spec.window,
            "objective": self.spec.objective,
            "sli": sli(window),
            "good": window.good,
            "total": window.total,
            "error_budget": error_budget(objective),
            "budget_remaining": budget_remaining(window, objective),
            "alerts": alerts,
            "evaluated_at": self.at,
            "observed_since": observed_since,
            "observed": observed,
        }

    def _observed(self, columns: Any) -> tuple[datetime | None, int]:
        """The first minute with events inside the SLO window (over `columns`), and the seconds from it to the
        evaluation (at most the window): how much of the window the figures cover."""
        if self.first is None:
            return None, 0
        firsts = self.first[columns]
        firsts = firsts[firsts >= 0]
        if firsts.size == 0:
            return None, 0
        first = int(firsts.min())
        since = datetime.fromtimestamp(first * 60, tz=timezone.utc)
        if self.window_first is not None and first <= self.window_first:  # events from the window's first minute
            return since, self.spec.window
        seconds = int((self.at - since).total_seconds())
        return since, max(0, min(seconds, self.spec.window))

    def per_agent(self) -> list[dict[str, Any]]:
        return [self.status(agent) | {"agent": agent} for agent in self.agents]


@dataclass(frozen=True)
class SloCounts:
    """One SLO's good and total events summed over agents, as of minute `latest` (epoch minutes): per minute for
    the last six hours (`minutes[:, i]` is minute `latest - FINE_MINUTES + 1 + i`) and per hour before
    (`hours[:, j]` is hour `latest // 60 - hours.shape[1] + 1 + j`, the current one partial), older hours added by
    `with_older_hours` (what the windows no longer or never kept, read from the database by the caller).

    `between` and `window` are exact where every minute asked for is inside the last six hours. Older minutes are
    counted from whole hours, as the status counts a long window: an hour counts when it starts inside the range, so
    a range that starts inside an hour leaves that hour out (the far edge is exact to within an hour)."""

    spec: SloSpec
    agents: tuple[str, ...]
    latest: int
    at: datetime  # when the windows were last refreshed
    minutes: np.ndarray  # (2, FINE_MINUTES)
    hours: np.ndarray  # (2, hours)

    @property
    def first_minute(self) -> int:
        """The oldest minute held at minute resolution."""
        return self.latest - self.minutes.shape[1] + 1

    @property
    def first_hour(self) -> int:
        """The oldest hour held."""
        return self.latest // 60 - self.hours.shape[1] + 1

    def with_older_hours(self, older: Mapping[int, tuple[float, float]]) -> SloCounts:
        """These counts with the hours of `older` (epoch hour -> good, total) before `first_hour` added in front
        (hours between them and `first_hour` that `older` lacks count as empty)."""
        if not older:
            return self
        start = min(older)
        if start >= self.first_hour:
            return self
        extra = np.zeros((2, self.first_hour - start))
        for hour, (good, total) in older.items():
            if start <= hour < self.first_hour:
                extra[:, hour - start] = (good, total)
        return SloCounts(self.spec, self.agents, self.latest, self.at, self.minutes,
                         np.concatenate([extra, self.hours], axis=1))  # fmt: skip

    def between(self, first: int, last: int) -> Counts:
        """Good and total of minutes `first`..`last` (inclusive, `last` at most `latest`): see the class."""
        last = min(last, self.latest)
        if last < first:
            return Counts()
        good = total = 0.0
        fine_first = self.first_minute
        if last >= fine_first:
            lo = max(first, fine_first) - fine_first
            good, total = (float(x) for x in self.minutes[:, lo : last - fine_first + 1].sum(axis=1))
        if first < fine_first:  # hours starting in first .. min(last, fine_first - 1)
            h_lo = max(-(-first // 60), self.first_hour)
            h_hi = min(last, fine_first - 1) // 60
            if h_hi >= h_lo:
                g, t = self.hours[:, h_lo - self.first_hour : h_hi - self.first_hour + 1].sum(axis=1)
                good, total = good + float(g), total + float(t)
                if h_hi * 60 + 59 >= fine_first:  # that hour's minutes kept at minute resolution are counted above
                    kept = self.minutes[:, : h_hi * 60 + 60 - fine_first].sum(axis=1)
                    good, total = good - float(kept[0]), total - float(kept[1])
        return Counts(good, total)

    def countable(self, seconds: int, last: int) -> bool:
        """Whether `window(seconds, last)` is counted at all: a window shorter than six hours that reaches before the
        minutes kept is counted from the hours starting inside it, which is nothing like it unless it is whole hours
        (a 5-minute window a day ago holds no hour start)."""
        minutes = minutes_of(seconds)
        return minutes > FINE_MINUTES or last - minutes + 1 >= self.first_minute or minutes % 60 == 0

    def window(self, seconds: int, last: int) -> Counts:
        """The counts of a window of `seconds` ending with minute `last`, as the status counts it: whole minutes up
        to six hours, else whole hours (the one holding `last` up to `last`)."""
        minutes = minutes_of(seconds)
        if minutes <= FINE_MINUTES:
            return self.between(last - minutes + 1, last)
        return self.between((last // 60 - math.ceil(minutes / 60) + 1) * 60, last)


class SloWindows:
    """Every SLO's recent windows for the agents it selects; thread-safe, one per control-plane process."""

    def __init__(self) -> None:
        self._slos: dict[str, SloWindow] = {}
        self._latest: int | None = None  # newest minute the windows hold
        self._reader = RollupReader()  # remembers each series' attributes
        self._lock = threading.Lock()
        self.refreshed_at: datetime | None = None

    def refresh(self, session: Session, now: datetime | None = None) -> None:
        """Bring every SLO's windows up to `now` from the database."""
        now = now or utcnow()
        with self._lock:
            self._refresh(session, epoch_minute(now))
            self.refreshed_at = now

    def evaluate(self, session: Session, now: datetime | None = None, *, max_age_s: float = 0.0) -> list[Evaluation]:
        """Refresh (unless the last refresh is younger than `max_age_s`) and evaluate every SLO."""
        now = now or utcnow()
        with self._lock:
            fresh = self.refreshed_at is not None and (now - self.refreshed_at).total_seconds() < max_age_s
            if not fresh:
                self._refresh(session, epoch_minute(now))
                self.refreshed_at = now
            latest = self._latest or epoch_minute(now)
            return [self._evaluate(w, latest, now) for w in self._slos.values()]

    # ---- inside the lock -----------------------------------------------------------------------

    def objective(self, spec_id: str) -> float:
        with self._lock:
            return self._slos[spec_id].spec.objective

    def window_sums(self, spec_id: str, seconds: list[int]) -> tuple[list[str], list[np.ndarray]] | None:
        """The agents of one SLO (or rule condition) and their (2, agents) sums over each of `seconds`, as of
        the last refresh; None for an SLO the windows do not hold. Windows beyond what it keeps are clamped."""
        with self._lock:
            window = self._slos.get(spec_id)
            if window is None or self._latest is None:
                return None
            return list(window.agents), [window.sums(s, self._latest) for s in seconds]

    def counts(self, session: Session, spec_id: str, now: datetime | None = None, *, max_age_s: float = 0.0,
               agents: list[str] | None = None) -> SloCounts | None:  # fmt: skip
        """One SLO's (or rule condition's) good and total per minute of the last six hours and per hour of its
        longest window, summed over `agents` (None: every agent it selects), refreshed first unless the last refresh
        is younger than `max_age_s`; None for an SLO the windows do not hold."""
        now = now or utcnow()
        with self._lock:
            if self.refreshed_at is None or (now - self.refreshed_at).total_seconds() >= max_age_s:
                self._refresh(session, epoch_minute(now))
                self.refreshed_at = now
            window = self._slos.get(spec_id)
            if window is None or self._latest is None:
                return None
            rows = slice(None) if agents is None else [window.row[a] for a in agents if a in window.row]
            latest = self._latest
            minutes = np.arange(latest - FINE_MINUTES + 1, latest + 1)
            hours = np.arange(latest // 60 - window.hours + 1, latest // 60 + 1)
            fine = window.fine[:, rows][:, :, minutes % FINE_MINUTES].sum(axis=1)
            coarse = window.coarse[:, rows][:, :, hours % window.hours].sum(axis=1)
            return SloCounts(window.spec, tuple(window.agents), latest, self.refreshed_at or now, fine, coarse)

    def _refresh(self, session: Session, now_minute: int) -> None:
        specs = {row.id: SloSpec.of(row) for row in session.scalars(select(Slo))}
        for rule in parse_rules(session.scalars(select(Rule).where(Rule.enabled.is_(True)))):
            spec = SloSpec.of_rule(rule)
            if spec is not None:
                specs[spec.id] = spec
        labels = {a.id: a.labels or {} for a in session.execute(select(Agent.id, Agent.labels))}
        latest = max(now_minute, self._latest or now_minute)
        if self._latest is not None and latest > self._latest:
            for window in self._slos.values():
                window.clear_minutes(self._latest + 1, latest)
        self._latest = latest
        for slo_id in list(self._slos):
            if slo_id not in specs:
                del self._slos[slo_id]
        for slo_id, spec in specs.items():
            agents = sorted(a for a, agent_labels in labels.items() if spec.selects(agent_labels))
            current = self._slos.get(slo_id)
            if current is None or current.spec != spec:  # new or changed: read its whole window
                window, joined = SloWindow.for_spec(spec, agents), agents
            elif current.agents != agents:  # agents joined or left: read the newcomers' whole window
                window, joined = self._regroup(current, agents), [a for a in agents if a not in current.row]
            else:
                continue
            self._slos[slo_id] = window
            if joined:
                self._load(session, [window], joined, latest - minutes_of(spec.longest) - 60, latest)
        windows = list(self._slos.values())
        agents = sorted({a for w in windows for a in w.agents})
        if agents:  # the last minutes, which exports may still be adding to, are read again every time
            self._load(session, windows, agents, latest - REREAD_MINUTES, latest, replace=True)

    @staticmethod
    def _regroup(current: SloWindow, agents: list[str]) -> SloWindow:
        """The same SLO over a changed set of agents: keep the rows of those that stay."""
        window = SloWindow(current.spec, agents, current.hours)
        keep = [a for a in agents if a in current.row]
        if keep:
            new_rows = [window.row[a] for a in keep]
            old_rows = [current.row[a] for a in keep]
            window.fine[:, new_rows] = current.fine[:, old_rows]
            window.coarse[:, new_rows] = current.coarse[:, old_rows]
        return window

    def _load(self, session: Session, windows: list[SloWindow], agents: list[str], since: int, latest: int, *,
              replace: bool = False) -> None:  # fmt: skip
        """Add minutes `since`..`latest` of `agents` in `windows` from the database (`replace`: those minutes
        held something already, which the database's current rows supersede).

        This is the evaluator's hot path (every cycle reads the last minutes of every agent): the reader decodes
        each series' attributes once, and each is judged once per SLO."""
        if replace:
            for window in windows:
                window.forget(since, latest)
        start = datetime.fromtimestamp(since * 60, tz=timezone.utc)
        sums: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        minutes: dict[datetime, int] = {}
        for metric, kind in sorted({w.spec.rollups for w in windows}):
            mine = [(i, w) for i, w in enumerate(windows) if w.spec.rollups == (metric, kind)]
            for rollup in self._reader.read(session, since=start, agents=agents, metrics=(metric,), kinds=(kind,)):
                m = minutes.get(rollup.minute)
                if m is None:
                    m = minutes[rollup.minute] = epoch_minute(rollup.minute)
                for i, window in mine:
                    index = window.row.get(rollup.agent)
                    if index is None:
                        continue
                    counts = window.spec.counts(rollup)
                    if counts is not None:
                        cell = sums[(i, index, m)]
                        cell[0] += counts[0]
                        cell[1] += counts[1]
        for (i, index, m), (good, total) in sums.items():
            windows[i].add(index, m, latest, good, total)

    def _evaluate(self, window: SloWindow, latest: int, now: datetime) -> Evaluation:
        alerts = [(pair, window.sums(pair["long"], latest), window.sums(pair["short"], latest))
                  for pair in window.spec.alerts]  # fmt: skip
        return Evaluation(window.spec, window.agents, now, window.sums(window.spec.window, latest), alerts,
                          window.first_minutes(window.spec.window, latest),
                          window.first_counted(window.spec.window, latest))  # fmt: skip


__all__ = [
    "FINE_MINUTES",
    "Evaluation",
    "SloCounts",
    "SloSpec",
    "SloWindow",
    "SloWindows",
    "epoch_minute",
    "minutes_of",
]
