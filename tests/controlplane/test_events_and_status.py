"""The event timeline (filters, time range, cursors) and the fleet status summary."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import update

from controlplane.db import Agent, make_engine
from tests.conftest import Api
from tests.utils.builders import make_agent, make_rule, make_slo


def test_events_filter_by_agent_rule_kind_and_time(api: Api) -> None:
    agent = api.call("POST", "/api/v1/agents", json=make_agent()).json()["agent"]
    rule = api.call("POST", "/api/v1/rules", json=make_rule()).json()
    api.call("POST", "/api/v1/slos", json=make_slo())
    api.call("PATCH", f"/api/v1/agents/{agent['id']}", json={"labels": {"site": "paris"}})

    by_agent = api.call("GET", "/api/v1/events", params={"agent": agent["id"]}).json()["items"]
    assert [e["kind"] for e in by_agent] == ["agent.updated", "agent.created"]
    assert by_agent[0]["data"]["changes"]["labels"] == {
        "from": {"site": "berlin", "tier": "edge"},
        "to": {"site": "paris"},
    }
    by_rule = api.call("GET", "/api/v1/events", params={"rule": rule["id"]}).json()["items"]
    assert [e["kind"] for e in by_rule] == ["rule.created"]
    assert by_rule[0]["data"]["spec"]["hysteresis"] == rule["hysteresis"]  # the API's names ("for"), as the rule reads
    assert "for" in rule["hysteresis"]
    assert api.call("GET", "/api/v1/events", params={"kind": "slo.created"}).json()["items"][0]["subject_type"] == "slo"

    now = datetime.now(timezone.utc)
    recent = api.call("GET", "/api/v1/events", params={"since": (now - timedelta(minutes=5)).isoformat()}).json()
    assert len(recent["items"]) >= 4
    past = api.call("GET", "/api/v1/events", params={"until": (now - timedelta(minutes=5)).isoformat()}).json()
    assert past["items"] == []
    naive = api.call("GET", "/api/v1/events", params={"since": "2026-01-01T00:00:00"})
    assert naive.status_code == 422
    assert naive.json()["details"][0]["field"] == "since"

    one = by_agent[0]
    assert api.call("GET", f"/api/v1/events/{one['id']}", role="viewer").json() == one
    assert api.call("GET", "/api/v1/events/999999").status_code == 404


def test_events_paginate_newest_first_without_gaps(api: Api) -> None:
    for i in range(5):
        api.call("POST", "/api/v1/slos", json=make_slo(name=f"ev-{i}"))
    ids: list[int] = []
    cursor = None
    for _ in range(10):
        page = api.call("GET", "/api/v1/events", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        ids += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert ids == sorted(ids, reverse=True)
    assert len(ids) == len(set(ids)) >= 5 + 3  # five SLOs plus the three test keys


def test_status_counts_the_fleet(sqlite_api: Api) -> None:
    empty = sqlite_api.call("GET", "/api/v1/status", role="viewer").json()
    assert empty["agents"] == {"total": 0, "healthy": 0, "stale": 0, "never_seen": 0}
    seen = sqlite_api.call("POST", "/api/v1/agents", json=make_agent()).json()
    sqlite_api.call("POST", "/api/v1/agents", json=make_agent())
    sqlite_api.call("POST", "/api/v1/rules", json=make_rule(enabled=False))
    sqlite_api.call("POST", "/api/v1/slos", json=make_slo())
    # An agent token on an operator endpoint is refused and does not count as the agent being seen.
    assert (
        sqlite_api.client.get("/api/v1/status", headers={"Authorization": f"Bearer {seen['token']}"}).status_code == 403
    )
    assert sqlite_api.call("GET", "/api/v1/status").json()["agents"]["never_seen"] == 2
    # Telemetry will set last_seen; here the agent reported a moment ago.
    engine = make_engine(sqlite_api.url)
    with engine.begin() as conn:
        conn.execute(update(Agent).where(Agent.id == seen["agent"]["id"]).values(last_seen=datetime.now(timezone.utc)))
    engine.dispose()
    status = sqlite_api.call("GET", "/api/v1/status").json()
    assert status["agents"] == {"total": 2, "healthy": 1, "stale": 0, "never_seen": 1}
    assert (status["slos"], status["rules"], status["rules_enabled"], status["backends"]) == (1, 1, 0, 0)


def test_time_bounds_far_out_are_422_not_500(sqlite_api: Api) -> None:
    for params in ({"since": "9999-12-31T23:00:00-05:00"}, {"until": "0001-01-01T00:00:00+05:00"}):
        response = sqlite_api.call("GET", "/api/v1/events", params=params)
        assert response.status_code == 422, response.text
        assert response.json()["details"][0]["field"] in params
