"""The control loop: every cycle, evaluate every enabled rule for every agent it selects, move each (rule,
agent) through its hysteresis, write an event for every transition, and publish a new policy document for
every agent whose rules in force changed.

Rule states live in the database (`rule_states`) as well as here, so that another replica taking over the loop
(PostgreSQL advisory lock, see `Leadership`) carries on where this one stopped. Dry-run rules go through the
same states and write `rule.would_*` events (what the rule would have done: `rule.would_fire` where a live rule
writes `rule.fired`), but never reach a policy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import Agent, Policy, Rule, RuleState, Slo, utcnow
from controlplane.db.repository import Actor, record_event
from controlplane.rules.engine import Hysteresis, State, Transition, advance
from controlplane.rules.observe import Observer, Seen, read_gauges
from controlplane.rules.policy import Active, compose, document, same_content, stepped_action
from controlplane.rules.tenants import locked_policies, placed_tenants, tenants_by_agent, tenants_for
from controlplane.schemas.rules import RuleSpec, parse_rules
from controlplane.slo import SloWindows

log = logging.getLogger("spillway.controlplane.loop")
LOOP_LOCK = 0x5370_4C70  # "SpLp": the replica holding it runs the control loop
ACTOR = Actor("control-loop", "")
DRY_RUN_VERBS = {"fired": "fire", "recovered": "recover", "stepped_down": "step_down", "flapping": "flap",
                 "refired": "refire"}  # fmt: skip
"""A transition's kind -> the verb of a dry-run rule's event (`rule.would_<verb>`)."""
LEGACY_DRY_RUN_KINDS = {f"rule.would_{kind}": f"rule.would_{verb}" for kind, verb in DRY_RUN_VERBS.items()}
"""The kinds dry-run events had up to 0.1 (`rule.would_fired`, ...) -> their names now (migration 0007 renames
stored events; the events API still takes the old names in its `kind` filter for one release)."""


@dataclass(frozen=True)
class PolicyDefaults:
    buckets_ms: list[float]
    export_interval_s: float
    poll_interval_s: float
    stale_after_s: float


@dataclass
class CycleReport:
    at: datetime
    seconds: float = 0.0
    pairs: int = 0
    transitions: list[dict[str, Any]] = field(default_factory=list)
    published: dict[str, int] = field(default_factory=dict)  # agent -> new policy version


def _ts(moment: datetime) -> float:
    return moment.timestamp()


def _dt(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


def _aware(moment: datetime | None) -> datetime | None:
    if moment is None:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class ControlLoop:
    """One per control-plane process; `cycle()` is called by the leader only (or directly, in tests)."""

    def __init__(self, factory: sessionmaker[Session], windows: SloWindows, defaults: PolicyDefaults) -> None:
        self.factory = factory
        self.windows = windows
        self.defaults = defaults
        self.states: dict[tuple[str, str], State] | None = None  # None: to be read from the database
        self.last: CycleReport | None = None
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Leadership lost: the next cycle (if leader again) reads the states afresh."""
        with self._lock:
            self.states = None

    def cycle(self, now: datetime | None = None) -> CycleReport:
        now = now or utcnow()
        started = time.perf_counter()
        with self._lock, self.factory() as session:
            report = self._cycle(session, now)
            session.commit()
        report.seconds = time.perf_counter() - started
        self.last = report
        return report

    # ---- inside the lock ---------------------------------------------------------------------

    def _cycle(self, session: Session, now: datetime) -> CycleReport:
        report = CycleReport(at=now)
        self.windows.evaluate(session, now)
        if self.states is None:
            self.states = self._read_states(session)
        rules = parse_rules(session.scalars(select(Rule).where(Rule.enabled.is_(True)).order_by(Rule.name)))
        agents = {a.id: a for a in session.scalars(select(Agent))}
        observer = Observer(
            self.windows, {s.name: s.id for s in session.scalars(select(Slo))}, read_gauges(session, now),
            {a.id: _aware(a.last_seen) for a in agents.values()}, self.defaults.stale_after_s, now,
        )  # fmt: skip
        seen_keys: set[tuple[str, str]] = set()
        changed: dict[tuple[str, str], tuple[State, dict[str, Any]]] = {}
        for rule in rules:
            hysteresis = Hysteresis.of(rule.hysteresis)
            for agent in agents.values():
                if not rule.selector.matches(agent.labels or {}):
                    continue
                key = (rule.id, agent.id)
                seen_keys.add(key)
                seen = observer.see(rule.id, rule.condition, rule.selector.model, agent.id)
                before = self.states.get(key, State())
                after, transition = advance(before, seen.met, _ts(now), hysteresis)
                report.pairs += 1
                if after != before:
                    self.states[key] = after
                    changed[key] = (after, seen.numbers)
                if transition is not None:
                    report.transitions.append(self._record(session, rule, agent, transition, seen, now))
        for key in [k for k in self.states if k not in seen_keys]:  # rules disabled or deleted, agents gone
            del self.states[key]
            session.execute(delete(RuleState).where(RuleState.rule_id == key[0], RuleState.agent_id == key[1]))
        self._write_states(session, changed)
        report.published = self._publish(session, rules, agents)
        return report

    def _record(self, session: Session, rule: RuleSpec, agent: Agent, transition: Transition, seen: Seen,
                now: datetime) -> dict[str, Any]:  # fmt: skip
        kind = f"rule.would_{DRY_RUN_VERBS[transition.kind]}" if rule.dry_run else f"rule.{transition.kind}"
        action = stepped_action(rule.action, transition.state.step).model_dump() if transition.state.active else None
        data = {
            "rule": rule.name, "agent": agent.name, "condition": rule.condition.model_dump(), "observed": seen.numbers,
            "action": action, "state": transition.state.state,
            "step": transition.state.step, "dry_run": rule.dry_run, **transition.data,
        }  # fmt: skip
        record_event(session, kind=kind, actor=ACTOR, subject_type="rule", subject_id=rule.id, agent_id=agent.id,
                     rule_id=rule.id, data=data)  # fmt: skip
        log.info("%s: rule %s on agent %s (%s)", kind, rule.name, agent.name, seen.numbers)
        return {"kind": kind, "rule": rule.name, "agent": agent.id, "at": now}

    def _read_states(self, session: Session) -> dict[tuple[str, str], State]:
        states = {}
        for row in session.scalars(select(RuleState)):
            since = _aware(row.since)
            fired = _aware(row.fired_at)
            states[(row.rule_id, row.agent_id)] = State(
                state=row.state, since=_ts(since) if since else 0.0, fired_at=_ts(fired) if fired else None,
                step=row.step, flaps=tuple(float(f) for f in row.flaps or ()),
                latched=bool((row.data or {}).get("latched")),
            )  # fmt: skip
        return states

    def _write_states(self, session: Session, changed: dict[tuple[str, str], tuple[State, dict[str, Any]]]) -> None:
        for (rule_id, agent_id), (state, numbers) in changed.items():
            row = session.get(RuleState, (rule_id, agent_id))
            values = {"state": state.state, "since": _dt(state.since), "fired_at": _dt(state.fired_at),
                      "step": state.step, "flaps": list(state.flaps),
                      "data": {"latched": state.latched, "observed": numbers}}  # fmt: skip
            if row is None:
                session.add(RuleState(rule_id=rule_id, agent_id=agent_id, **values))
            else:
                for name, value in values.items():
                    setattr(row, name, value)

    def _publish(self, session: Session, rules: list[RuleSpec], agents: dict[str, Agent]) -> dict[str, int]:
        """A new document for every agent whose content changed; returns agent -> version published."""
        assert self.states is not None
        by_id = {r.id: r for r in rules}
        active: dict[str, list[Active]] = {a: [] for a in agents}
        for (rule_id, agent_id), state in self.states.items():
            rule = by_id.get(rule_id)
            if rule is None or rule.dry_run or not state.active or agent_id not in active:
                continue
            active[agent_id].append(Active(rule.id, rule.name, rule.action, rule.selector.model, state.step,
                                           _dt(state.fired_at)))  # fmt: skip
        stored = locked_policies(session)  # before the tenants are read: a tenant change and this take turns
        tenants = tenants_by_agent(session, agents.values())
        published = {}
        for agent_id, items in active.items():
            content = compose(agent_id, items, buckets_ms=self.defaults.buckets_ms,
                              export_interval_s=self.defaults.export_interval_s,
                              poll_interval_s=self.defaults.poll_interval_s, tenants=tenants[agent_id])  # fmt: skip
            row = stored.get(agent_id)
            if row is not None and same_content(row.document, content):
                continue
            version = (row.version if row else 0) + 1
            full, etag = document(content, version)
            if row is None:
                session.add(Policy(agent_id=agent_id, version=version, etag=etag, document=full, updated_at=utcnow()))
            else:
                row.version, row.etag, row.document, row.updated_at = version, etag, full, utcnow()
            if row is not None or items:  # an agent's first, empty document is not news
                record_event(session, kind="policy.published", actor=ACTOR, subject_type="agent", subject_id=agent_id,
                             agent_id=agent_id, data={"version": version, "causes": full["causes"],
                                                      "models": full["models"]})  # fmt: skip
            published[agent_id] = version
        return published


