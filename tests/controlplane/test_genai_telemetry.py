"""Generative models through the control plane's telemetry: the agent's real GenAI recorder and OTLP exporter into
the receiver, back out as the agent metrics' `generation` section and the fleet status' per-agent figures; SLOs of
kinds `ttft` and `tpot` (validation, good/bad counting, burn rates, the model selector) and a rule's TTFT latency
condition counted from the TTFT histogram."""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import select

from controlplane.db import make_engine, make_sessionmaker
from controlplane.db.models import Event, MetricRollup, Rule, Slo
from controlplane.query import Histogram, Rollup, summarise
from controlplane.rules.loop import ControlLoop, PolicyDefaults
from controlplane.schemas.rules import RuleCreate, parse_rules
from controlplane.schemas.slos import GENAI_THRESHOLDS_MS, SloCreate
from controlplane.slo.windows import SloSpec, SloWindows
from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from spillway.contract import names
from tests.conftest import Api, Plane, telemetry_for
from tests.utils.builders import make_agent, make_slo
from tests.utils.rollups import add_agent, add_requests

T0 = datetime(2026, 12, 1, 9, 0, 5, tzinfo=timezone.utc)
TTFT_BOUNDS = list(names.GENAI_TTFT_BUCKETS)
TPOT_BOUNDS = list(names.GENAI_TPOT_BUCKETS)


def _bucket_of(value: float, bounds: Sequence[float]) -> tuple[float, float]:
    index = bisect_left(bounds, value)
    return (bounds[index - 1] if index > 0 else 0.0), (bounds[index] if index < len(bounds) else math.inf)


def _assert_within_bucket(estimate_ms: float, samples: np.ndarray, q: float, bounds: Sequence[float]) -> None:
    true = float(np.quantile(samples, q, method="inverted_cdf"))  # an observed value, like a histogram's rank
    lower, upper = _bucket_of(true, bounds)
    assert lower * 1000 - 1e-6 <= estimate_ms <= upper * 1000 + 1e-6, (q, true, estimate_ms)


def _seconds(body: dict[str, Any]) -> float:
    since, until = (datetime.fromisoformat(body[k].replace("Z", "+00:00")) for k in ("since", "until"))  # 3.10
    return (until - since).total_seconds()


# ---- the agent metrics' generation section and the fleet status, from real telemetry ----------------------------


