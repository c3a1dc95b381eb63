"""Minute rollups of agent metrics (OTLP ingest).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "metric_rollups",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("agent_id", sa.String(16), nullable=False),
        sa.Column("metric", sa.String(255), nullable=False),
        sa.Column("series", sa.String(64), nullable=False),
        sa.Column("attributes", JSON, nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("buckets", JSON, nullable=False),
        sa.Column("bounds", JSON, nullable=False),
        sa.Column("last", sa.Float(), nullable=True),
        sa.Column("min", sa.Float(), nullable=True),
        sa.Column("max", sa.Float(), nullable=True),
        sa.UniqueConstraint("agent_id", "series", "minute", name="uq_metric_rollups_series_minute"),
    )
    op.create_index("ix_metric_rollups_agent_metric_minute", "metric_rollups", ["agent_id", "metric", "minute"])


def downgrade() -> None:
    op.drop_index("ix_metric_rollups_agent_metric_minute", table_name="metric_rollups")
    op.drop_table("metric_rollups")
