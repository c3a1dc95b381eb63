"""Schema changes only through Alembic: every revision upgrades and downgrades, and head matches the models."""

from __future__ import annotations

from datetime import datetime, timezone

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text
from sqlalchemy.orm import Session

from controlplane.db import Base, make_engine
from controlplane.db.migrate import alembic_config, head_revision
from controlplane.db.models import Backend

TABLES = {
    "agents",
    "api_keys",
    "slos",
    "rules",
    "backends",
    "events",
    "metric_rollups",
    "ingest_streams",
    "ingest_log_positions",
    "ingest_horizon",
    "policies",
    "rule_states",
    "tenants",
    "tenant_tokens",
}


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


def test_backends_that_exist_before_protocols_stay_v2(db_url: str) -> None:
    """0005 adds `protocol` and `model_map`: a backend registered before it keeps its V2 behaviour."""
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0004")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO backends (id, name, url, models, weight, max_concurrency, timeout_ms, binary_tensors,"
                    " version, created_at, updated_at) VALUES ('b1', 'old', 'http://h', '[\"mlp\"]', 1.0, 8, 100,"
                    " true, 1, :now, :now)"
                ),
                {"now": datetime.now(timezone.utc)},
            )
        command.upgrade(cfg, "head")
        with Session(engine) as session:
            row = session.scalars(select(Backend)).one()
            assert (row.protocol, row.model_map, row.models) == ("v2", {}, ["mlp"])
            row.protocol, row.model_map = "openai", {"mlp": "cloud-mlp"}
            session.commit()
        with Session(engine) as session:
            assert session.scalars(select(Backend)).one().model_map == {"mlp": "cloud-mlp"}
        command.downgrade(cfg, "0004")
        assert "protocol" not in {c["name"] for c in inspect(engine).get_columns("backends")}
    finally:
        engine.dispose()