def test_generation_figures_from_real_agent_telemetry(plane: Plane) -> None:
    rng = np.random.default_rng(1402)
    local, overflowed = 300, 40
    size = local + overflowed
    ttft = rng.lognormal(mean=math.log(0.080), sigma=0.7, size=size)  # median 80 ms
    tpot = rng.uniform(0.020, 0.120, size=size)
    completion = rng.integers(2, 65, size=size)
    prompt = rng.integers(5, 200, size=size)
    duration = ttft + tpot * (completion - 1)

    telemetry = telemetry_for(plane)
    engine = {"preemptions": 0, "active": 0, "kv_blocks": {"used": 0, "total": 128}}
    telemetry.watch_engines(lambda: [("tiny-lm", engine)])
    generation = telemetry.generation("tiny-lm")
    for i in range(size):  # overflowed streams count in the GenAI histograms as well (the agent relays them)
        generation.finished(1 + 2 * (i % 2), "local" if i < local else "overflow", operation="chat",
                            prompt_tokens=int(prompt[i]), completion_tokens=int(completion[i]),
                            ttft_s=float(ttft[i]), duration_s=float(duration[i]))  # fmt: skip
    for _ in range(25):  # refused before a token: an outcome, no GenAI observation
        generation.outcome(3, "rejected")
    v2 = ModelStats(listener=telemetry.recorder("mlp", 1))  # a V2 model beside it: no generation entry
    for _ in range(7):
        v2.request(1, "local", 0.001, 0.002, 0.005)
    for used, preemptions, active in ((10, 2, 3), (96, 5, 9), (32, 7, 4)):  # cumulative preemptions: 7 in all
        engine.update(preemptions=preemptions, active=active, kv_blocks={"used": used, "total": 128})
        assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()
    # The receiver keeps the observable counter as deltas: the three cumulative readings add up to the last one.
    assert sum(r.total for r in plane.rollups(names.PREEMPTIONS)) == 7

    # A second agent that serves only a V2 model: its generative figures are null in the fleet status.
    admin = {"Authorization": f"Bearer {plane.admin}"}
    other = httpx.post(f"{plane.url}/api/v1/agents", json=make_agent(), headers=admin).json()
    settings = TelemetrySettings(agent_id=other["agent"]["id"], control_plane=plane.url, agent_token=other["token"],
                                 export_interval_s=3600)  # fmt: skip
    v2_only = AgentTelemetry(settings, probes=False)
    stats = ModelStats(listener=v2_only.recorder("mlp", 1))
    for _ in range(4):
        stats.request(1, "local", 0.001, 0.002, 0.005)
    assert v2_only.provider.force_flush(10_000)
    v2_only.shutdown()

    response = httpx.get(f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics", params={"window": "5m"},
                         headers=admin)  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    seconds = _seconds(body)
    (gen,) = body["generation"]
    assert gen["model"] == "tiny-lm"
    assert gen["requests"] == size + 25
    assert gen["outcomes"] == {"local": local, "overflow": overflowed, "rejected": 25}
    assert gen["streams_per_s"] == pytest.approx(size / seconds)
    recorded_tpot = (duration - ttft) / (completion - 1)  # what the recorder derives
    for key, samples, bounds in (("ttft_ms", ttft, TTFT_BOUNDS), ("tpot_ms", recorded_tpot, TPOT_BOUNDS),
                                 ("duration_ms", duration, list(names.GENAI_DURATION_BUCKETS))):  # fmt: skip
        figures = gen[key]
        assert figures["count"] == size
        assert figures["mean"] == pytest.approx(samples.mean() * 1000, rel=1e-6)
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            _assert_within_bucket(figures[name], samples, q, bounds)
    assert gen["ttft_ms"]["p50"] < gen["ttft_ms"]["p90"] <= gen["ttft_ms"]["p99"]
    assert gen["tokens_in_per_s"] == pytest.approx(prompt.sum() / seconds)
    assert gen["tokens_out_per_s"] == pytest.approx(completion.sum() / seconds)
    assert (gen["kv_blocks_used"], gen["kv_blocks_total"], gen["kv_cache_use"]) == (32, 128, 0.25)
    assert gen["preemptions"] == 7 and gen["preemptions_per_min"] == pytest.approx(7 * 60 / seconds)
    assert gen["active_streams"] == 4
    # The V2 model's figures are where they were; the generation gauges are not device gauges.
    assert [(t["model"], t["requests"]) for t in body["traffic"] if t["model"] == "mlp"] == [("mlp", 7)]
    assert not [g for g in body["device"] if g["metric"] in names.GENERATION_GAUGES]

    fleet = httpx.get(f"{plane.url}/api/v1/status", params={"window": "5m"}, headers=admin).json()
    live = fleet["live"]
    entries = {entry["agent"]: entry for entry in live["agents"]}
    assert set(entries) == {plane.agent_id, other["agent"]["id"]}
    mine, theirs = entries[plane.agent_id], entries[other["agent"]["id"]]
    assert mine["requests"] == size + 25 + 7 and theirs["requests"] == 4
    assert mine["ttft_p99_ms"] == pytest.approx(gen["ttft_ms"]["p99"])  # one model: the same histogram
    assert mine["tpot_p99_ms"] == pytest.approx(gen["tpot_ms"]["p99"])
    assert mine["tokens_out_per_s"] == pytest.approx(completion.sum() / _seconds(live))
    assert (theirs["ttft_p99_ms"], theirs["tpot_p99_ms"], theirs["tokens_out_per_s"]) == (None, None, None)
    assert theirs["name"] == other["agent"]["name"]


def test_an_agent_without_generative_models_has_an_empty_generation_section(plane: Plane) -> None:
    telemetry = telemetry_for(plane)
    ModelStats(listener=telemetry.recorder("mlp", 1)).request(1, "local", 0.001, 0.002, 0.005)
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()
    admin = {"Authorization": f"Bearer {plane.admin}"}
    body = httpx.get(f"{plane.url}/api/v1/agents/{plane.agent_id}/metrics", headers=admin).json()
    assert body["generation"] == [] and body["requests"] == 1


