"""SLO maths against hand-computed cases, and an SLO's status from real agent telemetry through the receiver."""

from __future__ import annotations

import httpx
import pytest

from controlplane.slo.maths import Counts, budget_remaining, burn_rate, error_budget, firing, good_under_threshold, sli
from edge_agent.scheduling.stats import ModelStats
from tests.conftest import Plane, telemetry_for
from tests.utils.builders import make_slo


def test_hand_computed_budget_and_burn_rates() -> None:
    # 99.5 % objective: a budget of 0.5 %. 10,000 requests, 25 bad: 0.25 % bad, half the budget.
    counts = Counts(good=9975, total=10_000)
    assert sli(counts) == pytest.approx(0.9975)
    assert error_budget(99.5) == pytest.approx(0.005)
    assert burn_rate(counts, 99.5) == pytest.approx(0.5)
    assert budget_remaining(counts, 99.5) == pytest.approx(0.5)
    # 1 % bad against a 0.1 % budget burns at 10: 14.4 does not fire, 6 does, on both windows only.
    hot = burn_rate(Counts(good=990, total=1000), 99.9)
    assert hot == pytest.approx(10.0)
    assert not firing(hot, hot, 14.4)
    assert firing(hot, hot, 6.0)
    assert not firing(hot, 1.0, 6.0)  # the short window has recovered: no page
    assert sli(Counts()) is None and burn_rate(Counts(), 99.0) is None  # no traffic: no verdict


def test_latency_good_counts_whole_buckets_only() -> None:
    bounds = [0.01, 0.05, 0.1]
    buckets = [5, 3, 2, 1]  # <=10 ms, <=50 ms, <=100 ms, slower
    assert good_under_threshold(buckets, bounds, 0.05) == 8
    assert good_under_threshold(buckets, bounds, 0.07) == 8  # between boundaries: the lower one (conservative)
    assert good_under_threshold(buckets, bounds, 0.1) == 10
    assert good_under_threshold(buckets, bounds, 0.001) == 0


def test_slo_status_from_real_agent_telemetry(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    latency = httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json=make_slo(
        name="fast", selector={"labels": {"site": "berlin"}, "model": "mlp"}, threshold_ms=10, objective=90,
        window="1d", alert_windows=[{"long": "1h", "short": "5m", "burn_rate": 2}]))  # fmt: skip
    availability = httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json=make_slo(
        name="up", selector={"labels": {"site": "berlin"}}, sli_kind="availability", threshold_ms=None,
        objective=99, window="1d", alert_windows=[{"long": "1h", "short": "5m", "burn_rate": 10}]))  # fmt: skip
    telemetry = telemetry_for(plane)  # buckets at 10 ms and 100 ms
    stats = ModelStats(listener=telemetry.recorder("mlp", 1))
    for total_s in [0.005] * 6 + [0.050] * 3 + [0.5]:  # 6 of 10 answered within 10 ms
        stats.request(1, "local", 0.001, 0.002, total_s)
    for _ in range(10):  # and 10 refused: 10 bad of 20 for availability
        stats.outcome(3, "rejected")
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()

    fast = httpx.get(f"{plane.url}/api/v1/slos/{latency.json()['id']}/status", headers=admin).json()
    assert (fast["agents"], fast["good"], fast["total"]) == (1, 6, 10)
    assert fast["sli"] == pytest.approx(0.6)
    assert fast["budget_remaining"] == pytest.approx(1 - 0.4 / 0.1)  # 4x the budget: -3
    assert fast["alerts"][0]["long_burn_rate"] == pytest.approx(4.0) and fast["alerts"][0]["firing"] is True
    up = httpx.get(f"{plane.url}/api/v1/slos/{availability.json()['id']}/status", headers=admin).json()
    assert (up["good"], up["total"]) == (10, 20)
    assert up["alerts"][0]["long_burn_rate"] == pytest.approx(50.0) and up["alerts"][0]["firing"] is True
    assert up["window"] == "1d" and up["alerts"][0]["long"] == "1h"
    fleet = httpx.get(f"{plane.url}/api/v1/status", params={"window": "5m"}, headers=admin).json()
    live = fleet["live"]
    assert (live["requests"], live["outcomes"]) == (20, {"local": 10, "rejected": 10})
    assert live["p50_ms"] == pytest.approx(10 * 5 / 6)  # rank 5 of 10, 6 in the (0, 10 ms] bucket
    assert live["p99_ms"] == 100  # rank 9.9 is in the +Inf bucket: the highest finite bound
    assert [(t["priority"], t["requests"]) for t in live["traffic"]] == [(1, 10), (3, 10)]
    states = {s["name"]: s for s in fleet["slo_states"]}
    assert states["fast"]["firing"] == ["1h/5m"] and states["up"]["sli"] == pytest.approx(0.5)
    assert fleet["agents"]["healthy"] == 1
    per_agent = httpx.get(f"{plane.url}/api/v1/slos/{latency.json()['id']}/agents", headers=admin).json()
    assert [(r["agent"], r["good"], r["total"]) for r in per_agent] == [(plane.agent_id, 6, 10)]
    missing = httpx.get(f"{plane.url}/api/v1/slos/nope/status", headers=admin)
    assert missing.status_code == 404
