"""The control loop: every cycle, evaluate every enabled rule for every agent it selects, move each (rule,
agent) through its hysteresis, write an event for every transition, and publish a new policy document for
every agent whose rules in force changed.

Rule states live in the database (`rule_states`) as well as here, so that another replica taking over the loop
(PostgreSQL advisory lock, see `Leadership`) carries on where this one stopped. Dry-run rules go through the
same states and write `rule.would_*` events (what the rule would have done: `rule.would_fire` where a live rule
writes `rule.fired`), but never reach a policy.

A cycle is one transaction, and its writes take a few statements whatever the fleet's size (a fleet-wide firing
writes thousands of events and a document per agent): the events in one insert, in the order they were recorded
(transitions by rule and agent, then the documents published), the rule states changed in one upsert and those gone
in one delete, the new documents in one upsert. A leader killed mid-cycle commits none of it; its successor reads
the states of the last committed cycle.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Table, bindparam, delete, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import Agent, Policy, Rule, RuleState, Slo, utcnow
from controlplane.db.repository import Actor, event_values, insert_events, upsert
from controlplane.query import RollupReader
from controlplane.rules.engine import Hysteresis, State, Transition, advance
from controlplane.rules.observe import Observer, Seen, read_gauges
from controlplane.rules.policy import Active, compose, document, same_content, stepped_action
from controlplane.rules.tenants import locked_policy_tags, placed_tenants, tenants_by_agent, tenants_for
from controlplane.schemas.rules import RuleSpec, parse_rules
from controlplane.slo import SloWindows
from spillway.contract.policy import PolicyDocument
from spillway.contract.tenants import Tenant as PolicyTenant

log = logging.getLogger("spillway.controlplane.loop")
LOOP_LOCK = 0x5370_4C70  # "SpLp": the replica holding it runs the control loop
CYCLE_LOCK = 0x5370_4C63  # "SpLc": held by a cycle's transaction (see `ControlLoop._cycle`)
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


@dataclass(frozen=True)
class Published:
    """What the loop last composed for an agent, and the ETag of the stored document that says it: while the stored
    ETag is this one and the inputs are these, the document is up to date without reading or composing it."""

    etag: str
    content: PolicyDocument
    items: list[Active]
    tenants: list[PolicyTenant] | None


class PolicyRace(RuntimeError):
    """A stored document changed between the cycle's lock and its write (an agent's first poll made its first
    document meanwhile): the cycle is rolled back and the next one starts from what is stored."""


class ControlLoop:
    """One per control-plane process; `cycle()` is called by the leader only (or directly, in tests).

    A cycle is one transaction: its events, rule states and policies are committed together or not at all (a
    leader killed mid-cycle leaves the last committed cycle's, which its successor reads). A cycle that fails drops
    what this object remembers, so the next one reads the database afresh."""

    def __init__(self, factory: sessionmaker[Session], windows: SloWindows, defaults: PolicyDefaults) -> None:
        self.factory = factory
        self.windows = windows
        self.defaults = defaults
        self.states: dict[tuple[str, str], State] | None = None  # None: to be read from the database
        self.published: dict[str, Published] = {}
        self.gauges = RollupReader()  # remembers each gauge series' attributes across cycles
        self.last: CycleReport | None = None
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Leadership lost: the next cycle (if leader again) reads the states afresh."""
        with self._lock:
            self.states = None
            self.published = {}

    def cycle(self, now: datetime | None = None) -> CycleReport:
        now = now or utcnow()
        started = time.perf_counter()
        with self._lock:
            try:
                with self.factory() as session:
                    report = self._cycle(session, now)
                    session.commit()
            except BaseException:  # rolled back: what this object holds may be ahead of the database
                self.states = None
                self.published = {}
                raise
        report.seconds = time.perf_counter() - started
        self.last = report
        return report

    # ---- inside the lock ---------------------------------------------------------------------

    def _cycle(self, session: Session, now: datetime) -> CycleReport:
        report = CycleReport(at=now)
        if session.get_bind().dialect.name == "postgresql":
            # Cycles take turns: a leader whose lock connection broke mid-cycle finishes (or fails) its cycle before
            # its successor's first one reads the rule states, so a transition is never recorded twice.
            session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": CYCLE_LOCK})
        self.windows.evaluate(session, now)
        if self.states is None:
            self.states = self._read_states(session)
        rules = parse_rules(session.scalars(select(Rule).where(Rule.enabled.is_(True)).order_by(Rule.name)))
        agents = {a.id: a for a in session.scalars(select(Agent))}
        observer = Observer(
            self.windows, {s.name: s.id for s in session.scalars(select(Slo))}, read_gauges(session, now, self.gauges),
            {a.id: _aware(a.last_seen) for a in agents.values()}, self.defaults.stale_after_s, now,
        )  # fmt: skip
        events: list[dict[str, Any]] = []  # written at the end, in this order (ids grow in it)
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
                    report.transitions.append(self._record(events, rule, agent, transition, seen, now))
        gone = [k for k in self.states if k not in seen_keys]  # rules disabled or deleted, agents gone
        for key in gone:
            del self.states[key]
        _write_states(session, gone, changed)
        report.published = self._publish(session, rules, agents, events)
        insert_events(session, events)
        return report

    def _record(self, events: list[dict[str, Any]], rule: RuleSpec, agent: Agent, transition: Transition,
                seen: Seen, now: datetime) -> dict[str, Any]:  # fmt: skip
        kind = f"rule.would_{DRY_RUN_VERBS[transition.kind]}" if rule.dry_run else f"rule.{transition.kind}"
        action = stepped_action(rule.action, transition.state.step).model_dump() if transition.state.active else None
        data = {
            "rule": rule.name, "agent": agent.name, "condition": rule.condition.model_dump(), "observed": seen.numbers,
            "action": action, "state": transition.state.state,
            "step": transition.state.step, "dry_run": rule.dry_run, **transition.data,
        }  # fmt: skip
        events.append(event_values(kind=kind, actor=ACTOR, subject_type="rule", subject_id=rule.id,
                                   agent_id=agent.id, rule_id=rule.id, data=data))  # fmt: skip
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

    def _publish(self, session: Session, rules: list[RuleSpec], agents: dict[str, Agent],
                 events: list[dict[str, Any]]) -> dict[str, int]:  # fmt: skip
        """A new document for every agent whose content changed, written in one upsert; returns agent -> version
        published. An agent whose stored ETag and inputs (rules in force, tenants) are those of the last cycle is
        skipped unread; one whose ETag is not the last one seen (first cycle, a tenant change) is compared with
        its stored document."""
        assert self.states is not None
        by_id = {r.id: r for r in rules}
        active: dict[str, list[Active]] = {a: [] for a in agents}
        for (rule_id, agent_id), state in self.states.items():
            rule = by_id.get(rule_id)
            if rule is None or rule.dry_run or not state.active or agent_id not in active:
                continue
            active[agent_id].append(Active(rule.id, rule.name, rule.action, rule.selector.model, state.step,
                                           _dt(state.fired_at)))  # fmt: skip
        stored = locked_policy_tags(session)  # before the tenants are read: a tenant change and this take turns
        tenants = tenants_by_agent(session, agents.values())
        composed: dict[str, PolicyDocument] = {}
        unread: list[str] = []  # stored documents this loop has not composed: compared with what they say
        for agent_id, items in active.items():
            known, tags = self.published.get(agent_id), stored.get(agent_id)
            if known is not None and tags is not None and known.etag == tags[1]:
                if known.items == items and known.tenants == tenants[agent_id]:
                    continue
                content = self._compose(agent_id, items, tenants[agent_id])
                if content == known.content:
                    self.published[agent_id] = Published(known.etag, content, items, tenants[agent_id])
                    continue
            else:
                content = self._compose(agent_id, items, tenants[agent_id])
                if tags is not None:
                    unread.append(agent_id)
            composed[agent_id] = content
        for agent_id, document_ in _documents(session, unread).items():
            if same_content(document_, composed[agent_id]):
                self.published[agent_id] = Published(stored[agent_id][1], composed.pop(agent_id), active[agent_id],
                                                      tenants[agent_id])  # fmt: skip
        rows, published = [], {}
        for agent_id, content in composed.items():  # agents in the order the events always came in
            tags = stored.get(agent_id)
            version = (tags[0] if tags else 0) + 1
            full, etag = document(content, version)
            rows.append({"agent_id": agent_id, "version": version, "etag": etag, "document": full,
                         "updated_at": utcnow()})  # fmt: skip
            if tags is not None or active[agent_id]:  # an agent's first, empty document is not news
                events.append(event_values(kind="policy.published", actor=ACTOR, subject_type="agent",
                                           subject_id=agent_id, agent_id=agent_id,
                                           data={"version": version, "causes": full["causes"],
                                                 "models": full["models"]}))  # fmt: skip
            self.published[agent_id] = Published(etag, content, active[agent_id], tenants[agent_id])
            published[agent_id] = version
        _write_policies(session, rows)
        return published

    def _compose(self, agent_id: str, items: list[Active], tenants: list[PolicyTenant] | None) -> PolicyDocument:
        return compose(agent_id, items, buckets_ms=self.defaults.buckets_ms, tenants=tenants,
                       export_interval_s=self.defaults.export_interval_s,
                       poll_interval_s=self.defaults.poll_interval_s)  # fmt: skip


def _write_states(session: Session, gone: list[tuple[str, str]],
                  changed: dict[tuple[str, str], tuple[State, dict[str, Any]]]) -> None:  # fmt: skip
    """Delete the states of pairs gone and upsert the changed ones: two statements whatever the fleet's size."""
    table = cast(Table, RuleState.__table__)
    if gone:
        session.execute(delete(table).where(table.c.rule_id == bindparam("r"), table.c.agent_id == bindparam("a")),
                        [{"r": rule_id, "a": agent_id} for rule_id, agent_id in gone])  # fmt: skip
    if changed:
        rows = [{"rule_id": rule_id, "agent_id": agent_id, "state": state.state, "since": _dt(state.since),
                 "fired_at": _dt(state.fired_at), "step": state.step, "flaps": list(state.flaps),
                 "data": {"latched": state.latched, "observed": numbers}}
                for (rule_id, agent_id), (state, numbers) in changed.items()]  # fmt: skip
        session.execute(upsert(session, table, ("rule_id", "agent_id")), rows)


def _write_policies(session: Session, rows: list[dict[str, Any]]) -> None:
    """Insert or update the documents in one upsert. Each row's version must follow the stored one (a new row:
    none stored); a row refused means another writer got there after the lock was taken (possible only for a new
    row: stored ones are locked), and the cycle fails rather than publish a version twice."""
    if not rows:
        return
    table = cast(Table, Policy.__table__)
    stmt = upsert(session, table, ("agent_id",), where=lambda new: table.c.version == new.version - 1)
    written = session.execute(stmt.returning(table.c.agent_id), rows).scalars().all()
    if len(written) != len(rows):
        missing = sorted({r["agent_id"] for r in rows} - set(written))
        raise PolicyRace(f"policies of {len(missing)} agents written meanwhile by another writer: {missing[:5]}")


def _documents(session: Session, agent_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The stored documents of these agents (in chunks: a database limits a statement's parameters)."""
    found: dict[str, dict[str, Any]] = {}
    for i in range(0, len(agent_ids), 500):
        query = select(Policy.agent_id, Policy.document).where(Policy.agent_id.in_(agent_ids[i : i + 500]))
        found.update({agent_id: doc for agent_id, doc in session.execute(query)})
    return found


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
    # The loop (or another poll) may write the first one meanwhile: insert unless there is one, then serve the
    # stored row, whichever wrote it (no savepoint: pysqlite would commit one that opened the transaction).
    dialect = sqlite if session.get_bind().dialect.name == "sqlite" else postgresql
    session.execute(
        dialect.insert(Policy)
        .values(agent_id=agent_id, version=1, etag=etag, document=full, updated_at=utcnow())
        .on_conflict_do_nothing(index_elements=["agent_id"])
    )
    row = session.get(Policy, agent_id, populate_existing=True)
    assert row is not None  # inserted now, or by whoever won
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
