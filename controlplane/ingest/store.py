"""The ingest tables through the driver: minute rollups, stream state, log positions, agents' `last_seen`.

The applier writes hundreds of rows per transaction, so these statements go to the DBAPI cursor as they are
(`executemany`), without SQLAlchemy's per-parameter processing; the values are made here in the form each column
stores (SQLite: datetimes as SQLAlchemy writes them, JSON as text; PostgreSQL: aware datetimes, JSON cast to jsonb).

Rollups: `INSERT ... ON CONFLICT (agent_id, series, minute) DO UPDATE` adds to a row atomically, so concurrent
writers never lose an update or collide inserting the same new row. Counts and sums add up; a gauge's last value is
the newest, its min and max the extremes; histogram buckets add up element by element (`add_buckets`), in SQL on
PostgreSQL and through a function of this process on SQLite.

Stream state (`ingest_streams`): on PostgreSQL `lock_streams` makes the rows that do not exist yet and locks all of
them in key order (one `INSERT ... ON CONFLICT DO UPDATE ... RETURNING`), so two replicas applying exports of one
agent take the same rows one after the other and in the same order (no deadlock). On SQLite the transaction began
with `BEGIN IMMEDIATE` (the one writer), so a plain read is the state until it commits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import orjson

_SQLITE_TIME = "%Y-%m-%d %H:%M:%S.%f"  # how SQLAlchemy's SQLite DateTime stores a value
_CHUNK = 500  # keys per statement (SQLite's default limit is 32,766 parameters)


def add_buckets(stored: list[Any], new: list[Any]) -> list[Any]:
    """Bucket counts of a minute plus an export's: element by element where the layouts agree; an empty
    stored list takes the new one; otherwise (no new buckets, or another layout: only in rows stored before a
    histogram's row key included its bounds) the stored ones stay."""
    if new and len(stored) == len(new):
        return [a + b for a, b in zip(stored, new, strict=True)]
    if new and not stored:
        return new
    return stored


def dumps(value: Any) -> str:
    """JSON text of a column value (orjson; the standard library for what orjson refuses)."""
    try:
        return orjson.dumps(value).decode()  # (tuples as arrays)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value, default=str)


def loads(text: str | bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


class Store:
    """The statements of one dialect (`sqlite` or `postgresql`), run on a DBAPI cursor."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("sqlite", "postgresql"):
            raise NotImplementedError(f"ingest has no store for {dialect}")
        self.dialect = dialect
        pg = dialect == "postgresql"
        p = "%s" if pg else "?"
        js = "CAST(%s AS jsonb)" if pg else "?"
        buckets = _PG_ADD_BUCKETS if pg else _SQLITE_ADD_BUCKETS
        self._rollups = (
            "INSERT INTO metric_rollups (agent_id, series, minute, metric, attributes, kind, count, total, buckets, "  # noqa: S608
            f"bounds, last, min, max) VALUES ({p}, {p}, {p}, {p}, {js}, {p}, {p}, {p}, {js}, {js}, {p}, {p}, {p}) "
            "ON CONFLICT (agent_id, series, minute) DO UPDATE SET "
            "count = metric_rollups.count + excluded.count, total = metric_rollups.total + excluded.total, "
            f"buckets = {buckets}, "
            "last = CASE WHEN excluded.kind = 'gauge' THEN excluded.last ELSE metric_rollups.last END, "
            # As before: a gauge's min and max take the new value where either side has none.
            "min = CASE WHEN excluded.kind <> 'gauge' THEN metric_rollups.min "
            "WHEN metric_rollups.min IS NULL OR excluded.min IS NULL THEN excluded.min "
            "WHEN excluded.min < metric_rollups.min THEN excluded.min ELSE metric_rollups.min END, "
            "max = CASE WHEN excluded.kind <> 'gauge' THEN metric_rollups.max "
            "WHEN metric_rollups.max IS NULL OR excluded.max IS NULL THEN excluded.max "
            "WHEN excluded.max > metric_rollups.max THEN excluded.max ELSE metric_rollups.max END"
        )
        self._streams = (
            "INSERT INTO ingest_streams (agent_id, stream, start, time, count, total, buckets, earlier, version) "  # noqa: S608
            f"VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}) ON CONFLICT (agent_id, stream) DO UPDATE SET "
            "start = excluded.start, time = excluded.time, count = excluded.count, total = excluded.total, "
            "buckets = excluded.buckets, earlier = excluded.earlier, version = excluded.version"
        )
        self._streams_if = (
            f"UPDATE ingest_streams SET start = {p}, time = {p}, count = {p}, total = {p}, buckets = {p}, "  # noqa: S608
            f"earlier = {p}, version = {p} WHERE agent_id = {p} AND stream = {p} AND version = {p}"
        )
        self._position = (
            f"INSERT INTO ingest_log_positions (log_id, applied_seq, updated_at) VALUES ({p}, {p}, {p}) "  # noqa: S608
            "ON CONFLICT (log_id) DO UPDATE SET applied_seq = CASE WHEN excluded.applied_seq > "
            "ingest_log_positions.applied_seq THEN excluded.applied_seq ELSE ingest_log_positions.applied_seq END, "
            "updated_at = excluded.updated_at"  # never backwards
        )
        self._p = p
        self._minutes: dict[int, Any] = {}

    def begin(self, cursor: Any, fairy: Any, durable: bool = True) -> None:
        """Start the transaction; SQLite's takes the write lock now (a read first and a write later could fail
        with SQLITE_BUSY when another connection wrote in between, and would read state about to be stale).
        Not `durable`: the commit may be lost in a power loss (not in a crash of the process)."""
        if self.dialect == "sqlite":
            if not durable:
                if "spillway_synchronous" not in fairy.info:
                    cursor.execute("PRAGMA synchronous")
                    fairy.info["spillway_synchronous"] = int(cursor.fetchone()[0])
                cursor.execute("PRAGMA synchronous=NORMAL")
                fairy.info["spillway_relaxed"] = True
            cursor.execute("BEGIN IMMEDIATE")
        # PostgreSQL always commits durably: a server that crashes on its own (this process living on) would drop
        # asynchronous commits that this process's next batches then move the log's applied position past.

    def end(self, cursor: Any, fairy: Any) -> None:
        """After the commit or rollback: a pooled SQLite connection gets its own `synchronous` back."""
        if fairy.info.pop("spillway_relaxed", False):
            cursor.execute(f"PRAGMA synchronous={int(fairy.info['spillway_synchronous'])}")

    def minute(self, epoch_s: int) -> Any:
        """A minute (seconds since the epoch) as the `minute` column takes it."""
        found = self._minutes.get(epoch_s)
        if found is None:
            if len(self._minutes) > 10_000:
                self._minutes.clear()
            at = datetime.fromtimestamp(epoch_s, tz=timezone.utc)
            found = self._minutes[epoch_s] = at.strftime(_SQLITE_TIME) if self.dialect == "sqlite" else at
        return found

    def now(self) -> Any:
        at = datetime.now(timezone.utc)
        return at.strftime(_SQLITE_TIME) if self.dialect == "sqlite" else at

    def streams(self, cursor: Any, keys: Iterable[tuple[str, str]]) -> list[tuple[Any, ...]]:
        """The state rows of (agent id, stream) `keys`: (agent_id, stream, start, time, count, total, buckets,
        earlier, version); on PostgreSQL every key gets a row, locked until the transaction ends (in key order)."""
        ordered = sorted(set(keys))
        rows: list[tuple[Any, ...]] = []
        columns = "agent_id, stream, start, time, count, total, buckets, earlier, version"
        for i in range(0, len(ordered), _CHUNK):
            chunk = ordered[i : i + _CHUNK]
            if self.dialect == "postgresql":
                values = ", ".join(["(%s, %s, 0, 0, '[]', '[]', 0)"] * len(chunk))
                cursor.execute(
                    "INSERT INTO ingest_streams (agent_id, stream, count, total, buckets, earlier, version) "  # noqa: S608
                    f"VALUES {values} "
                    f"ON CONFLICT (agent_id, stream) DO UPDATE SET start = ingest_streams.start RETURNING {columns}",
                    [part for key in chunk for part in key],
                )
                rows.extend(cursor.fetchall())
                continue
            by_agent: dict[str, list[str]] = {}
            for agent_id, stream in chunk:
                by_agent.setdefault(agent_id, []).append(stream)
            for agent_id, streams in by_agent.items():
                marks = ", ".join("?" * len(streams))
                cursor.execute(f"SELECT {columns} FROM ingest_streams WHERE agent_id = ? AND stream IN ({marks})",  # noqa: S608
                               [agent_id, *streams])  # fmt: skip
                rows.extend(cursor.fetchall())
        return rows

    def put_streams(self, cursor: Any, rows: Sequence[tuple[Any, ...]]) -> None:
        """Write state rows (agent_id, stream, start, time, count, total, buckets JSON, earlier JSON, version) read
        in this transaction (SQLite: under its write lock; PostgreSQL: locked by `streams`)."""
        if rows:
            cursor.executemany(self._streams, rows)

    def put_streams_if(self, cursor: Any, rows: Sequence[tuple[Any, ...]]) -> bool:
        """Write state rows (start, time, count, total, buckets JSON, earlier JSON, version, agent_id, stream, the
        version expected) where the stored version is the one expected; whether every row was."""
        if not rows:
            return True
        cursor.executemany(self._streams_if, rows)
        return int(cursor.rowcount) == len(rows)

    def add_rollups(self, cursor: Any, rows: Sequence[tuple[Any, ...]]) -> None:
        """Add rollup rows (agent_id, series, minute, metric, attributes JSON, kind, count, total, buckets JSON,
        bounds JSON, last, min, max) to the stored ones, in the given order."""
        if rows:
            cursor.executemany(self._rollups, rows)

    def set_position(self, cursor: Any, log_id: str, seq: int) -> None:
        cursor.execute(self._position, (log_id, seq, self.now()))

    def position(self, cursor: Any, log_id: str) -> int:
        cursor.execute(f"SELECT applied_seq FROM ingest_log_positions WHERE log_id = {self._p}", (log_id,))  # noqa: S608
        row = cursor.fetchone()
        return int(row[0]) if row else 0

    def horizon(self, cursor: Any) -> int:
        cursor.execute("SELECT since_ns FROM ingest_horizon WHERE id = 1")
        row = cursor.fetchone()
        return int(row[0]) if row else 0

    def mark_seen(self, cursor: Any, agent_ids: Iterable[str]) -> None:
        """The agents reported now (`last_seen`), their rows updated in id order."""
        ordered = sorted(agent_ids)
        if ordered:
            marks = ", ".join([self._p] * len(ordered))
            cursor.execute(f"UPDATE agents SET last_seen = {self._p} WHERE id IN ({marks})", [self.now(), *ordered])  # noqa: S608


# `add_buckets` in PostgreSQL: the JSONB arrays added element by element, in order (constant SQL, no input).
_PG_ADD_BUCKETS = """CASE
      WHEN jsonb_array_length(excluded.buckets) > 0
       AND jsonb_array_length(metric_rollups.buckets) = jsonb_array_length(excluded.buckets) THEN
        (SELECT jsonb_agg(s.v::numeric + n.v::numeric ORDER BY i)
           FROM jsonb_array_elements_text(metric_rollups.buckets) WITH ORDINALITY AS s(v, i)
           JOIN jsonb_array_elements_text(excluded.buckets) WITH ORDINALITY AS n(v, i) USING (i))
      WHEN jsonb_array_length(excluded.buckets) > 0 AND jsonb_array_length(metric_rollups.buckets) = 0
        THEN excluded.buckets
      ELSE metric_rollups.buckets
    END"""
# SQLite: `add_buckets` as a function of this process (`register_sqlite_functions`), called only where the export
# brings buckets (JSON text '[]' is the empty list; the function would keep the stored ones anyway).
_SQLITE_ADD_BUCKETS = (
    "CASE WHEN excluded.buckets = '[]' THEN metric_rollups.buckets "
    "ELSE spillway_add_buckets(metric_rollups.buckets, excluded.buckets) END"
)


def _add_buckets_json(stored: str, new: str) -> str:
    try:
        old, add = orjson.loads(stored), orjson.loads(new)
        if len(old) == len(add):  # the common case, without the general function's checks
            return orjson.dumps([a + b for a, b in zip(old, add, strict=True)]).decode()
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, TypeError):
        pass
    return dumps(add_buckets(loads(stored), loads(new)))


def register_sqlite_functions(fairy: Any) -> None:
    """`add_buckets` as a SQL function on a pooled SQLite connection (once per DBAPI connection)."""
    if not fairy.info.get("spillway_add_buckets"):
        fairy.dbapi_connection.create_function("spillway_add_buckets", 2, _add_buckets_json, deterministic=True)
        fairy.info["spillway_add_buckets"] = True


__all__ = ["Store", "add_buckets", "dumps", "loads", "register_sqlite_functions"]