# ---- ttft and tpot SLOs ---------------------------------------------------------------------------------------


def test_ttft_and_tpot_slos_count_streams_within_the_threshold_per_model(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    alerts = [{"long": "1h", "short": "5m", "burn_rate": 1.5}]
    selector = {"labels": {"site": "berlin"}, "model": "tiny-lm"}
    made = {}
    for kind, threshold in (("ttft", 100), ("tpot", 50)):  # on the GenAI boundaries (and the latency ones)
        response = httpx.post(f"{plane.url}/api/v1/slos", headers=admin, json=make_slo(
            name=f"{kind}-fast", selector=selector, sli_kind=kind, threshold_ms=threshold, objective=90,
            window="1d", alert_windows=alerts))  # fmt: skip
        assert response.status_code == 201, response.text
        made[kind] = response.json()
    rule = httpx.post(f"{plane.url}/api/v1/rules", headers=admin, json={
        "name": "cap-when-first-tokens-are-slow", "selector": selector,
        "condition": {"kind": "latency", "metric": "ttft", "quantile": 0.9, "threshold_ms": 100, "window": 300,
                      "min_requests": 5},
        "action": {"kind": "cap_max_tokens", "max_tokens": 64},
    })  # fmt: skip
    assert rule.status_code == 201, rule.text

    telemetry = telemetry_for(plane)
    tiny, other = telemetry.generation("tiny-lm"), telemetry.generation("other-lm")
    # tiny-lm: 6 of 10 first tokens within 100 ms; 8 of 10 streams within 50 ms per output token (11 tokens each).
    for i, ttft_s in enumerate([0.05] * 6 + [0.3] * 3 + [3.0]):
        tpot_s = 0.03 if i < 8 else 0.2
        tiny.finished(1, "local", operation="chat", prompt_tokens=10, completion_tokens=11, ttft_s=ttft_s,
                      duration_s=ttft_s + 10 * tpot_s)  # fmt: skip
    for _ in range(10):  # another model, all slow: the model selector leaves it out
        other.finished(1, "local", operation="chat", prompt_tokens=10, completion_tokens=11, ttft_s=3.0,
                       duration_s=3.0 + 10 * 0.5)  # fmt: skip
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()

    ttft = httpx.get(f"{plane.url}/api/v1/slos/{made['ttft']['id']}/status", headers=admin).json()
    assert (ttft["agents"], ttft["good"], ttft["total"]) == (1, 6, 10)
    assert ttft["sli"] == pytest.approx(0.6) and ttft["budget_remaining"] == pytest.approx(1 - 0.4 / 0.1)
    assert ttft["alerts"][0]["long_burn_rate"] == pytest.approx(4.0) and ttft["alerts"][0]["firing"] is True
    tpot = httpx.get(f"{plane.url}/api/v1/slos/{made['tpot']['id']}/status", headers=admin).json()
    assert (tpot["good"], tpot["total"]) == (8, 10)
    assert tpot["alerts"][0]["short_burn_rate"] == pytest.approx(2.0) and tpot["alerts"][0]["firing"] is True
    per_agent = httpx.get(f"{plane.url}/api/v1/slos/{made['ttft']['id']}/agents", headers=admin).json()
    assert [(r["agent"], r["good"], r["total"]) for r in per_agent] == [(plane.agent_id, 6, 10)]
    states = {s["name"]: s for s in httpx.get(f"{plane.url}/api/v1/status", headers=admin).json()["slo_states"]}
    assert states["ttft-fast"]["firing"] == ["1h/5m"] and states["tpot-fast"]["sli"] == pytest.approx(0.8)

    # The rule's condition is counted like a ttft SLO over its window: from the TTFT histogram, tiny-lm only.
    windows: SloWindows = plane.app.state.slo_windows
    engine = make_engine(plane.db)
    try:
        with make_sessionmaker(engine)() as session:
            windows.refresh(session)
    finally:
        engine.dispose()
    found = windows.window_sums(f"rule:{rule.json()['id']}", [300])
    assert found is not None
    agents, (sums,) = found
    assert agents == [plane.agent_id] and (float(sums[0, 0]), float(sums[1, 0])) == (6, 10)


def test_ttft_and_tpot_slos_are_validated_naming_the_field(sqlite_api: Api) -> None:
    def refused(body: dict[str, Any], method: str = "POST", path: str = "/api/v1/slos") -> dict[str, Any]:
        response = sqlite_api.call(method, path, json=body)
        assert response.status_code == 422, response.text
        payload: dict[str, Any] = response.json()
        assert payload["error"] == "validation_error"
        return payload

    missing = refused(make_slo(sli_kind="ttft", threshold_ms=None))
    assert "threshold_ms is required for a ttft SLO" in missing["message"]
    off = refused(make_slo(sli_kind="ttft", threshold_ms=30))
    assert off["details"][0]["field"] == "body.threshold_ms"
    assert "30 is not a ttft bucket boundary" in off["message"] and "20, 40, 60, 80, 100, 250" in off["message"]
    tpot_off = refused(make_slo(sli_kind="tpot", threshold_ms=60))
    assert tpot_off["details"][0]["field"] == "body.threshold_ms"
    assert "60 is not a tpot bucket boundary" in tpot_off["message"] and "50, 75, 100" in tpot_off["message"]
    assert "threshold_ms applies only" in refused(make_slo(sli_kind="availability", threshold_ms=100))["message"]

    made = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(sli_kind="tpot", threshold_ms=100))
    assert made.status_code == 201, made.text
    assert (made.json()["sli_kind"], made.json()["threshold_ms"]) == ("tpot", 100)
    patched = refused({"sli_kind": "ttft", "threshold_ms": 75}, "PATCH", f"/api/v1/slos/{made.json()['id']}")
    assert "75 is not a ttft bucket boundary" in patched["message"]  # a tpot boundary, not a ttft one
    assert patched["details"][0]["field"] == "body.threshold_ms"


