"""Index minute rollups by metric and minute: the SLO windows re-read the last minutes of every agent.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_metric_rollups_metric_minute", "metric_rollups", ["metric", "minute"])


def downgrade() -> None:
    op.drop_index("ix_metric_rollups_metric_minute", table_name="metric_rollups")
