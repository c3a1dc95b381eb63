"""Dry-run rule events read as what the rule would have done (`rule.would_fire`): migration 0007 renames stored
events and back, and the events API still takes the old names (`rule.would_fired`) in its filter for one release."""

from __future__ import annotations

import importlib.util
from datetime import datetime, timezone
from pathlib import Path

from alembic import command
from sqlalchemy import text

from controlplane.db import make_engine, make_sessionmaker
from controlplane.db.migrate import alembic_config
from controlplane.db.models import Event
from controlplane.rules.loop import DRY_RUN_VERBS, LEGACY_DRY_RUN_KINDS
from tests.conftest import Api

OLD = ["rule.would_fired", "rule.would_recovered", "rule.would_stepped_down", "rule.would_flapping",
       "rule.would_refired"]  # fmt: skip
NEW = ["rule.would_fire", "rule.would_recover", "rule.would_step_down", "rule.would_flap", "rule.would_refire"]
LIVE = ["rule.fired", "rule.recovered", "rule.stepped_down", "rule.flapping", "rule.refired"]


def _kinds(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text("SELECT kind FROM events ORDER BY id")).scalars())
    finally:
        engine.dispose()


def test_the_migration_renames_stored_dry_run_kinds_and_back(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0006")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            for kind in [*OLD, *LIVE, "policy.published"]:
                conn.execute(
                    text("INSERT INTO events (ts, kind, actor, subject_type, reason, data) "
                         "VALUES (:ts, :kind, 'control-loop', 'rule', '', '{}')"),
                    {"ts": datetime.now(timezone.utc), "kind": kind},
                )  # fmt: skip
    finally:
        engine.dispose()
    command.upgrade(cfg, "head")
    assert _kinds(db_url) == [*NEW, *LIVE, "policy.published"]  # the live kinds and the others stay
    command.downgrade(cfg, "0006")
    assert _kinds(db_url) == [*OLD, *LIVE, "policy.published"]


def test_the_migration_renames_what_the_loop_renamed() -> None:
    path = next(Path(__file__).parents[2].glob("migrations/versions/0007_*.py"))
    spec = importlib.util.spec_from_file_location("migration_0007", path)
    assert spec is not None and spec.loader is not None
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.RENAMES == LEGACY_DRY_RUN_KINDS == dict(zip(OLD, NEW, strict=True))
    assert set(DRY_RUN_VERBS) == {kind.removeprefix("rule.") for kind in LIVE}  # every transition the engine makes


def test_the_events_filter_takes_old_and_new_dry_run_names(sqlite_api: Api) -> None:
    engine = make_engine(sqlite_api.url)
    try:
        with make_sessionmaker(engine)() as session, session.begin():
            for kind in ("rule.would_fire", "rule.fired", "rule.would_recover"):
                session.add(Event(kind=kind, actor="control-loop", subject_type="rule"))
    finally:
        engine.dispose()

    def kinds(kind: str) -> list[str]:
        answer = sqlite_api.call("GET", "/api/v1/events", role="viewer", params={"kind": kind})
        assert answer.status_code == 200, answer.text
        return [e["kind"] for e in answer.json()["items"]]

    assert kinds("rule.would_fired") == ["rule.would_fire"]  # the old name, for one release
    assert kinds("rule.would_fire") == ["rule.would_fire"]
    assert kinds("rule.fired") == ["rule.fired"]
    assert kinds("rule.would_*") == ["rule.would_recover", "rule.would_fire"]
