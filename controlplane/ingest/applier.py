"""Folded exports into the database, in one transaction per batch: the streams' cumulative values become deltas
against the state stored in `ingest_streams` (read and written in the same transaction, so replicas applying exports
of one agent in any order count every increment once), the rows of one (agent, series, minute) are merged across the
batch, and the rollups, the state, each log's applied seq and the agents' `last_seen` commit together: a replay after
a crash applies each logged export exactly once.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from controlplane.ingest.deltas import Reading, advance
from controlplane.ingest.store import Store, dumps, loads, register_sqlite_functions

_SEEN_EVERY_S = 30.0  # an agent's `last_seen` is written at most this often by one process's ingest
_CACHED_STREAMS = 500_000  # streams kept in memory (as this applier wrote them), at most
_EMPTY = "[]"

# A cumulative point, folded: (stream, row, minute, start, time, count, total, buckets, histogram)
CumulativePoint = tuple[str, str, int, int, int, int, float, tuple[int, ...], bool]


@dataclass(slots=True, eq=False)
class Folded:
    """One export's accepted points, ready to apply: `rows` (row, minute s) -> [count, total, buckets, last, min, max]
    of gauges and delta-temporality points, added up already; `points` the cumulative ones, in export order; `meta`
    row -> (metric, attributes JSON, kind, bounds JSON)."""

    agent_id: str
    meta: dict[str, tuple[str, str, str, str]] = field(default_factory=dict)
    rows: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    points: list[CumulativePoint] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Job:
    """An export between submit and commit; `seq` numbers this process's submissions, `log_seq` its log record."""

    seq: int
    folded: Folded | None
    log_id: str | None = None
    log_seq: int | None = None
    applied: Future[None] | None = None  # mode `applied`: the answer waits for this
    logged: Future[None] | None = None  # mode `logged`: done once the record is durable; failed: never applied
    at: float = field(default_factory=time.monotonic)


def merge(into: list[Any], new: list[Any], gauge: bool) -> None:
    """Add a rollup's [count, total, buckets, last, min, max] to another of the same row and minute (`new` later)."""
    into[0] += new[0]
    into[1] += new[1]
    if gauge:
        into[3] = new[3]
        into[4] = new[4] if into[4] is None or new[4] < into[4] else into[4]
        into[5] = new[5] if into[5] is None or new[5] > into[5] else into[5]
        return
    old, add = into[2], new[2]
    if add and len(old) == len(add):
        into[2] = [a + b for a, b in zip(old, add, strict=True)]
    elif add and not old:
        into[2] = list(add)


