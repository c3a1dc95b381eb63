"""Degradation rules for generative models: TTFT/TPOT conditions on the GenAI buckets, the KV-cache, preemption and
stream gauges as the control loop reads them from the rollups, and the cap_max_tokens / limit_generation actions
composed into the policy document (the strictest wins) and relaxed step by step on recovery."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from controlplane.db.models import MetricRollup
from controlplane.ingest.attributes import series_key
from controlplane.rules.engine import Hysteresis, State, advance
from controlplane.rules.observe import AgentGauges, read_gauges
from controlplane.rules.policy import Active, compose, document, stepped_action
from controlplane.schemas.rules import ACTION_LADDER, Action, RuleCreate
from spillway.contract import names
from spillway.contract.names import ACTIVE_STREAMS, KV_BLOCKS_TOTAL, KV_BLOCKS_USED, PREEMPTIONS, QUEUE_DEPTH
from spillway.contract.policy import PolicyDocument, parse
from tests.conftest import Api
from tests.utils.builders import make_rule
from tests.utils.rollups import add_agent

ACTION: TypeAdapter[Action] = TypeAdapter(Action)
NOW = datetime(2026, 11, 30, 12, 0, 30, tzinfo=timezone.utc)


def _rule(condition: dict[str, Any], action: dict[str, Any] | None = None) -> RuleCreate:
    return RuleCreate.model_validate({"name": "r", "condition": condition,
                                      "action": action or {"kind": "cap_max_tokens", "max_tokens": 64}})  # fmt: skip


# ---- the schema ------------------------------------------------------------------------------


@pytest.mark.parametrize(("metric", "threshold"), [("ttft", 250), ("ttft", 1), ("tpot", 75), ("tpot", 2500)])
def test_ttft_and_tpot_thresholds_on_their_own_buckets_are_accepted(metric: str, threshold: float) -> None:
    condition = _rule({"kind": "latency", "metric": metric, "quantile": 0.99, "threshold_ms": threshold}).condition
    assert (condition.metric, condition.threshold_ms) == (metric, threshold)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("metric", "threshold", "allowed"),
    [("ttft", 30, "1, 5, 10, 20, 40, 60, 80, 100, 250, 500"), ("tpot", 250, "200, 300, 400")],
)
def test_a_generative_threshold_off_its_buckets_is_refused_listing_them(metric: str, threshold: float,
                                                                        allowed: str) -> None:  # fmt: skip
    with pytest.raises(ValidationError) as refused:
        _rule({"kind": "latency", "metric": metric, "quantile": 0.99, "threshold_ms": threshold})
    (error,) = refused.value.errors()
    assert error["loc"] == ("condition", "latency", "threshold_ms")
    assert f"{threshold} is not a {metric} bucket boundary" in error["msg"] and allowed in error["msg"]


def test_a_request_latency_threshold_is_not_judged_by_the_genai_buckets() -> None:
    condition = _rule({"kind": "latency", "quantile": 0.9, "threshold_ms": 30}).condition  # the API checks it
    assert condition.metric == "request"  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="'request', 'ttft' or 'tpot'"):
        _rule({"kind": "latency", "metric": "itl", "quantile": 0.9, "threshold_ms": 100})


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"kind": "limit_generation"}, "needs max_num_seqs or max_num_batched_tokens"),
        ({"kind": "limit_generation", "max_num_seqs": 0}, "greater than or equal to 1"),
        ({"kind": "cap_max_tokens"}, "max_tokens"),
        ({"kind": "cap_max_tokens", "max_tokens": 2_000_000}, "less than or equal to 1048576"),
        ({"kind": "fallback", "priority_at_or_below": 2, "mode": "default"}, "default_text"),
    ],
)
def test_generative_actions_missing_their_parameters_are_refused(action: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ACTION.validate_python(action)


def test_the_ladder_puts_the_generative_limits_after_batching_and_before_overflow() -> None:
    assert ACTION_LADDER.index("tune_batching") < ACTION_LADDER.index("cap_max_tokens")
    assert ACTION_LADDER.index("cap_max_tokens") < ACTION_LADDER.index("limit_generation")
    assert ACTION_LADDER.index("limit_generation") < ACTION_LADDER.index("overflow")


# ---- the gauges ------------------------------------------------------------------------------


def test_generative_gauges_per_model_and_over_every_model() -> None:
    g = AgentGauges()
    assert [g.value(m, None) for m in ("kv_cache_use_ratio", "preemptions_per_minute", "active_streams")] == [
        None, None, None
    ]  # fmt: skip  # a device serving no generative model: no reading, never a 0 that a "<" rule would fire on
    g.kv_blocks_used.update({"tiny-lm": 90.0, "chat": 10.0})
    g.kv_blocks_total.update({"tiny-lm": 100.0, "chat": 300.0})
    g.preemptions.update({"tiny-lm": 7.0, "chat": 0.0})
    g.active_streams.update({"tiny-lm": 12.0})
    assert g.value("kv_cache_use_ratio", "tiny-lm") == pytest.approx(0.9)
    assert g.value("kv_cache_use_ratio", None) == pytest.approx(0.25)  # blocks summed, not ratios averaged
    assert g.details("kv_cache_use_ratio", "chat") == {"kv_blocks_used": 10.0, "kv_blocks_total": 300.0}
    assert (g.value("preemptions_per_minute", "tiny-lm"), g.value("preemptions_per_minute", None)) == (7.0, 7.0)
    assert (g.value("active_streams", "tiny-lm"), g.value("active_streams", "chat")) == (12.0, None)
    assert g.value("kv_cache_use_ratio", "vision") is None
    g.kv_blocks_total["empty"], g.kv_blocks_used["empty"] = 0.0, 0.0
    assert g.value("kv_cache_use_ratio", "empty") is None  # no budget: no ratio (never a division by zero)


def _gauge(session: Any, agent: str, minute: datetime, metric: str, value: float, kind: str = "gauge",
           model: str = "tiny-lm") -> None:  # fmt: skip
    """One minute's rollup of a generative series, keyed as the receiver keys it."""
    attributes = {names.ATTR_MODEL: model}
    gauge = {"last": value, "min": value, "max": value} if kind == "gauge" else {}
    session.add(MetricRollup(agent_id=agent, metric=metric, series=series_key(metric, attributes), minute=minute,
                             attributes=attributes, kind=kind, count=1 if kind == "gauge" else 0, total=value,
                             buckets=[], bounds=[], **gauge))  # fmt: skip


