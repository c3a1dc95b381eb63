"""Tenants: the applications that share the agents a selector picks (weight, quotas, priority ceiling), and their
bearer tokens, kept as SHA-256 digests only; and a backend's `tenant_share` (each tenant's most of its in-flight
requests). New tables and a column whose default (`{}`, no tenant capped) is what a backend did before: an upgrade
changes nothing that exists.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def ts(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("selector", JSON, nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.Column("rate_rps", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("max_streams", sa.Integer(), nullable=True),
        sa.Column("max_priority", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        ts("created_at"),
        ts("updated_at"),
    )
    op.create_table(
        "tenant_tokens",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("tenant_id", sa.String(16), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("label", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        ts("created_at"),
    )
    op.create_index("ix_tenant_tokens_tenant_id", "tenant_tokens", ["tenant_id"])
    with op.batch_alter_table("backends") as batch:
        batch.add_column(sa.Column("tenant_share", JSON, nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("backends") as batch:
        batch.drop_column("tenant_share")
    op.drop_index("ix_tenant_tokens_tenant_id", table_name="tenant_tokens")
    op.drop_table("tenant_tokens")
    op.drop_table("tenants")
