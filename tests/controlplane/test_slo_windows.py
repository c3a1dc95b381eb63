"""The in-memory SLO windows agree with a brute-force evaluation over the database's minute rollups, whatever
order rollups arrive in, as time moves on, when exports arrive late, and when SLOs or agents change."""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import select

from controlplane.db.models import Agent, MetricRollup, Slo
from controlplane.slo.maths import GOOD_OUTCOMES, good_under_threshold
from controlplane.slo.windows import Evaluation, SloWindows
from spillway.contract.names import ATTR_MODEL, ATTR_OUTCOME
from tests.utils.rollups import add_agent, add_rollup

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc)


def _slo(session: Any, ident: str, kind: str, window: int, alerts: list[dict[str, Any]], **extra: Any) -> Slo:
    row = Slo(id=ident, name=ident, version=1, selector={"labels": {"site": "berlin"}, "model": "mlp"},
              sli_kind=kind, threshold_ms=10.0 if kind == "latency" else None, objective=99.0, window=window,
              alert_windows=alerts, **extra)  # fmt: skip
    session.add(row)
    return row


def _brute(session: Any, slo: Slo, agents: list[str], now: datetime, seconds: int) -> tuple[float, float]:
    """Good and total straight from the rollups, over whole minutes ending with `now`'s minute."""
    latest = now.replace(second=0, microsecond=0)
    start = latest - timedelta(minutes=math.ceil(seconds / 60) - 1)
    metric = "spillway.request.duration" if slo.sli_kind == "latency" else "spillway.requests"
    good = total = 0.0
    for row in session.scalars(select(MetricRollup).where(MetricRollup.metric == metric)):
        minute = row.minute if row.minute.tzinfo else row.minute.replace(tzinfo=timezone.utc)
        if row.agent_id not in agents or not start <= minute <= latest or row.attributes[ATTR_MODEL] != "mlp":
            continue
        outcome = row.attributes[ATTR_OUTCOME]
        if slo.sli_kind == "latency":
            if outcome == "local":
                good += good_under_threshold(row.buckets, row.bounds, 0.01)
                total += row.count
        else:
            good += row.total if outcome in GOOD_OUTCOMES else 0.0
            total += row.total
    return good, total


def _of(evaluations: list[Evaluation], slo_id: str) -> Evaluation:
    return next(e for e in evaluations if e.spec.id == slo_id)


def test_windows_match_the_rollups_as_time_moves_and_exports_arrive_late(factory: Any) -> None:
    rng = random.Random(7)
    alerts = [{"long": 3600, "short": 300, "burn_rate": 14.4}, {"long": 6 * 3600, "short": 1800, "burn_rate": 6}]
    with factory() as session, session.begin():
        for ident, site in [("a1", "berlin"), ("a2", "berlin"), ("a3", "paris")]:
            add_agent(session, ident, site)
        _slo(session, "lat", "latency", 6 * 3600, alerts)
        _slo(session, "avail", "availability", 6 * 3600, alerts)
    windows = SloWindows()
    now = T0
    for step in range(90):  # 90 cycles, 1 to 9 minutes apart: some minutes are never seen "live"
        now += timedelta(minutes=rng.randint(1, 9), seconds=rng.randint(0, 59))
        with factory() as session, session.begin():
            for _ in range(rng.randint(0, 6)):
                agent = rng.choice(["a1", "a2", "a3"])
                minute = now.replace(second=0, microsecond=0) - timedelta(minutes=rng.choice([0, 0, 1]))
                n = rng.randint(1, 50)
                add_rollup(session, agent, minute, "spillway.request.duration", "local", n, fast=rng.randint(0, n))
                add_rollup(session, agent, minute, "spillway.requests", rng.choice(["local", "rejected", "error"]), n)
                add_rollup(session, agent, minute, "spillway.requests", "local", n, model="other")
        with factory() as session:
            evaluations = windows.evaluate(session, now)
            for slo_id in ("lat", "avail"):
                slo = session.get(Slo, slo_id)
                assert slo is not None
                evaluation = _of(evaluations, slo_id)
                assert evaluation.agents == ["a1", "a2"]
                for seconds in (300, 1800, 3600, 6 * 3600):
                    sums = evaluation.window if seconds == 6 * 3600 else None
                    pair = [p for p in evaluation.alerts if seconds in (p[0]["long"], p[0]["short"])]
                    if pair:
                        sums = pair[0][1] if pair[0][0]["long"] == seconds else pair[0][2]
                    assert sums is not None
                    expected = _brute(session, slo, ["a1", "a2"], now, seconds)
                    assert (float(sums[0].sum()), float(sums[1].sum())) == pytest.approx(expected), (step, seconds)
                per_agent = {row["agent"]: (row["good"], row["total"]) for row in evaluation.per_agent()}
                for agent in ("a1", "a2"):
                    assert per_agent[agent] == pytest.approx(_brute(session, slo, [agent], now, 6 * 3600))