def test_ttft_and_tpot_thresholds_are_their_own_buckets_not_the_latency_ones(sqlite_api: Api) -> None:
    """250 ms (TTFT) and 75 ms (TPOT) are GenAI boundaries, not latency-histogram ones: accepted for these kinds."""
    for kind, threshold in (("ttft", 250), ("tpot", 75)):
        made = sqlite_api.call("POST", "/api/v1/slos", json=make_slo(sli_kind=kind, threshold_ms=threshold))
        assert made.status_code == 201, made.text
    assert sqlite_api.call("POST", "/api/v1/slos", json=make_slo(threshold_ms=250)).status_code == 422  # latency


def test_every_genai_boundary_is_a_valid_threshold_and_nothing_between() -> None:
    for kind, bounds in (("ttft", names.GENAI_TTFT_BUCKETS), ("tpot", names.GENAI_TPOT_BUCKETS)):
        assert GENAI_THRESHOLDS_MS[kind] == tuple(b * 1000 for b in bounds)
        for ms in GENAI_THRESHOLDS_MS[kind]:
            SloCreate.model_validate(make_slo(sli_kind=kind, threshold_ms=ms))
        for low, high in zip(GENAI_THRESHOLDS_MS[kind], GENAI_THRESHOLDS_MS[kind][1:], strict=False):
            with pytest.raises(ValueError, match="bucket boundary"):
                SloCreate.model_validate(make_slo(sli_kind=kind, threshold_ms=(low + high) / 2))


# ---- the windows and the control loop, from rollups written as the receiver writes them ---------------------------


def _genai(session: Any, agent: str, minute: datetime, metric: str, model: str, values: list[float]) -> None:
    """A GenAI histogram rollup of `values` (seconds), as the receiver stores one minute of them."""
    bounds = TTFT_BOUNDS if metric == names.GENAI_TTFT else TPOT_BOUNDS
    buckets = [0] * (len(bounds) + 1)
    for value in values:
        buckets[bisect_left(bounds, value)] += 1
    attributes = {names.ATTR_GENAI_MODEL: model, names.ATTR_GENAI_OPERATION: "chat"}
    series = hashlib.sha256(f"{metric}|{model}".encode()).hexdigest()
    session.add(MetricRollup(agent_id=agent, metric=metric, series=series, attributes=attributes, minute=minute,
                             kind="histogram", count=len(values), total=sum(values), buckets=buckets,
                             bounds=bounds))  # fmt: skip


