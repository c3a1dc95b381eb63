"""The control loop over a real database (SQLite and PostgreSQL), with an injected clock: rules fire after
`for`, recover step by step after `recover_after`, every transition is an event, dry-run rules only say what
they would do, and each agent's policy document changes exactly when its rules in force do. Generative rules
(TTFT, KV cache, preemptions) fire from what the agent's real telemetry exported over OTLP."""

from __future__ import annotations

from bisect import bisect_left
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from controlplane.db.models import Agent, Event, MetricRollup, Policy, Rule, RuleState, Slo
from controlplane.ingest.attributes import series_key
from controlplane.rules.loop import ControlLoop, PolicyDefaults
from controlplane.schemas.rules import RuleCreate
from controlplane.slo.windows import SloWindows
from spillway.contract import names
from spillway.contract.policy import PolicyDocument, parse
from tests.conftest import Plane, telemetry_for
from tests.utils.builders import make_rule
from tests.utils.rollups import add_agent, add_gauge, add_requests

T0 = datetime(2026, 11, 30, 9, 0, 5, tzinfo=timezone.utc)
DEFAULTS = PolicyDefaults(buckets_ms=[10.0, 100.0], export_interval_s=5, poll_interval_s=2, stale_after_s=15)


def _rule(session: Any, name: str, condition: dict[str, Any], action: dict[str, Any], *, selector: Any = None,
          hysteresis: Any = None, dry_run: bool = False) -> None:  # fmt: skip
    """A rule stored as the API stores it (through its schema, defaults filled in)."""
    body = RuleCreate.model_validate({
        "name": name, "selector": selector or {"labels": {"site": "berlin"}, "model": "mlp"}, "condition": condition,
        "action": action, "hysteresis": hysteresis or {}, "dry_run": dry_run,
    }).model_dump()  # fmt: skip
    session.add(Rule(id=f"r-{name}", version=1, **body))


def _policy(factory: Any, agent: str) -> PolicyDocument:
    with factory() as session:
        row = session.get(Policy, agent)
        assert row is not None
        return PolicyDocument.model_validate(row.document)


def _events(factory: Any) -> list[tuple[str, str | None]]:
    with factory() as session:
        return [(e.kind, e.agent_id) for e in session.scalars(select(Event).order_by(Event.id))]


def test_a_burn_rate_rule_fires_sheds_and_recovers_step_by_step(factory: Any) -> None:
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        add_agent(session, "a2", "paris")
        session.add(Slo(id="s1", name="lat", version=1, selector={"model": "mlp"}, sli_kind="latency",
                        threshold_ms=10.0, objective=99.0, window=86400, alert_windows=[]))  # fmt: skip
        _rule(session, "shed-on-burn",
              {"kind": "burn_rate", "slo": "lat", "long_window": 3600, "short_window": 300, "threshold": 2,
               "min_requests": 5},
              {"kind": "shed", "priority_at_or_below": 3, "retry_after_s": 10},
              hysteresis={"for": 60, "recover_after": 120, "recovery_steps": 2})  # fmt: skip
        _rule(session, "lite-when-slow",
              {"kind": "latency", "quantile": 0.9, "threshold_ms": 10, "window": 300, "min_requests": 5},
              {"kind": "switch_variant", "version": 2}, dry_run=True)  # fmt: skip
        add_requests(session, "a1", T0.replace(second=0), n=10, fast=2)  # 80 % slow: burn rate 80
        add_requests(session, "a2", T0.replace(second=0), n=10, fast=2)  # slow too, but no rule selects paris
    loop = ControlLoop(factory, SloWindows(), DEFAULTS)

    first = loop.cycle(T0)
    assert first.pairs == 2 and first.published == {"a1": 1, "a2": 1}  # everyone gets a first, empty document
    assert [t["kind"] for t in first.transitions] == ["rule.would_fire"]  # dry run: no `for`, fires at once
    assert _policy(factory, "a1").models == {}  # pending for 60 s; the dry-run rule never reaches a policy

    fired = loop.cycle(T0 + timedelta(seconds=61))
    assert [t["kind"] for t in fired.transitions] == ["rule.fired"] and fired.published == {"a1": 2}
    policy = _policy(factory, "a1")
    assert policy.version == 2 and policy.for_model("mlp").shed is not None
    assert policy.for_model("mlp").shed.model_dump() == {"at_or_below": 3, "retry_after_s": 10}
    assert policy.for_model("mlp").variant is None and [c.name for c in policy.causes] == ["shed-on-burn"]
    assert loop.cycle(T0 + timedelta(seconds=70)).published == {}  # nothing changed: no new version
    with factory() as session:
        state = session.get(RuleState, ("r-shed-on-burn", "a1"))
        assert state is not None and (state.state, state.step) == ("firing", 0)
        assert state.data["observed"]["requests_short"] == 10

    # The SLI recovers: six minutes of fast requests push the bad minute out of the 5-minute short window.
    with factory() as session, session.begin():
        for minute in range(1, 8):
            add_requests(session, "a1", T0.replace(second=0) + timedelta(minutes=minute), n=100, fast=100)
    clear = T0 + timedelta(minutes=7)
    assert loop.cycle(clear).transitions == []  # clear: recovering, the action still in force
    stepped = loop.cycle(clear + timedelta(seconds=121))
    assert [t["kind"] for t in stepped.transitions] == ["rule.would_recover", "rule.stepped_down"]  # by name
    assert _policy(factory, "a1").for_model("mlp").shed.at_or_below == 4  # one level fewer
    recovered = loop.cycle(clear + timedelta(seconds=242))
    assert [t["kind"] for t in recovered.transitions] == ["rule.recovered"]
    final = _policy(factory, "a1")
    assert (final.version, final.models, final.causes) == (4, {}, [])

    kinds = [k for k, agent in _events(factory) if agent == "a1"]
    assert kinds == ["rule.would_fire", "rule.fired", "policy.published", "rule.would_recover",
                     "rule.stepped_down", "policy.published", "rule.recovered", "policy.published"]  # fmt: skip
    with factory() as session:
        event = session.scalars(select(Event).where(Event.kind == "rule.fired")).one()
        assert event.rule_id == "r-shed-on-burn" and event.data["observed"]["long_burn_rate"] == pytest.approx(80)
        assert event.data["action"] == {"kind": "shed", "priority_at_or_below": 3, "retry_after_s": 10}
        stepped_event = session.scalars(select(Event).where(Event.kind == "rule.stepped_down")).one()
        assert stepped_event.data["action"]["priority_at_or_below"] == 4


