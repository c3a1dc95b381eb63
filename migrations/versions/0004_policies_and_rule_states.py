"""The control loop's state: each agent's published policy document and each rule's state per agent.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("agent_id", sa.String(16), sa.ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("etag", sa.String(80), nullable=False),
        sa.Column("document", JSON, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "rule_states",
        sa.Column("rule_id", sa.String(16), sa.ForeignKey("rules.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("agent_id", sa.String(16), sa.ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("flaps", JSON, nullable=False),
        sa.Column("data", JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rule_states")
    op.drop_table("policies")
