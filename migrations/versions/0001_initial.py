"""Initial schema: agents, API keys, SLOs, degradation rules, cloud backends, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def versioned() -> list[sa.Column]:
    return [sa.Column("version", sa.Integer(), nullable=False), ts("created_at"), ts("updated_at")]


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("labels", JSON, nullable=False),
        sa.Column("device_class", sa.String(32), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        ts("last_seen", nullable=True),
        *versioned(),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        ts("created_at"),
        ts("last_used_at", nullable=True),
        ts("revoked_at", nullable=True),
    )
    op.create_table(
        "slos",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("selector", JSON, nullable=False),
        sa.Column("sli_kind", sa.String(16), nullable=False),
        sa.Column("threshold_ms", sa.Float(), nullable=True),
        sa.Column("objective", sa.Float(), nullable=False),
        sa.Column("window", sa.Integer(), nullable=False),
        sa.Column("alert_windows", JSON, nullable=False),
        *versioned(),
    )
    op.create_table(
        "rules",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("selector", JSON, nullable=False),
        sa.Column("condition", JSON, nullable=False),
        sa.Column("action", JSON, nullable=False),
        sa.Column("hysteresis", JSON, nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("dry_run", sa.Boolean(), nullable=False),
        *versioned(),
    )
    op.create_table(
        "backends",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("models", JSON, nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("max_concurrency", sa.Integer(), nullable=False),
        sa.Column("timeout_ms", sa.Integer(), nullable=False),
        sa.Column("binary_tensors", sa.Boolean(), nullable=False),
        sa.Column("auth_header", sa.Text(), nullable=True),
        *versioned(),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        ts("ts"),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("actor", sa.String(160), nullable=False),
        sa.Column("subject_type", sa.String(32), nullable=False),
        sa.Column("subject_id", sa.String(64), nullable=True),
        sa.Column("agent_id", sa.String(16), nullable=True),
        sa.Column("rule_id", sa.String(16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("data", JSON, nullable=False),
    )
    op.create_index("ix_events_kind_id", "events", ["kind", "id"])
    op.create_index("ix_events_agent_id_id", "events", ["agent_id", "id"])
    op.create_index("ix_events_ts", "events", ["ts"])


def downgrade() -> None:
    op.drop_index("ix_events_ts", table_name="events")
    op.drop_index("ix_events_agent_id_id", table_name="events")
    op.drop_index("ix_events_kind_id", table_name="events")
    for table in ("events", "backends", "rules", "slos", "api_keys", "agents"):
        op.drop_table(table)