def test_the_states_survive_a_new_leader(factory: Any) -> None:
    with factory() as session, session.begin():
        add_agent(session, "a1", "berlin")
        _rule(session, "queue", {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 50},
              {"kind": "tune_batching", "max_queue_delay_us": 100}, hysteresis={"recover_after": 60})  # fmt: skip
        add_gauge(session, "a1", T0.replace(second=0), "spillway.queue.depth", 70, model="mlp", priority=1)
    ControlLoop(factory, SloWindows(), DEFAULTS).cycle(T0)
    assert _policy(factory, "a1").for_model("mlp").max_queue_delay_us == 100
    with factory() as session:
        assert session.get(RuleState, ("r-queue", "a1")).state == "firing"  # type: ignore[union-attr]
    # Another replica takes over: it reads the states and carries on (the queue drained: recovering, then ok).
    successor = ControlLoop(factory, SloWindows(), DEFAULTS)
    later = T0 + timedelta(minutes=3)
    assert successor.cycle(later).transitions == []
    assert [t["kind"] for t in successor.cycle(later + timedelta(seconds=61)).transitions] == ["rule.recovered"]
    assert _policy(factory, "a1").models == {}


def test_gauges_staleness_and_quiet_devices(factory: Any) -> None:
    with factory() as session, session.begin():
        add_agent(session, "hot", "berlin")
        add_agent(session, "quiet", "berlin")
        add_agent(session, "gone", "berlin")
        session.get(Agent, "gone").last_seen = T0 - timedelta(seconds=40)  # type: ignore[union-attr]
        session.get(Agent, "hot").last_seen = T0  # type: ignore[union-attr]
        minute = T0.replace(second=0)
        add_gauge(session, "hot", minute, "hw.temperature", 91.0, **{"hw.type": "gpu"})
        add_gauge(session, "hot", minute, "hw.gpu.memory.usage", 7e9)
        add_gauge(session, "hot", minute, "hw.gpu.memory.limit", 8e9)
        add_requests(session, "quiet", minute, n=2, fast=0)  # all slow, but only two requests
        sel = {"labels": {"site": "berlin"}}
        _rule(session, "hot", {"kind": "gauge", "metric": "gpu_temperature_c", "op": ">=", "threshold": 85},
              {"kind": "shed", "priority_at_or_below": 3}, selector=sel)  # fmt: skip
        _rule(session, "full", {"kind": "gauge", "metric": "gpu_memory_free_ratio", "op": "<", "threshold": 0.2},
              {"kind": "switch_variant", "version": 2})  # fmt: skip
        _rule(session, "silent", {"kind": "stale", "after": 30},
              {"kind": "fallback", "priority_at_or_below": 1, "mode": "cache"}, selector=sel)  # fmt: skip
        _rule(session, "errors", {"kind": "error_ratio", "threshold": 0.5, "window": 300, "min_requests": 5},
              {"kind": "shed", "priority_at_or_below": 2}, selector=sel)  # fmt: skip
        _rule(session, "slow", {"kind": "latency", "quantile": 0.99, "threshold_ms": 10, "window": 300},
              {"kind": "tune_batching", "max_queue_delay_us": 0}, selector=sel)  # fmt: skip
    report = ControlLoop(factory, SloWindows(), DEFAULTS).cycle(T0 + timedelta(seconds=5))
    fired = sorted((t["rule"], t["agent"]) for t in report.transitions)
    # quiet: 2 slow requests are under the latency rule's default min_requests (20): not an incident.
    assert fired == [("full", "hot"), ("hot", "hot"), ("silent", "gone")]
    hot = _policy(factory, "hot")
    assert hot.for_model("mlp").variant == 2 and hot.for_model("mlp").shed.at_or_below == 3  # type: ignore[union-attr]
    assert hot.for_model("other").variant is None and hot.for_model("other").shed is not None  # `*` vs mlp
    assert _policy(factory, "gone").for_model("mlp").fallback.mode == "cache"  # type: ignore[union-attr]
    assert _policy(factory, "quiet").models == {}