def test_read_gauges_takes_the_latest_kv_readings_and_the_last_whole_minutes_preemptions(factory: Any) -> None:
    now = NOW
    current, previous = now.replace(second=0), now.replace(second=0) - timedelta(minutes=1)
    with factory() as session, session.begin():
        for agent in ("edge", "idle", "old"):
            add_agent(session, agent, "berlin")
        _gauge(session, "edge", previous, KV_BLOCKS_USED, 20)
        _gauge(session, "edge", current, KV_BLOCKS_USED, 45)  # the latest reading wins
        _gauge(session, "edge", previous, KV_BLOCKS_TOTAL, 50)
        _gauge(session, "edge", current, ACTIVE_STREAMS, 6)
        _gauge(session, "edge", current, ACTIVE_STREAMS, 2, model="chat")
        _gauge(session, "edge", previous, PREEMPTIONS, 9, kind="sum")  # the last whole minute
        _gauge(session, "edge", current, PREEMPTIONS, 4, kind="sum")  # still counting: not yet a rate
        _gauge(session, "idle", current, PREEMPTIONS, 3, kind="sum")  # reporting, none in the last whole minute
        _gauge(session, "idle", current, QUEUE_DEPTH, 1)
        _gauge(session, "old", previous - timedelta(minutes=1), KV_BLOCKS_USED, 99)  # too old to count
        _gauge(session, "old", previous - timedelta(minutes=1), PREEMPTIONS, 99, kind="sum")
    with factory() as session:
        gauges = read_gauges(session, now)
    edge = gauges["edge"]
    assert edge.value("kv_cache_use_ratio", "tiny-lm") == pytest.approx(0.9)
    assert (edge.value("active_streams", "tiny-lm"), edge.value("active_streams", None)) == (6.0, 8.0)
    assert edge.value("preemptions_per_minute", "tiny-lm") == 9.0
    assert gauges["idle"].value("preemptions_per_minute", "tiny-lm") == 0.0
    assert gauges["idle"].value("kv_cache_use_ratio", None) is None
    assert "old" not in gauges


# ---- composition and recovery -----------------------------------------------------------------


def _active(name: str, action: dict[str, Any], model: str | None = "tiny-lm", step: int = 0) -> Active:
    return Active(f"id-{name}", name, ACTION.validate_python(action), model, step, NOW)


def _models(active: list[Active]) -> dict[str, Any]:
    content = compose("agent1", active, buckets_ms=[10], export_interval_s=5, poll_interval_s=2)
    full, _ = document(content, 3)
    parse(PolicyDocument.model_validate(full).model_dump_json())  # the agent's own parser accepts it
    return content.model_dump(exclude_unset=True)["models"]


