"""Dry-run rule events named for what the rule would have done: `rule.would_fired` becomes `rule.would_fire`,
`rule.would_recovered` `rule.would_recover`, and so on for every transition. Data only: stored events are renamed
(one UPDATE per kind, through the `(kind, id)` index); the downgrade names them back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-17
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Frozen here, not imported: a migration must mean the same thing whatever the code does later.
RENAMES = {
    "rule.would_fired": "rule.would_fire",
    "rule.would_recovered": "rule.would_recover",
    "rule.would_stepped_down": "rule.would_step_down",
    "rule.would_flapping": "rule.would_flap",
    "rule.would_refired": "rule.would_refire",
}

events = sa.table("events", sa.column("kind", sa.String(64)))


def _rename(pairs: dict[str, str]) -> None:
    for old, new in pairs.items():
        op.execute(events.update().where(events.c.kind == old).values(kind=new))


def upgrade() -> None:
    _rename(RENAMES)


def downgrade() -> None:
    _rename({new: old for old, new in RENAMES.items()})
