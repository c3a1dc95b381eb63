"""Schema changes only through Alembic: every revision upgrades and downgrades, and head matches the models."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from controlplane.db import Base, make_engine
from controlplane.db.migrate import alembic_config, head_revision

TABLES = {"agents", "api_keys", "slos", "rules", "backends", "events", "metric_rollups", "policies", "rule_states"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _diff_against_models(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def test_every_revision_upgrades_and_downgrades(db_url: str) -> None:
    cfg = alembic_config(db_url)
    revisions = list(reversed(list(ScriptDirectory.from_config(cfg).walk_revisions())))
    assert revisions[-1].revision == head_revision()
    for rev in revisions:
        command.upgrade(cfg, rev.revision)
    assert _tables(db_url) == TABLES
    assert _diff_against_models(db_url) == []
    for rev in reversed(revisions):
        command.downgrade(cfg, rev.down_revision or "base")
    assert _tables(db_url) == set()
    command.upgrade(cfg, "head")  # and back up again from nothing
    assert _tables(db_url) == TABLES