def test_generative_limits_compose_to_the_strictest_even_across_selectors() -> None:
    models = _models([
        _active("cap-a", {"kind": "cap_max_tokens", "max_tokens": 256}),
        _active("cap-b", {"kind": "cap_max_tokens", "max_tokens": 64}, step=1),  # relaxed once: 128
        _active("cap-all", {"kind": "cap_max_tokens", "max_tokens": 512}, model=None),
        _active("seqs", {"kind": "limit_generation", "max_num_seqs": 8}),
        _active("budget", {"kind": "limit_generation", "max_num_seqs": 16, "max_num_batched_tokens": 512}),
        _active("budget-all", {"kind": "limit_generation", "max_num_batched_tokens": 256}, model=None),
        _active("calm-chat", {"kind": "cap_max_tokens", "max_tokens": 2048}, model="chat"),
    ])  # fmt: skip
    assert models == {
        "tiny-lm": {"max_tokens_cap": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256},
        "*": {"max_tokens_cap": 512, "max_num_batched_tokens": 256},
        "chat": {"max_tokens_cap": 512, "max_num_batched_tokens": 256},  # its own milder cap does not relax `*`
    }


def test_recovery_steps_double_the_limits_up_to_the_documents_maximum() -> None:
    cap = ACTION.validate_python({"kind": "cap_max_tokens", "max_tokens": 100})
    assert [stepped_action(cap, s).model_dump()["max_tokens"] for s in range(4)] == [100, 200, 400, 800]
    assert stepped_action(ACTION.validate_python({"kind": "cap_max_tokens", "max_tokens": 600_000}), 3).model_dump()[
        "max_tokens"
    ] == 1_048_576  # fmt: skip
    limit = ACTION.validate_python({"kind": "limit_generation", "max_num_seqs": 3000})
    stepped = stepped_action(limit, 2).model_dump()
    assert (stepped["max_num_seqs"], stepped["max_num_batched_tokens"]) == (4096, None)  # unset stays unset

    # The engine's steps drive it: recovery_steps 3 relaxes the cap twice, then lets go.
    h, state, seen = Hysteresis(recover_after_s=30, recovery_steps=3), State(), []
    for now, met in [(0, True), (5, False), (35, False), (65, False), (95, False)]:
        state, transition = advance(state, met, now, h)
        caps = _models([_active("cap", {"kind": "cap_max_tokens", "max_tokens": 100}, step=state.step)])
        in_force = caps["tiny-lm"]["max_tokens_cap"] if state.active else None
        seen.append((transition.kind if transition else "", in_force))
    assert seen == [("fired", 100), ("", 100), ("stepped_down", 200), ("stepped_down", 400), ("recovered", None)]


def test_a_generative_fallback_carries_its_default_text() -> None:
    models = _models([_active("words", {"kind": "fallback", "priority_at_or_below": 3, "mode": "default",
                                        "default_text": "The assistant is busy; please retry."})])  # fmt: skip
    assert models == {"tiny-lm": {"fallback": {"at_or_below": 3, "mode": "default",
                                               "default_text": "The assistant is busy; please retry."}}}  # fmt: skip


# ---- the API -----------------------------------------------------------------------------------


def test_the_api_takes_generative_rules_and_names_a_bad_threshold(sqlite_api: Api) -> None:
    refused = sqlite_api.call("POST", "/api/v1/rules", json=make_rule(
        condition={"kind": "latency", "metric": "ttft", "quantile": 0.99, "threshold_ms": 300}))  # fmt: skip
    assert refused.status_code == 422
    body = refused.json()
    assert body["details"][0]["field"] == "body.condition.latency.threshold_ms"
    assert "300 is not a ttft bucket boundary" in body["message"] and "250, 500" in body["message"]
    # 250 ms is a TTFT boundary but not a configured request-latency one: the GenAI buckets judge it.
    made = sqlite_api.call("POST", "/api/v1/rules", json=make_rule(
        name="ttft-cap", condition={"kind": "latency", "metric": "ttft", "quantile": 0.99, "threshold_ms": 250},
        action={"kind": "cap_max_tokens", "max_tokens": 128}))  # fmt: skip
    assert made.status_code == 201, made.text
    assert made.json()["condition"]["metric"] == "ttft" and made.json()["action"]["max_tokens"] == 128
    gauge = sqlite_api.call("POST", "/api/v1/rules", json=make_rule(
        name="kv", condition={"kind": "gauge", "metric": "kv_cache_use_ratio", "op": ">", "threshold": 0.9},
        action={"kind": "limit_generation", "max_num_seqs": 4}))  # fmt: skip
    assert gauge.status_code == 201, gauge.text
    empty = sqlite_api.call("POST", "/api/v1/rules", json=make_rule(name="x", action={"kind": "limit_generation"}))
    assert empty.status_code == 422 and "needs max_num_seqs or max_num_batched_tokens" in empty.json()["message"]
