"""Alembic environment: the URL comes from the caller (`spillway controlplane migrate`) or SPILLWAY_DATABASE_URL."""

from __future__ import annotations

import os

from alembic import context

from controlplane.db.models import Base
from controlplane.db.session import make_engine, normalise_url

config = context.config
url = config.get_main_option("sqlalchemy.url") or normalise_url(
    os.environ.get("SPILLWAY_DATABASE_URL", "sqlite:///./spillway.db")
)
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        on_version_apply=config.attributes.get("on_version_apply", ()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(
            connection=connectable,
            target_metadata=target_metadata,
            render_as_batch=True,
            on_version_apply=config.attributes.get("on_version_apply", ()),
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            # SQLite: ALTERs are done by batch (copy and move) so every revision works on both backends.
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=True,
                on_version_apply=config.attributes.get("on_version_apply", ()),
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