def _rule(session: Any, name: str, condition: dict[str, Any], action: dict[str, Any], **hysteresis: Any) -> None:
    body = RuleCreate.model_validate({
        "name": name, "selector": {"labels": {"site": "berlin"}, "model": "tiny-lm"}, "condition": condition,
        "action": action, "hysteresis": hysteresis,
    }).model_dump()  # fmt: skip
    session.add(Rule(id=f"r-{name}", version=1, **body))


def test_rule_conditions_and_burn_rates_on_ttft_fire_with_their_numbers(factory: Any) -> None:
    minute = T0.replace(second=0)
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        session.add(Slo(id="s-ttft", name="first-token", version=1, selector={"model": "tiny-lm"}, sli_kind="ttft",
                        threshold_ms=250.0, objective=99.0, window=86400, alert_windows=[]))  # fmt: skip
        _rule(session, "cap-on-burn", {"kind": "burn_rate", "slo": "first-token", "long_window": 3600,
                                       "short_window": 300, "threshold": 2, "min_requests": 5},
              {"kind": "cap_max_tokens", "max_tokens": 64})  # fmt: skip
        _rule(session, "slow-tokens", {"kind": "latency", "metric": "tpot", "quantile": 0.9,
                                              "threshold_ms": 100, "window": 300, "min_requests": 5},
              {"kind": "cap_max_tokens", "max_tokens": 32})  # fmt: skip
        _rule(session, "fast-requests", {"kind": "latency", "quantile": 0.9, "threshold_ms": 10,
                                              "window": 300, "min_requests": 5},
              {"kind": "switch_variant", "version": 2})  # fmt: skip
        # tiny-lm: 7 of 10 first tokens within 250 ms (burn rate 30), 6 of 10 streams within 100 ms per token.
        _genai(session, "a1", minute, names.GENAI_TTFT, "tiny-lm", [0.2] * 7 + [0.5] * 3)
        _genai(session, "a1", minute, names.GENAI_TPOT, "tiny-lm", [0.05] * 6 + [0.3] * 4)
        _genai(session, "a1", minute, names.GENAI_TTFT, "big-lm", [5.0] * 20)  # not the selected model
        add_requests(session, "a1", minute, n=10, fast=10)  # V2 requests, all fast: the request rule stays calm
    with factory() as session:
        rules = {spec.id: SloSpec.of_rule(spec) for spec in parse_rules(session.scalars(select(Rule)))}
    assert rules["r-slow-tokens"] is not None and rules["r-slow-tokens"].rollups == (
        names.GENAI_TPOT, "histogram")  # fmt: skip
    assert rules["r-fast-requests"] is not None and rules["r-fast-requests"].sli_kind == "latency"
    assert rules["r-cap-on-burn"] is None  # a burn-rate condition reads its SLO's window

    windows = SloWindows()
    with factory() as session:
        (evaluation,) = [e for e in windows.evaluate(session, T0) if e.spec.id == "s-ttft"]
    status = evaluation.status()
    assert (status["good"], status["total"]) == (7, 10) and status["sli"] == pytest.approx(0.7)
    found = windows.window_sums("rule:r-slow-tokens", [300])
    assert found is not None and [float(x) for x in found[1][0][:, 0]] == [6, 10]

    defaults = PolicyDefaults(buckets_ms=[10.0, 100.0], export_interval_s=5, poll_interval_s=2, stale_after_s=15)
    cycle = ControlLoop(factory, windows, defaults).cycle(T0)
    assert sorted(t["kind"] for t in cycle.transitions) == ["rule.fired", "rule.fired"]
    with factory() as session:
        fired = {e.rule_id: e.data for e in session.scalars(select(Event).where(Event.kind == "rule.fired"))}
    assert set(fired) == {"r-cap-on-burn", "r-slow-tokens"}
    assert fired["r-cap-on-burn"]["observed"]["long_burn_rate"] == pytest.approx(30.0)
    observed = fired["r-slow-tokens"]["observed"]
    assert observed["requests"] == 10 and observed["within_threshold"] == pytest.approx(0.6)


