"""History for charts: an SLO's figures per step against hand-computed cases (minutes of the last six hours, hours
held in memory, and hours read back from the rollups), the status's data coverage, and the agent and fleet
telemetry histories through the API (every step present, bounded, filters, 4xx naming the field)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy.orm import Session

from controlplane.api import history as history_api
from controlplane.db import make_engine, make_sessionmaker
from controlplane.db.models import Slo, utcnow
from controlplane.history import Steps
from controlplane.slo.history import slo_history
from controlplane.slo.windows import Evaluation, SloWindows, epoch_minute
from spillway.contract.names import QUEUE_DEPTH
from tests.conftest import Api
from tests.utils.builders import make_slo
from tests.utils.rollups import add_agent, add_gauge, add_requests, add_rollup

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc)


def _slo(session: Any, ident: str, window: int, alerts: list[dict[str, Any]]) -> None:
    session.add(Slo(id=ident, name=ident, version=1, selector={"labels": {"site": "berlin"}, "model": "mlp"},
                    sli_kind="availability", threshold_ms=None, objective=99.0, window=window,
                    alert_windows=alerts))  # fmt: skip


def _minute(session: Any, agent: str, minute: datetime, total: int, bad: int) -> None:
    add_rollup(session, agent, minute, "spillway.requests", "local", total - bad)
    if bad:
        add_rollup(session, agent, minute, "spillway.requests", "rejected", bad)


def _history(factory: Any, windows: SloWindows, slo: str, now: datetime, window_s: int,
             step_s: int) -> tuple[list[dict[str, Any]], Evaluation]:  # fmt: skip
    with factory() as session:
        counts = windows.counts(session, slo, now)
        assert counts is not None
        steps = Steps(window_s, step_s, -(-window_s // step_s), counts.latest)
        points = slo_history(session, counts, steps, now)
        evaluation = next(e for e in windows.evaluate(session, now) if e.spec.id == slo)
    return points, evaluation


def _same_as_status(point: dict[str, Any], evaluation: Evaluation) -> None:
    status = evaluation.status()
    assert point["window_sli"] == pytest.approx(status["sli"])
    assert point["budget_remaining"] == pytest.approx(status["budget_remaining"])
    for mine, theirs in zip(point["alerts"], status["alerts"], strict=True):
        assert mine["long_burn_rate"] == pytest.approx(theirs["long_burn_rate"])
        assert mine["short_burn_rate"] == pytest.approx(theirs["short_burn_rate"])
        assert mine["firing"] == theirs["firing"]


# ---- the SLO history, hand-computed ------------------------------------------------------------


def test_slo_history_per_step_from_minutes_is_exact_and_ends_with_the_status(factory: Any) -> None:
    alerts = [{"long": 3600, "short": 300, "burn_rate": 14.4}, {"long": 3600, "short": 300, "burn_rate": 1.5}]
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        add_agent(session, "a2", "paris")  # not selected: its bad minutes never count
        _slo(session, "avail", 6 * 3600, alerts)
        for i in range(30):  # 100 requests a minute; 1 bad in minutes 0-9, 4 in 10-19, none after
            _minute(session, "a1", T0 + timedelta(minutes=i), 100, 1 if i < 10 else 4 if i < 20 else 0)
            _minute(session, "a2", T0 + timedelta(minutes=i), 100, 50)
    now = T0 + timedelta(minutes=29, seconds=30)
    points, evaluation = _history(factory, SloWindows(), "avail", now, 1800, 300)
    # Steps of 5 minutes ending with minute 29; each step's window (6 h) and 1 h alert window hold every minute so far.
    expected = [  # (good, total, step sli, window bad / window total)
        (495, 500, 0.99, 5 / 500), (495, 500, 0.99, 10 / 1000), (480, 500, 0.96, 30 / 1500),
        (480, 500, 0.96, 50 / 2000), (500, 500, 1.0, 50 / 2500), (500, 500, 1.0, 50 / 3000),
    ]  # fmt: skip
    assert [p["ts"] for p in points] == [T0 + timedelta(minutes=5 * (j + 1)) for j in range(5)] + [now]
    for point, (good, total, step_sli, bad_share) in zip(points, expected, strict=True):
        assert (point["good"], point["total"]) == (good, total)
        assert point["sli"] == pytest.approx(step_sli)
        assert point["window_sli"] == pytest.approx(1 - bad_share)
        assert point["budget_remaining"] == pytest.approx(1 - bad_share / 0.01)
        page, ticket = point["alerts"]
        assert page["long_burn_rate"] == pytest.approx(bad_share / 0.01)
        assert page["short_burn_rate"] == pytest.approx((1 - step_sli) / 0.01)
        assert page["firing"] is False  # 14.4 is never reached
        assert ticket["firing"] is (bad_share / 0.01 >= 1.5 and (1 - step_sli) / 0.01 >= 1.5)
    assert [p["alerts"][1]["firing"] for p in points] == [False, False, True, True, False, False]
    _same_as_status(points[-1], evaluation)


def test_slo_history_beyond_six_hours_counts_hours_and_reads_older_ones_back(factory: Any) -> None:
    # A 1-day SLO keeps 25 hours in memory; a day of history needs the SLO window of its first point, a day before
    # that: those hours come from the rollups. Hour h holds 100 requests, h of them bad, at minute 10.
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _slo(session, "day", 86400, [{"long": 3600, "short": 300, "burn_rate": 14.4}])
        for h in range(48):
            _minute(session, "a1", T0 + timedelta(hours=h, minutes=10), 100, h)
    now = T0 + timedelta(hours=47, minutes=30, seconds=5)
    points, evaluation = _history(factory, SloWindows(), "day", now, 86400, 3600)
    assert len(points) == 24
    for point, hour in zip(points, range(24, 48), strict=True):  # each step ends at minute 30 of `hour`
        assert (point["good"], point["total"]) == (100 - hour, 100)
        window_bad = sum(range(hour - 23, hour + 1))  # the 24 hours ending with this one
        assert point["window_sli"] == pytest.approx(1 - window_bad / 2400), hour
        assert point["budget_remaining"] == pytest.approx(1 - window_bad / 2400 / 0.01)
    assert points[-1]["ts"] == now
    assert points[-1]["alerts"][0]["short_burn_rate"] is None  # nothing in the last 5 minutes
    _same_as_status(points[-1], evaluation)


def test_slo_history_beyond_six_hours_ends_steps_on_hours_and_leaves_uncountable_short_windows_null(
    factory: Any,
) -> None:
    # 30 hours of 10 requests a minute, every one bad. Steps of an hour end on whole hours, so an old step holds its
    # 60 minutes (not the hours that happen to start inside it); a 5-minute window older than the six hours kept by
    # the minute cannot be counted from hours: null, not "not firing".
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _slo(session, "down", 86400, [{"long": 3600, "short": 300, "burn_rate": 14.4}])
        for i in range(30 * 60):
            _minute(session, "a1", T0 + timedelta(minutes=i), 10, 10)
    now = T0 + timedelta(hours=29, minutes=59, seconds=5)
    windows = SloWindows()
    with factory() as session:
        counts = windows.counts(session, "down", now)
        assert counts is not None
        aligned = Steps(86400, 3600, 24, counts.latest // 60 * 60 + 59)
        points = slo_history(session, counts, aligned, now)
    assert len(points) == 24
    kept_from = counts.first_minute
    for point in points:
        assert (point["good"], point["total"]) == (0, 600)
        assert point["window_sli"] == 0.0
        page = point["alerts"][0]
        assert page["long_burn_rate"] == pytest.approx(100.0)
        end = epoch_minute(point["ts"]) - 1
        if end - 4 >= kept_from:
            assert page["short_burn_rate"] == pytest.approx(100.0) and page["firing"] is True
        else:
            assert page["short_burn_rate"] is None and page["firing"] is None
    assert sum(p["alerts"][0]["firing"] is None for p in points) == 18  # the steps older than the six hours kept


# ---- the status's coverage ---------------------------------------------------------------------


def test_an_slo_younger_than_its_window_says_how_much_it_covers(factory: Any) -> None:
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _slo(session, "young", 28 * 86400, [{"long": 3600, "short": 300, "burn_rate": 14.4}])
        _slo(session, "short", 3600, [{"long": 3600, "short": 300, "burn_rate": 14.4}])
        for i in range(5):
            _minute(session, "a1", T0 + timedelta(minutes=i), 10, 1)
    now = T0 + timedelta(minutes=4, seconds=30)
    with factory() as session:
        evaluations = {e.spec.id: e for e in SloWindows().evaluate(session, now)}
    young = evaluations["young"].status()
    assert young["observed_since"] == T0 and young["observed"] == 270  # 5 minutes of data, the last one half gone
    assert evaluations["young"].per_agent()[0]["observed"] == 270
    later = now + timedelta(hours=2)  # the 1-hour SLO's window is now full of... nothing: no events
    with factory() as session, session.begin():
        for i in range(5, 130):
            _minute(session, "a1", T0 + timedelta(minutes=i), 10, 0)
    with factory() as session:
        evaluations = {e.spec.id: e for e in SloWindows().evaluate(session, later)}
    assert evaluations["short"].status()["observed"] == 3600  # data before the window: the whole window
    assert evaluations["young"].status()["observed_since"] == T0
    with factory() as session:
        empty = {e.spec.id: e for e in SloWindows().evaluate(session, later + timedelta(days=40))}
    assert (empty["young"].status()["observed_since"], empty["young"].status()["observed"]) == (None, 0)


def test_a_long_window_full_of_data_covers_the_window(factory: Any) -> None:
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _slo(session, "day", 86400, [{"long": 3600, "short": 300, "burn_rate": 14.4}])
        for h in range(30):
            _minute(session, "a1", T0 + timedelta(hours=h), 10, 0)
    with factory() as session:
        evaluation = SloWindows().evaluate(session, T0 + timedelta(hours=29, minutes=1))[0]
    assert evaluation.status()["observed"] == 86400


# ---- through the API ---------------------------------------------------------------------------


@contextmanager
def _db(api: Api) -> Iterator[Session]:
    engine = make_engine(api.url)
    try:
        with make_sessionmaker(engine)() as session, session.begin():
            yield session
    finally:
        engine.dispose()


def _this_minute() -> datetime:
    return utcnow().replace(second=0, microsecond=0)


def _by_ts(points: list[dict[str, Any]]) -> dict[datetime, dict[str, Any]]:
    return {datetime.fromisoformat(p["ts"].replace("Z", "+00:00")): p for p in points}


def test_an_agents_history_has_every_step_and_each_minutes_figures(sqlite_api: Api) -> None:
    now = _this_minute()
    with _db(sqlite_api) as session:
        add_agent(session, "a1", "berlin")
        add_agent(session, "a2", "berlin")
        for back in (2, 3, 4):  # 10 served within 10 ms and 2 refused, each of three minutes
            minute = now - timedelta(minutes=back)
            add_requests(session, "a1", minute, 10, 10, bad=2)
            add_gauge(session, "a1", minute, QUEUE_DEPTH, float(back), model="mlp", priority=1)
            add_gauge(session, "a1", minute, "hw.gpu.memory.usage", 100.0 + back, **{"hw.id": "0"})
            add_requests(session, "a2", minute, 5, 0)  # within 100 ms
            add_gauge(session, "a2", minute, QUEUE_DEPTH, 10.0, model="mlp", priority=1)
            add_rollup(session, "a2", minute, "spillway.requests", "local", 7, model="other")
    answer = sqlite_api.call("GET", "/api/v1/agents/a1/metrics/history", role="viewer",
                             params={"window": "10m", "step": "1m"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["agent"], body["window"], body["step"], len(body["points"])) == ("a1", "10m", "1m", 10)
    points = _by_ts(body["points"])
    stamps = sorted(points)
    assert all(b - a == timedelta(minutes=1) for a, b in pairwise(stamps))
    assert stamps[-1] >= now  # the last step holds the current minute
    busy = points[now - timedelta(minutes=3)]
    assert (busy["requests"], busy["outcomes"]) == (12, {"local": 10, "rejected": 2})
    assert busy["rps"] == pytest.approx(12 / 60)
    assert busy["p50_ms"] == pytest.approx(5.0) and busy["p99_ms"] == pytest.approx(9.9)  # all in (0, 10 ms]
    assert [(g["model"], g["priority"], g["requests"], g["queue_depth"]) for g in busy["groups"]] == [("mlp", 1, 12, 3)]
    assert busy["device"] == [{"metric": "hw.gpu.memory.usage", "attributes": {"hw.id": "0"}, "last": 103.0,
                               "max": 103.0}]  # fmt: skip
    idle = points[now - timedelta(minutes=6)]
    assert (idle["requests"], idle["p50_ms"], idle["groups"], idle["device"]) == (0, None, [], [])

    coarse = sqlite_api.call("GET", "/api/v1/agents/a1/metrics/history", params={"window": "10m", "step": "5m"})
    assert len(coarse.json()["points"]) == 2
    assert sum(p["requests"] for p in coarse.json()["points"]) == 36

    fleet = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "10m", "step": "1m"}).json()
    assert fleet["agent"] is None and "device" not in fleet["points"][0]
    both = _by_ts(fleet["points"])[now - timedelta(minutes=3)]
    assert (both["requests"], both["outcomes"]) == (24, {"local": 22, "rejected": 2})
    mlp = next(g for g in both["groups"] if g["model"] == "mlp")
    assert (mlp["requests"], mlp["queue_depth"]) == (17, 13)  # the agents' queues add up
    assert both["p50_ms"] == pytest.approx(7.5)  # rank 7.5 of 15: 10 in (0, 10 ms], 5 in (10, 100 ms]
    only = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "10m", "model": "mlp"}).json()
    assert sum(p["requests"] for p in only["points"]) == 3 * 17
    acme = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "10m", "tenant": "acme"}).json()
    assert sum(p["requests"] for p in acme["points"]) == 0  # these agents predate tenants: every request is default's
    default = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "10m", "tenant": "default"}).json()
    assert sum(p["requests"] for p in default["points"]) == 3 * 24


def test_history_bounds_and_defaults(sqlite_api: Api) -> None:
    with _db(sqlite_api) as session:
        add_agent(session, "a1", "berlin")
    default = sqlite_api.call("GET", "/api/v1/agents/a1/metrics/history").json()
    assert (default["window"], default["step"], len(default["points"])) == ("1h", "1m", 60)
    odd = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "361m"}).json()
    assert (odd["window"], odd["step"], len(odd["points"])) == ("365m", "5m", 73)  # grown to whole default steps
    week = sqlite_api.call("GET", "/api/v1/metrics/history", params={"window": "7d"}).json()
    assert (week["step"], len(week["points"])) == ("1h", 168)
    refused = {
        ("7d", "1m"): "query.step", ("1h", "90s"): "query.step", ("1h", "0"): "query.step",
        ("8d", None): "query.window", ("30s", None): "query.window", ("1h", "2h"): "query.step",
        ("1h", "7m"): "query.step",
    }  # fmt: skip
    for (window, step), field in refused.items():
        params = {"window": window, **({"step": step} if step else {})}
        answer = sqlite_api.call("GET", "/api/v1/agents/a1/metrics/history", params=params)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.json()["details"][0]["field"] == field, (params, answer.json())
    nobody = sqlite_api.call("GET", "/api/v1/agents/nobody/metrics/history")
    assert nobody.status_code == 404 and "nobody" in nobody.json()["message"]
    assert sqlite_api.client.get("/api/v1/metrics/history").status_code == 401


def test_an_slo_chart_over_half_an_hour_of_data_ends_with_its_status(sqlite_api: Api) -> None:
    now = _this_minute()
    with _db(sqlite_api) as session:
        add_agent(session, "a1", "berlin")
        for back in range(30):
            add_requests(session, "a1", now - timedelta(minutes=back), 10, 9, bad=1)
    created = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(
        selector={"labels": {"site": "berlin"}, "model": "mlp"}, sli_kind="availability", threshold_ms=None,
        objective=99, window="28d"))  # fmt: skip
    slo = created.json()["id"]
    status = sqlite_api.call("GET", f"/api/v1/slos/{slo}/status", role="viewer").json()
    answer = sqlite_api.call("GET", f"/api/v1/slos/{slo}/history", role="viewer", params={"window": "1h"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["slo"], body["window"], body["step"], body["slo_window"], body["objective"]) == (
        slo, "1h", "1m", "28d", 99.0)  # fmt: skip
    assert len(body["points"]) == 60
    charted = [p for p in body["points"] if p["sli"] is not None]
    assert len(charted) > 1
    assert all(p["sli"] == pytest.approx(10 / 11) for p in charted)
    last = body["points"][-1]
    assert last["window_sli"] == pytest.approx(status["sli"])
    assert last["budget_remaining"] == pytest.approx(status["budget_remaining"])
    for mine, theirs in zip(last["alerts"], status["alerts"], strict=True):
        assert (mine["long_burn_rate"], mine["short_burn_rate"]) == pytest.approx(
            (theirs["long_burn_rate"], theirs["short_burn_rate"]))  # fmt: skip
    assert status["observed"] != "28d" and status["observed_since"] is not None
    long = sqlite_api.call("GET", f"/api/v1/slos/{slo}/history", params={"window": "12h", "step": "5m"})
    assert long.status_code == 422 and long.json()["details"][0]["field"] == "query.step"
    day = sqlite_api.call("GET", f"/api/v1/slos/{slo}/history", params={"window": "1d"}).json()
    assert day["step"] == "1h" and len(day["points"]) == 24
    assert all(datetime.fromisoformat(p["ts"]).minute == 0 for p in day["points"][:-1])  # steps end on whole hours
    odd = sqlite_api.call("GET", f"/api/v1/slos/{slo}/history", params={"window": "12h", "step": "90m"})
    assert odd.status_code == 422 and odd.json()["details"][0]["field"] == "query.step"
    assert sqlite_api.call("GET", "/api/v1/slos/nope/history").status_code == 404


def test_histories_take_turns_and_a_caller_kept_waiting_too_long_is_told_to_retry(
    sqlite_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _db(sqlite_api) as session:
        add_agent(session, "a1", "berlin")
    monkeypatch.setattr(history_api, "HEAVY_WAIT_S", 0.05)
    held = [history_api._heavy.acquire(timeout=5) for _ in range(history_api.HEAVY_AT_ONCE)]
    try:
        assert all(held)
        busy = sqlite_api.call("GET", "/api/v1/metrics/history", role="viewer")
        assert busy.status_code == 503 and busy.json()["error"] == "overloaded", busy.text
        assert busy.headers["retry-after"] == "5"
    finally:
        for _ in held:
            history_api._heavy.release()
    assert sqlite_api.call("GET", "/api/v1/metrics/history", role="viewer").status_code == 200