def _generative_minute(session: Any, agent: str, minute: datetime, streams: int, ttft_s: float, kv_used: float) -> None:
    """A later minute of a generative model's telemetry, as the receiver would store it: `streams` first tokens
    after `ttft_s`, a KV reading of `kv_used` of 100 blocks, no preemption."""
    ttft = {names.ATTR_GENAI_MODEL: "tiny-lm", names.ATTR_GENAI_OPERATION: "chat"}
    buckets = [0] * (len(names.GENAI_TTFT_BUCKETS) + 1)
    buckets[bisect_left(names.GENAI_TTFT_BUCKETS, ttft_s)] = streams
    rows = [(names.GENAI_TTFT, ttft, {"kind": "histogram", "count": streams, "total": streams * ttft_s,
                                      "buckets": buckets, "bounds": list(names.GENAI_TTFT_BUCKETS)}),
            (names.PREEMPTIONS, {names.ATTR_MODEL: "tiny-lm"}, {"kind": "sum", "count": 0, "total": 0.0})]  # fmt: skip
    for metric, value in ((names.KV_BLOCKS_USED, kv_used), (names.KV_BLOCKS_TOTAL, 100.0)):
        reading = {"kind": "gauge", "count": 1, "total": value, "last": value, "min": value, "max": value}
        rows.append((metric, {names.ATTR_MODEL: "tiny-lm"}, reading))
    for metric, attributes, values in rows:
        session.add(MetricRollup(agent_id=agent, metric=metric, series=series_key(metric, attributes), minute=minute,
                                 attributes=attributes, **{"buckets": [], "bounds": [], **values}))  # fmt: skip