def test_a_ttft_spec_counts_every_stream_of_its_model_and_nothing_else() -> None:
    spec = SloSpec(id="s", version=1, name="s", sli_kind="ttft", threshold_s=0.1, model="tiny-lm", labels={},
                   objective=99.0, window=3600, alerts=())  # fmt: skip
    histogram = Histogram.of(TTFT_BOUNDS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0, 1], 46, 3.0)

    def rollup(attributes: dict[str, Any]) -> Rollup:
        return Rollup("a1", names.GENAI_TTFT, "histogram", "x", T0, attributes, 46.0, 3.0, histogram)

    # Within 100 ms: the buckets up to the 0.1 s boundary (1+2+...+8); no outcome attribute is needed.
    assert spec.counts(rollup({names.ATTR_GENAI_MODEL: "tiny-lm"})) == (36, 46)
    assert spec.counts(rollup({names.ATTR_GENAI_MODEL: "big-lm"})) is None
    assert spec.counts(rollup({names.ATTR_MODEL: "tiny-lm"})) is None  # Spillway's attribute is not the GenAI one
    assert spec.rollups == (names.GENAI_TTFT, "histogram")


def test_generation_summary_merges_layouts_and_reads_gauges_of_one_minute() -> None:
    """Pure: TTFT rollups of two bucket layouts (an agent with other buckets) merge onto the shared boundaries;
    KV-cache use is used / total of the latest minute with both, engines (series) of one minute added up."""
    m0, m1 = T0.replace(second=0), T0.replace(second=0, minute=1)
    model = {names.ATTR_GENAI_MODEL: "tiny-lm"}
    coarse_bounds = [0.1, 1.0]  # a subset of the semconv layout
    fine = Histogram.of(TTFT_BOUNDS, [0] * 7 + [10] + [0] * 9, 10, 0.9)  # 10 in (80, 100] ms
    coarse = Histogram.of(coarse_bounds, [0, 10, 0], 10, 5.0)  # 10 in (100, 1000] ms
    assert fine is not None and coarse is not None

    def gauge(metric: str, minute: datetime, value: float, series: str) -> Rollup:
        return Rollup("a1", metric, "gauge", series, minute, {names.ATTR_MODEL: "tiny-lm"}, 1.0, value, None,
                      value, value, value)  # fmt: skip

    rows = [
        Rollup("a1", names.GENAI_TTFT, "histogram", "f", m0, model, 10.0, 0.9, fine),
        Rollup("a1", names.GENAI_TTFT, "histogram", "c", m1, model, 10.0, 5.0, coarse),
        gauge(names.KV_BLOCKS_USED, m0, 50, "u1"),
        gauge(names.KV_BLOCKS_TOTAL, m0, 100, "t1"),
        gauge(names.KV_BLOCKS_USED, m1, 10, "u1"),
        gauge(names.KV_BLOCKS_USED, m1, 30, "u2"),  # a second engine of the model, same minute
        gauge(names.KV_BLOCKS_TOTAL, m1, 80, "t1"),
        gauge(names.KV_BLOCKS_USED, m1.replace(minute=2), 5, "u1"),  # no total in that minute yet
        gauge(names.KV_BLOCKS_USED, m0, 1, "other"),
    ]
    rows[-1].attributes = {names.ATTR_MODEL: "no-budget"}  # used without any total: no ratio
    summary = summarise(rows, since=m0, until=m0.replace(minute=5))
    no_budget, tiny = summary["generation"]  # by model name
    assert tiny["model"] == "tiny-lm" and tiny["ttft_ms"]["count"] == 20
    assert tiny["ttft_ms"]["p50"] == pytest.approx(100.0)  # merged on (100 ms, 1 s]: rank 10 of 20 ends the first
    assert tiny["ttft_ms"]["mean"] == pytest.approx(5.9 / 20 * 1000)
    assert (tiny["kv_blocks_used"], tiny["kv_blocks_total"], tiny["kv_cache_use"]) == (5, 80, 0.5)
    assert (tiny["requests"], tiny["outcomes"], tiny["preemptions"], tiny["active_streams"]) == (0, {}, 0, None)
    assert (no_budget["kv_blocks_used"], no_budget["kv_blocks_total"], no_budget["kv_cache_use"]) == (1, None, None)
    assert no_budget["tokens_out_per_s"] == 0 and no_budget["tpot_ms"]["p99"] is None