def test_long_windows_are_exact_to_within_an_hour_and_survive_a_restart(factory: Any) -> None:
    alerts = [{"long": 3 * 86400, "short": 6 * 3600, "burn_rate": 1}]
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _slo(session, "avail", "availability", 7 * 86400, alerts)
        for hours_ago in range(0, 8 * 24, 5):  # 40 rollups spread over 8 days, 2 requests each, 1 bad
            minute = T0 - timedelta(hours=hours_ago, minutes=17)
            add_rollup(session, "a1", minute, "spillway.requests", "local", 1)
            add_rollup(session, "a1", minute, "spillway.requests", "rejected", 1)
    with factory() as session:
        evaluation = _of(SloWindows().evaluate(session, T0), "avail")
        slo = session.get(Slo, "avail")
        assert slo is not None
        for sums, seconds in ((evaluation.window, 7 * 86400), (evaluation.alerts[0][1], 3 * 86400)):
            exact = _brute(session, slo, ["a1"], T0, seconds)
            wider = _brute(session, slo, ["a1"], T0, seconds + 3600)
            got = float(sums[1].sum())
            assert exact[1] <= got <= wider[1]  # the far edge is whole hours
        assert evaluation.status()["sli"] == pytest.approx(0.5)


def test_an_slo_change_or_an_agent_joining_reloads_what_changed(factory: Any) -> None:
    alerts = [{"long": 3600, "short": 300, "burn_rate": 2}]
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        add_agent(session, "a2", "paris")
        _slo(session, "lat", "latency", 86400, alerts)
        for agent in ("a1", "a2"):
            add_rollup(session, agent, T0 - timedelta(hours=2), "spillway.request.duration", "local", 10, fast=9)
        add_rollup(session, "a2", T0 - timedelta(minutes=10), "spillway.request.duration", "local", 5, fast=5)
    windows = SloWindows()
    with factory() as session:
        assert _of(windows.evaluate(session, T0), "lat").status()["total"] == 10
    with factory() as session, session.begin():
        agent = session.get(Agent, "a2")
        assert agent is not None
        agent.labels = {"site": "berlin"}  # joins the SLO: its history is read in
    with factory() as session:
        status = _of(windows.evaluate(session, T0), "lat").status()
        assert (status["agents"], status["good"], status["total"]) == (2, 23, 25)
    with factory() as session, session.begin():
        slo = session.get(Slo, "lat")
        assert slo is not None
        slo.threshold_ms = 100.0  # a new version: every agent's history is judged again
    with factory() as session:
        status = _of(windows.evaluate(session, T0), "lat").status()
        assert (status["good"], status["total"]) == (25, 25)
    with factory() as session, session.begin():
        agent = session.get(Agent, "a1")
        assert agent is not None
        agent.labels = {}  # leaves the SLO
    with factory() as session:
        evaluation = _of(windows.evaluate(session, T0), "lat")
        assert (evaluation.status()["agents"], evaluation.status()["total"]) == (1, 15)
        assert evaluation.status("a1")["total"] == 0
        assert float(evaluation.alerts[0][1][1].sum()) == 5  # the last hour, kept at minute resolution
