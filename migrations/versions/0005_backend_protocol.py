"""Backends speak a protocol: `v2` (as before) or `openai`, whose `model_map` names the backend's model for an edge
model. Rows that exist get `v2` and an empty map (the server defaults), so an upgrade changes no backend's behaviour.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("backends") as batch:
        batch.add_column(sa.Column("protocol", sa.String(16), nullable=False, server_default="v2"))
        batch.add_column(sa.Column("model_map", JSON, nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("backends") as batch:
        batch.drop_column("model_map")
        batch.drop_column("protocol")