def test_generative_rules_fire_from_real_otlp_cap_tokens_limit_the_engine_and_recover(plane: Plane) -> None:
    admin = {"Authorization": f"Bearer {plane.admin}"}
    selector = {"model": "tiny-lm"}
    ids = {}
    for rule in (
        make_rule(name="ttft-cap", selector=selector, hysteresis={"recover_after": 60, "recovery_steps": 2},
                  condition={"kind": "latency", "metric": "ttft", "quantile": 0.9, "threshold_ms": 100,
                             "window": 120, "min_requests": 5},
                  action={"kind": "cap_max_tokens", "max_tokens": 128}),
        make_rule(name="kv-full", selector=selector, hysteresis={},
                  condition={"kind": "gauge", "metric": "kv_cache_use_ratio", "op": ">", "threshold": 0.8},
                  action={"kind": "limit_generation", "max_num_seqs": 4, "max_num_batched_tokens": 256}),
        make_rule(name="preempting", selector=selector, hysteresis={},
                  condition={"kind": "gauge", "metric": "preemptions_per_minute", "op": ">=", "threshold": 5},
                  action={"kind": "limit_generation", "max_num_seqs": 2}),
    ):  # fmt: skip
        made = httpx.post(f"{plane.url}/api/v1/rules", json=rule, headers=admin)
        assert made.status_code == 201, made.text
        ids[rule["name"]] = made.json()["id"]

    # The agent's own instruments, exported over OTLP: 10 streams, 8 of them 2 s to the first token (p90 far above
    # 100 ms); 90 of 100 KV blocks held; 7 sequences preempted.
    telemetry = telemetry_for(plane)
    telemetry.watch_engines(lambda: [("tiny-lm", {"kv_blocks": {"used": 90, "total": 100}, "preemptions": 7})])
    recorder = telemetry.generation("tiny-lm")
    for i in range(10):
        recorder.finished(1, "local", operation="chat", prompt_tokens=12, completion_tokens=20,
                          ttft_s=2.0 if i < 8 else 0.05, duration_s=3.0)  # fmt: skip
    assert telemetry.provider.force_flush(10_000)
    telemetry.shutdown()
    # One collection stamps every point with one time, so all of it lands in one minute (shutdown's second,
    # unchanged collection may add empty rollups to the next one).
    minute = min(r.minute for r in plane.rollups(names.GENAI_TTFT)).replace(tzinfo=timezone.utc)
    loop, factory, agent = plane.app.state.control_loop, plane.app.state.sessionmaker, plane.agent_id

    # The next minute: the exported one is the last whole minute, whose preemptions are the rate.
    fired = loop.cycle(minute + timedelta(seconds=65))
    assert sorted(t["kind"] + ":" + t["rule"] for t in fired.transitions) == [
        "rule.fired:kv-full", "rule.fired:preempting", "rule.fired:ttft-cap"
    ]  # fmt: skip
    got = httpx.get(f"{plane.url}/api/v1/agents/{agent}/policy", headers={"Authorization": f"Bearer {plane.token}"})
    policy = parse(got.content)  # the agent's own parser
    limits = policy.for_model("tiny-lm")
    assert (limits.max_tokens_cap, limits.max_num_seqs, limits.max_num_batched_tokens) == (128, 2, 256)
    assert sorted(c.action for c in policy.causes) == ["cap_max_tokens", "limit_generation", "limit_generation"]
    with factory() as session:
        observed = {e.data["rule"]: e.data["observed"]
                    for e in session.scalars(select(Event).where(Event.kind == "rule.fired"))}  # fmt: skip
    assert observed["ttft-cap"]["metric"] == "ttft" and observed["ttft-cap"]["requests"] == 10
    assert observed["ttft-cap"]["within_threshold"] == pytest.approx(0.2)
    assert observed["kv-full"]["value"] == pytest.approx(0.9)
    assert (observed["kv-full"]["kv_blocks_used"], observed["kv-full"]["kv_blocks_total"]) == (90, 100)
    assert observed["preempting"]["value"] == 7

    # Calm: fast first tokens, a tenth of the KV cache, no preemption. The gauges let go at once; the cap doubles
    # once after `recover_after`, then goes.
    with factory() as session, session.begin():
        for later in range(2, 7):
            _generative_minute(session, agent, minute + timedelta(minutes=later), streams=20, ttft_s=0.05, kv_used=10)
    calm = minute + timedelta(minutes=3, seconds=5)
    assert loop.cycle(calm).transitions == []  # clear: recovering, every action still in force
    stepped = loop.cycle(calm + timedelta(seconds=65))
    assert sorted(t["kind"] + ":" + t["rule"] for t in stepped.transitions) == [
        "rule.recovered:kv-full", "rule.recovered:preempting", "rule.stepped_down:ttft-cap"
    ]  # fmt: skip
    relaxed = _policy(factory, agent).for_model("tiny-lm")
    assert (relaxed.max_tokens_cap, relaxed.max_num_seqs, relaxed.max_num_batched_tokens) == (256, None, None)
    (state,) = httpx.get(f"{plane.url}/api/v1/rules/{ids['ttft-cap']}/status", headers=admin).json()
    assert (state["state"], state["step"], state["in_force"]) == ("recovering", 1, {"kind": "cap_max_tokens",
                                                                                    "max_tokens": 256})  # fmt: skip
    recovered = loop.cycle(calm + timedelta(seconds=130))
    assert [t["kind"] + ":" + t["rule"] for t in recovered.transitions] == ["rule.recovered:ttft-cap"]
    final = _policy(factory, agent)
    assert (final.models, final.causes) == ({}, [])
    with factory() as session:
        step = session.scalars(select(Event).where(Event.kind == "rule.stepped_down")).one()
        assert step.data["action"] == {"kind": "cap_max_tokens", "max_tokens": 256}
        assert step.data["observed"]["within_threshold"] == 1.0
        query = select(Event).where(Event.kind == "policy.published", Event.agent_id == agent).order_by(Event.id)
        published = [e.data["models"] for e in session.scalars(query)]
    assert [m.get("tiny-lm", {}).get("max_tokens_cap") for m in published] == [128, 256, None]
