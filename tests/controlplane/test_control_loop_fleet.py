"""The control loop at fleet scale (SQLite and PostgreSQL): a fleet-wide firing writes its events, rule states and
policies in batches, yet exactly what one write at a time wrote (one event per transition, in the same order, one
new version per agent with the ETag of its document), and a cycle that fails half-way leaves nothing behind."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import func, select

from controlplane.db.models import Event, Policy, Rule, RuleState
from controlplane.rules import loop as loop_module
from controlplane.rules.loop import ControlLoop, PolicyDefaults, PolicyRace, current_policy
from controlplane.rules.policy import document
from controlplane.schemas.rules import RuleCreate
from controlplane.slo.windows import SloWindows
from spillway.contract.policy import PolicyDocument
from tests.utils.rollups import add_agent, add_gauge

T0 = datetime(2026, 12, 1, 9, 0, 5, tzinfo=timezone.utc)
DEFAULTS = PolicyDefaults(buckets_ms=[10.0, 100.0], export_interval_s=5, poll_interval_s=5, stale_after_s=15)
AGENTS = [f"a{i:04d}" for i in range(200)]
RULES = ("deep-queue", "hot-gpu")


def _fleet(factory: Any, queue_depth: float, temperature: float, minute: datetime) -> None:
    """Every agent's queue depth and GPU temperature in `minute`."""
    with factory() as session, session.begin():
        for agent in AGENTS:
            add_gauge(session, agent, minute, "spillway.queue.depth", queue_depth, model="mlp", priority=1)
            add_gauge(session, agent, minute, "hw.temperature", temperature, **{"hw.type": "gpu"})


@pytest.fixture
def fleet(factory: Any) -> Any:
    """200 agents, two rules selecting all of them, a calm first minute."""
    with factory() as session, session.begin():
        for i, agent in enumerate(AGENTS):
            add_agent(session, agent, ("berlin", "paris")[i % 2])
        for name, condition, action in (
            ("deep-queue", {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 10},
             {"kind": "tune_batching", "max_queue_delay_us": 100}),
            ("hot-gpu", {"kind": "gauge", "metric": "gpu_temperature_c", "op": ">=", "threshold": 85},
             {"kind": "shed", "priority_at_or_below": 3}),
        ):  # fmt: skip
            body = RuleCreate.model_validate({"name": name, "selector": {}, "condition": condition, "action": action,
                                              "hysteresis": {"for": 30}}).model_dump()  # fmt: skip
            session.add(Rule(id=f"r-{name}", version=1, **body))
    _fleet(factory, 1, 40, T0.replace(second=0))
    return factory


def _events(factory: Any) -> list[Event]:
    with factory() as session:
        return list(session.scalars(select(Event).order_by(Event.id)))


def _policies(factory: Any) -> dict[str, Policy]:
    with factory() as session:
        return {row.agent_id: row for row in session.scalars(select(Policy))}