def current_policy(session: Session, agent_id: str, defaults: PolicyDefaults) -> Policy:
    """The agent's published document; an agent the loop has not reached yet gets its first (empty) one now."""
    row = session.get(Policy, agent_id)
    if row is not None:
        return row
    agent = session.get(Agent, agent_id)
    tenants = tenants_for(agent.labels if agent is not None else {}, placed_tenants(session))
    full, etag = document(compose(agent_id, [], buckets_ms=defaults.buckets_ms,
                                  export_interval_s=defaults.export_interval_s,
                                  poll_interval_s=defaults.poll_interval_s, tenants=tenants), 1)  # fmt: skip
    row = Policy(agent_id=agent_id, version=1, etag=etag, document=full, updated_at=utcnow())
    session.add(row)
    session.flush()
    return row


class Leadership:
    """Exactly one replica runs the loop: the one holding a session-level PostgreSQL advisory lock on a
    connection of its own. If that replica dies, its connection closes, the lock goes with it, and another
    replica's next attempt takes it. SQLite means one process: always the leader."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self._conn: Connection | None = None

    @property
    def leader(self) -> bool:
        return not self.postgres or self._conn is not None

    def ensure(self) -> bool:
        """Keep or try to take the lock; True when this replica leads."""
        if not self.postgres:
            return True
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                self._conn.commit()
                return True
            except Exception:  # the connection broke: the lock is gone with it
                log.warning("control loop: lost the leadership connection", exc_info=True)
                self.release()
                return False
        conn = self.engine.connect()
        try:
            took = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOOP_LOCK}).scalar())
            conn.commit()
        except Exception:
            conn.close()
            raise
        if not took:
            conn.close()
            return False
        self._conn = conn
        log.info("control loop: this replica leads")
        return True

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail; nothing to keep
                self._conn.close()
            self._conn = None


__all__ = [
    "DRY_RUN_VERBS",
    "LEGACY_DRY_RUN_KINDS",
    "ControlLoop",
    "CycleReport",
    "Leadership",
    "PolicyDefaults",
    "current_policy",
]
