"""Cumulative-to-delta state in the database (`ingest_streams`, shared by replicas), how far each ingest log has
been applied (`ingest_log_positions`), and since when the state is kept (`ingest_horizon`: on a database that has
rollups already, the upgrade's time, so runs begun under the previous version, which kept the state in memory, are
not counted twice). New tables only.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-24
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ingest_streams",
        sa.Column("agent_id", sa.String(16), primary_key=True),
        sa.Column("stream", sa.String(64), primary_key=True),
        sa.Column("start", sa.BigInteger(), nullable=True),
        sa.Column("time", sa.BigInteger(), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("buckets", sa.Text(), nullable=False),
        sa.Column("earlier", sa.Text(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "ingest_log_positions",
        sa.Column("log_id", sa.String(64), primary_key=True),
        sa.Column("applied_seq", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    horizon = op.create_table(
        "ingest_horizon",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("since_ns", sa.BigInteger(), nullable=False),
    )
    had_rollups = op.get_bind().execute(sa.text("SELECT 1 FROM metric_rollups LIMIT 1")).first() is not None
    op.bulk_insert(horizon, [{"id": 1, "since_ns": time.time_ns() if had_rollups else 0}])


def downgrade() -> None:
    op.drop_table("ingest_horizon")
    op.drop_table("ingest_log_positions")
    op.drop_table("ingest_streams")