def test_a_fleet_wide_firing_writes_one_event_per_transition_and_one_version_per_agent(fleet: Any) -> None:
    loop = ControlLoop(fleet, SloWindows(), DEFAULTS)
    first = loop.cycle(T0)
    assert first.pairs == 400 and first.transitions == [] and set(first.published.values()) == {1}
    assert _events(fleet) == []  # an agent's first, empty document is not news

    # The whole fleet breaches both rules: pending for `for` (30 s), then one cycle fires 400 pairs at once.
    _fleet(fleet, 50, 90, T0.replace(second=0) + timedelta(minutes=1))
    assert loop.cycle(T0 + timedelta(seconds=60)).transitions == []
    fired = loop.cycle(T0 + timedelta(seconds=95))
    assert len(fired.transitions) == 400 and fired.published == dict.fromkeys(AGENTS, 2)

    events = _events(fleet)
    kinds = [e.kind for e in events]
    assert kinds == ["rule.fired"] * 400 + ["policy.published"] * 200
    assert [e.id for e in events] == sorted({e.id for e in events})  # ids grow in the order they were recorded
    # Rules by name, and within a rule the agents in the loop's order; then one document per agent.
    assert [(e.rule_id, e.agent_id) for e in events[:400]] == [
        (f"r-{t['rule']}", t["agent"]) for t in fired.transitions
    ]
    assert {(e.rule_id, e.agent_id) for e in events[:400]} == {(f"r-{r}", a) for r in RULES for a in AGENTS}
    assert [e.agent_id for e in events[400:]] == list(fired.published)
    sample = events[0]
    assert (sample.actor, sample.subject_type, sample.subject_id, sample.reason) == ("control-loop", "rule",
                                                                                    sample.rule_id, "")  # fmt: skip
    assert sample.data["state"] == "firing" and sample.data["observed"]["value"] in (50, 90)
    assert sample.ts is not None and sample.ts.tzinfo is not None

    policies = _policies(fleet)
    for agent in AGENTS:
        row = policies[agent]
        content = PolicyDocument.model_validate(row.document)
        assert row.version == content.version == 2
        assert document(content.model_copy(update={"version": 0}), 2) == (row.document, row.etag)
        assert sorted(c.name for c in content.causes) == list(RULES)
    published = {e.agent_id: e.data for e in events[400:]}
    assert published["a0000"]["version"] == 2 and len(published["a0000"]["causes"]) == 2
    with fleet() as session:
        states = session.scalars(select(RuleState)).all()
        assert len(states) == 400 and {s.state for s in states} == {"firing"}

    # Nothing changes: nothing is written. A new leader (states read afresh, nothing cached) agrees.
    assert loop.cycle(T0 + timedelta(seconds=100)).published == {}
    assert ControlLoop(fleet, SloWindows(), DEFAULTS).cycle(T0 + timedelta(seconds=105)).published == {}
    assert len(_events(fleet)) == 600 and {p.version for p in _policies(fleet).values()} == {2}


def test_a_cycle_that_fails_half_way_leaves_nothing_and_the_next_one_does_it_once(
    fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = ControlLoop(fleet, SloWindows(), DEFAULTS)
    loop.cycle(T0)
    _fleet(fleet, 50, 90, T0.replace(second=0) + timedelta(minutes=1))
    loop.cycle(T0 + timedelta(seconds=60))
    with fleet() as session:
        before = {(s.rule_id, s.agent_id): (s.state, s.since) for s in session.scalars(select(RuleState))}

    written = loop_module.insert_events

    def crash(session: Any, rows: list[dict[str, Any]]) -> None:  # as if killed after every write of the cycle
        written(session, rows)
        raise RuntimeError("killed")

    monkeypatch.setattr(loop_module, "insert_events", crash)
    with pytest.raises(RuntimeError, match="killed"):
        loop.cycle(T0 + timedelta(seconds=95))
    monkeypatch.undo()
    assert loop.states is None and loop.published == {}  # the next cycle starts from the database
    assert _events(fleet) == [] and {p.version for p in _policies(fleet).values()} == {1}
    with fleet() as session:
        after = {(s.rule_id, s.agent_id): (s.state, s.since) for s in session.scalars(select(RuleState))}
    assert after == before

    again = loop.cycle(T0 + timedelta(seconds=96))
    assert len(again.transitions) == 400 and set(again.published.values()) == {2}
    assert [e.kind for e in _events(fleet)].count("rule.fired") == 400


def test_a_document_made_meanwhile_fails_the_cycle_rather_than_publish_its_version_twice(
    fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's first poll makes its first document after the cycle locked the stored ones: the cycle's upsert
    refuses to overwrite it (version 1 twice), the cycle rolls back, and the next one publishes version 2."""
    with fleet() as session, session.begin():
        add_agent(session, "late", "berlin")
    loop = ControlLoop(fleet, SloWindows(), DEFAULTS)
    locked = loop_module.locked_policy_tags

    def poll_meanwhile(session: Any) -> dict[str, tuple[int, str]]:
        tags = locked(session)
        current_policy(session, "late", DEFAULTS)  # in this transaction: SQLite has one writer at a time
        return tags

    monkeypatch.setattr(loop_module, "locked_policy_tags", poll_meanwhile)
    with pytest.raises(PolicyRace, match="late"):
        loop.cycle(T0)
    monkeypatch.undo()
    with fleet() as session:
        assert session.scalar(select(func.count()).select_from(Policy)) == 0
        current_policy(session, "late", DEFAULTS)  # the poll, for real this time
        session.commit()
    report = loop.cycle(T0 + timedelta(seconds=1))
    assert report.published["a0000"] == 1 and "late" not in report.published  # its document says the same
    assert _policies(fleet)["late"].version == 1