class Applier:
    """Applies batches of jobs; one per Ingestor (its thread, or a caller of `apply` while none runs)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.store = Store(engine.dialect.name)
        self._horizon: int | None = None
        self._seen: dict[str, float] = {}  # agent -> when (monotonic) this process last wrote its last_seen
        # (agent, stream) -> (version, runs) as this applier committed them: spares reading them again; a write of
        # one is conditional on its version, so a stream another replica wrote since is read again, never reused.
        self._cache: dict[tuple[str, str], tuple[int, dict[int, Reading]]] = {}
        self.stale = 0  # batches whose cached streams another writer had changed (applied again, read afresh)

    def position(self, log_id: str) -> int:
        """How far the log `log_id` is applied (0: nothing yet)."""
        with self.engine.connect() as conn:
            dbapi: Any = conn.connection.driver_connection
            cursor = dbapi.cursor()
            try:
                return self.store.position(cursor, log_id)
            finally:
                cursor.close()
                dbapi.rollback()

    def apply(self, jobs: list[Job], durable: bool = True) -> None:
        """Apply `jobs` (in order) in one transaction; raises (nothing written) when it fails.

        `durable` False: the commit need not survive a power loss (SQLite `synchronous=NORMAL`; PostgreSQL always
        commits durably, since its server may crash while this process lives on; a crash of the process loses
        nothing either way), for exports whose log records are kept until a durable commit covers them: a power
        loss then rolls back rollups and applied seq together,
        and the replay applies the records again."""
        try:
            self._transaction(jobs, durable, cached=True)
        except _Stale:  # another replica wrote one of the streams since: read them all
            self.stale += 1
            self._transaction(jobs, durable, cached=False)

    def _transaction(self, jobs: list[Job], durable: bool, cached: bool) -> None:
        store = self.store
        agents = {job.folded.agent_id for job in jobs if job.folded is not None}
        keys = {(job.folded.agent_id, p[0]) for job in jobs if job.folded is not None for p in job.folded.points}
        positions: dict[str, int] = {}
        for job in jobs:
            if job.log_id is not None and job.log_seq is not None:
                positions[job.log_id] = max(positions.get(job.log_id, 0), job.log_seq)
        now = time.monotonic()
        seen = sorted(a for a in agents if now - self._seen.get(a, -1e18) >= _SEEN_EVERY_S)
        # The streams this applier wrote last (their version then); the others are read (PostgreSQL: and locked).
        # Their runs are advanced in place: the cache is replaced after the commit, or dropped if it fails.
        known: dict[tuple[str, str], int] = {}
        state: dict[tuple[str, str], dict[int, Reading]] = {}
        if cached:
            cache = self._cache
            for key in keys:
                found = cache.get(key)
                if found is not None:
                    known[key], state[key] = found
        versions = dict(known)
        changed: set[tuple[str, str]] = set()
        with self.engine.connect() as conn:
            fairy = conn.connection
            if store.dialect == "sqlite":
                register_sqlite_functions(fairy)
            dbapi: Any = fairy.driver_connection
            cursor = dbapi.cursor()
            try:
                store.begin(cursor, fairy, durable)
                if self._horizon is None:
                    self._horizon = store.horizon(cursor)
                unknown = keys - known.keys()
                if unknown:
                    _read(store.streams(cursor, unknown), state, versions)
                rollups, meta = self._fold(jobs, state, changed)
                checked, written = _state_rows(state, versions, changed, known)
                if not store.put_streams_if(cursor, checked):
                    raise _Stale
                store.put_streams(cursor, written)
                store.add_rollups(cursor, [
                    (agent_id, row, store.minute(minute), *meta[(agent_id, row)][:2], meta[(agent_id, row)][2],
                     v[0], v[1], dumps(v[2]) if v[2] else _EMPTY, meta[(agent_id, row)][3], v[3], v[4], v[5])
                    for (agent_id, row, minute), v in sorted(rollups.items())
                ])  # fmt: skip
                for log_id, seq in sorted(positions.items()):
                    store.set_position(cursor, log_id, seq)
                if seen:
                    store.mark_seen(cursor, seen)
                dbapi.commit()
            except BaseException:
                for key in keys:  # (a failed commit may have committed: the cache is read again)
                    self._cache.pop(key, None)
                dbapi.rollback()
                raise
            finally:
                store.end(cursor, fairy)
                cursor.close()
        if len(self._cache) + len(changed) > _CACHED_STREAMS:
            self._cache.clear()
        for key in changed:
            self._cache[key] = (versions.get(key, 0) + 1, state[key])
        for agent_id in seen:
            self._seen[agent_id] = now
        if len(self._seen) > 100_000:
            self._seen.clear()

    def _fold(self, jobs: list[Job], state: dict[tuple[str, str], dict[int, Reading]],
              changed: set[tuple[str, str]]) -> tuple[dict[Any, list[Any]], dict[Any, Any]]:  # fmt: skip
        """The batch's rollup rows, merged, and their metadata; `state` advanced, the streams it changed noted."""
        horizon = self._horizon or 0
        rollups: dict[tuple[str, str, int], list[Any]] = {}
        meta: dict[tuple[str, str], Any] = {}
        for job in jobs:
            folded = job.folded
            if folded is None:
                continue
            agent_id = folded.agent_id
            for row, info in folded.meta.items():
                meta[(agent_id, row)] = info
            for (row, minute), values in folded.rows.items():
                key = (agent_id, row, minute)
                found = rollups.get(key)
                if found is None:
                    rollups[key] = [values[0], values[1], list(values[2]), *values[3:]]
                else:
                    merge(found, values, folded.meta[row][2] == "gauge")
            for stream, row, minute, start, at, count, total, buckets, histogram in folded.points:
                skey = (agent_id, stream)
                runs = state.get(skey)
                if runs is None:
                    runs = state[skey] = {}
                added = advance(runs, start, (at, count, total, buckets), histogram, horizon)
                changed.add(skey)  # (a duplicate changes nothing, but writing it back is cheaper than comparing)
                if added is None:
                    continue
                key = (agent_id, row, minute)
                found = rollups.get(key)
                if found is None:
                    rollups[key] = [added[0], added[1], list(added[2]), None, None, None]
                else:
                    merge(found, [added[0], added[1], added[2], None, None, None], False)
        return rollups, meta


def _read(rows: list[tuple[Any, ...]], state: dict[tuple[str, str], dict[int, Reading]],
          versions: dict[tuple[str, str], int]) -> None:  # fmt: skip
    """State rows as runs: (agent, stream) -> {start: (time, count, total, buckets)}, and their versions."""
    for agent_id, stream, start, at, count, total, buckets, earlier, version in rows:
        key = (agent_id, stream)
        versions[key] = int(version)
        if start is None:
            state[key] = {}
            continue
        runs = {int(start): (int(at), int(count), float(total), tuple(loads(buckets)) if buckets != _EMPTY else ())}
        if earlier != _EMPTY:
            for s, t, c, v, b in loads(earlier):
                runs[s] = (t, c, v, tuple(b))
        state[key] = runs


def _state_rows(state: dict[tuple[str, str], dict[int, Reading]], versions: dict[tuple[str, str], int],
                changed: set[tuple[str, str]], known: dict[Any, Any]) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """The changed streams' rows, in key order: those from the cache as `put_streams_if` takes them (written only
    where the version is still the cached one), those read in this transaction as `put_streams` does."""
    checked, written = [], []
    for key in sorted(changed):
        runs = state[key]
        if len(runs) == 1:
            ((newest, (at, count, total, buckets)),) = runs.items()
            earlier = _EMPTY
        elif runs:
            newest = max(runs)
            at, count, total, buckets = runs[newest]
            earlier = dumps([[s, *runs[s]] for s in sorted(runs) if s != newest])
        else:
            continue
        version = versions.get(key, 0)
        values = (newest, at, count, total, dumps(buckets) if buckets else _EMPTY, earlier, version + 1)
        if key in known:
            checked.append((*values, *key, version))
        else:
            written.append((*key, *values))
    return checked, written


class _Stale(Exception):
    """A stream this applier had in memory was written by another since (a replica, or the retention)."""


__all__ = ["Applier", "CumulativePoint", "Folded", "Job", "merge"]
