"""Minute rollups in the database: one upsert per row that adds an export's rollup to the stored one.

`INSERT ... ON CONFLICT (agent_id, series, minute) DO UPDATE` adds to a row atomically, so concurrent writers
(threads, or replicas on PostgreSQL) never lose an update or collide inserting the same new row, and no row is
read back first. Counts and sums add up; a gauge's last value is the newest, its min and max the extremes;
histogram buckets add up element by element (`add_buckets`), in SQL on PostgreSQL and through a function of
this process on SQLite.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, cast

import orjson
from sqlalchemy import Connection, Table, bindparam, case, literal_column, update
from sqlalchemy.dialects import postgresql, sqlite

from controlplane.db.models import Agent, MetricRollup, utcnow


def add_buckets(stored: list[Any], new: list[Any]) -> list[Any]:
    """Bucket counts of a minute plus an export's: element by element where the layouts agree; an empty
    stored list takes the new one; otherwise (no new buckets, or another layout: only in rows stored before a
    histogram's row key included its bounds) the stored ones stay."""
    if new and len(stored) == len(new):
        return [a + b for a, b in zip(stored, new, strict=True)]
    if new and not stored:
        return new
    return stored


def add_rollups(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Add rollup rows (every column of `metric_rollups` but `id`) to the stored ones, in the given order."""
    conn.execute(_upsert(conn), rows)


def mark_seen(conn: Connection, agent_ids: Iterable[str]) -> None:
    """The agents reported now (`last_seen`), their rows updated in id order."""
    conn.execute(_SEEN, {"agents": sorted(agent_ids), "now": utcnow()})


_ROLLUPS = cast(Table, MetricRollup.__table__)

# `add_buckets` in PostgreSQL: the JSONB arrays added element by element, in order (constant SQL, no input).
_PG_ADD_BUCKETS = literal_column(
    """CASE
      WHEN jsonb_array_length(excluded.buckets) > 0
       AND jsonb_array_length(metric_rollups.buckets) = jsonb_array_length(excluded.buckets) THEN
        (SELECT jsonb_agg(s.v::numeric + n.v::numeric ORDER BY i)
           FROM jsonb_array_elements_text(metric_rollups.buckets) WITH ORDINALITY AS s(v, i)
           JOIN jsonb_array_elements_text(excluded.buckets) WITH ORDINALITY AS n(v, i) USING (i))
      WHEN jsonb_array_length(excluded.buckets) > 0 AND jsonb_array_length(metric_rollups.buckets) = 0
        THEN excluded.buckets
      ELSE metric_rollups.buckets
    END""",
    type_=_ROLLUPS.c.buckets.type,
)
# SQLite: `add_buckets` as a function of this process (`_register_sqlite_functions`), called only where the export
# brings buckets (JSON text '[]' is the empty list; the function would keep the stored ones anyway).
_SQLITE_ADD_BUCKETS = literal_column(
    "CASE WHEN excluded.buckets = '[]' THEN metric_rollups.buckets "
    "ELSE spillway_add_buckets(metric_rollups.buckets, excluded.buckets) END",
    type_=_ROLLUPS.c.buckets.type,
)
_UPSERTS: dict[str, Any] = {}  # dialect name -> statement, built once
_SEEN = (
    update(Agent)
    .where(Agent.id.in_(bindparam("agents", expanding=True)))
    .values(last_seen=bindparam("now", type_=Agent.__table__.c.last_seen.type))
)


def _upsert(conn: Connection) -> Any:
    """The dialect's upsert of one rollup row: counts and sums add up, gauges keep last, min and max."""
    name = conn.dialect.name
    if name == "sqlite":
        _register_sqlite_functions(conn)
    found = _UPSERTS.get(name)
    if found is not None:
        return found
    if name == "postgresql":
        stmt: Any = postgresql.insert(_ROLLUPS)
        buckets: Any = _PG_ADD_BUCKETS
    elif name == "sqlite":
        stmt = sqlite.insert(_ROLLUPS)
        buckets = _SQLITE_ADD_BUCKETS
    else:
        raise NotImplementedError(f"ingest has no upsert for {name}")
    new, old = stmt.excluded, _ROLLUPS.c
    gauge = new.kind == "gauge"
    found = stmt.on_conflict_do_update(
        index_elements=[old.agent_id, old.series, old.minute],
        set_={
            "count": old.count + new.count,
            "total": old.total + new.total,
            "buckets": buckets,
            "last": case((gauge, new.last), else_=old.last),
            # As before: a gauge's min and max take the new value where either side has none.
            "min": case((~gauge, old.min), (old.min.is_(None) | new.min.is_(None), new.min),
                        (new.min < old.min, new.min), else_=old.min),
            "max": case((~gauge, old.max), (old.max.is_(None) | new.max.is_(None), new.max),
                        (new.max > old.max, new.max), else_=old.max),
        },
    )  # fmt: skip
    _UPSERTS[name] = found
    return found


def _add_buckets_json(stored: str, new: str) -> str:
    try:
        return orjson.dumps(add_buckets(orjson.loads(stored), orjson.loads(new))).decode()
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # what orjson refuses (NaN, huge integers)
        return json.dumps(add_buckets(json.loads(stored), json.loads(new)))


def _register_sqlite_functions(conn: Connection) -> None:
    """`add_buckets` as a SQL function on this SQLite connection (once per pooled DBAPI connection)."""
    info = conn.connection.info
    if not info.get("spillway_add_buckets"):
        conn.connection.dbapi_connection.create_function(  # type: ignore[union-attr]
            "spillway_add_buckets", 2, _add_buckets_json, deterministic=True
        )
        info["spillway_add_buckets"] = True


__all__ = ["add_buckets", "add_rollups", "mark_seen"]
