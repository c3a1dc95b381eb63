"""An SLO's status now: SLI and budget over its window, and the burn rate of each alert window pair."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import Agent, MetricRollup, Slo, utcnow
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


def _agents(session: Session, labels: dict[str, str]) -> list[str]:
    return [a.id for a in session.scalars(select(Agent)) if all(a.labels.get(k) == v for k, v in labels.items())]


def _rows(session: Session, slo: Slo, agents: list[str], since: datetime) -> Iterable[MetricRollup]:
    metric = "spillway.request.duration" if slo.sli_kind == "latency" else "spillway.requests"
    if not agents:
        return []
    query = select(MetricRollup).where(
        MetricRollup.metric == metric, MetricRollup.agent_id.in_(agents), MetricRollup.minute >= since
    )
    model = (slo.selector or {}).get("model")
    return [r for r in session.scalars(query) if model is None or r.attributes.get("model") == model]


def counts_of(slo: Slo, rows: Iterable[MetricRollup]) -> Counts:
    total = Counts()
    for row in rows:
        if slo.sli_kind == "latency":
            if row.attributes.get("outcome") != "local":
                continue  # latency is judged on answered requests; availability judges the rest
            assert slo.threshold_ms is not None
            good = good_under_threshold(row.buckets, row.bounds, slo.threshold_ms / 1000)
            total += Counts(good, float(row.count))
        else:
            outcome = row.attributes.get("outcome")
            total += Counts(row.total if outcome in GOOD_OUTCOMES else 0.0, row.total)
    return total


def slo_status(session: Session, slo: Slo, now: datetime | None = None) -> dict[str, Any]:
    """SLI, budget and burn rates from the minute rollups of the agents and model the SLO selects."""
    now = now or utcnow()
    agents = _agents(session, dict((slo.selector or {}).get("labels") or {}))
    longest = max([slo.window, *(w["long"] for w in slo.alert_windows)])
    rows = list(_rows(session, slo, agents, now - timedelta(seconds=longest)))

    def within(seconds: int) -> Counts:
        start = now - timedelta(seconds=seconds)
        return counts_of(slo, (r for r in rows if r.minute >= start))

    window = within(slo.window)
    alerts = []
    for pair in slo.alert_windows:
        long_rate = burn_rate(within(pair["long"]), slo.objective)
        short_rate = burn_rate(within(pair["short"]), slo.objective)
        alerts.append({
            "long": pair["long"], "short": pair["short"], "threshold": pair["burn_rate"],
            "severity": pair.get("severity", "page"), "long_burn_rate": long_rate, "short_burn_rate": short_rate,
            "firing": firing(long_rate, short_rate, pair["burn_rate"]),
        })  # fmt: skip
    return {
        "slo": slo.id,
        "name": slo.name,
        "agents": len(agents),
        "window": slo.window,
        "objective": slo.objective,
        "sli": sli(window),
        "good": window.good,
        "total": window.total,
        "error_budget": error_budget(slo.objective),
        "budget_remaining": budget_remaining(window, slo.objective),
        "alerts": alerts,
    }
