"""Engines and sessions: made in the app's lifespan (or a CLI command), never at import time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """An engine tuned per backend: SQLite gets WAL, foreign keys and a busy timeout."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True,
                               json_deserializer=json_loads)  # fmt: skip

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if ":memory:" not in url:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # hide_parameters: a failed statement's log line must not carry secrets (e.g. a backend's auth header).
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, hide_parameters=True,
                         json_deserializer=json_loads)  # fmt: skip


def json_loads(text: str | bytes) -> Any:
    """JSON columns are read with orjson (several times faster: the SLO windows read many rollups), falling
    back to the standard library for what orjson refuses (NaN, which `json.dumps` writes)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def normalise_url(url: str) -> str:
    """`postgresql://` means psycopg 3 here, the driver the `postgres` extra installs."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    with factory() as session, session.begin():
        yield session
