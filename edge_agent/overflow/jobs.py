"""The async queue's durable store: requests accepted with 202 live in SQLite until they are run and fetched.

Nothing accepted is lost: `submit` returns only once the job is committed with `synchronous=FULL` in WAL mode, so
it survives the process dying and the power going, and jobs left "running" by a process that died are queued
again when the store is opened. A job's life:

    queued --claim--> running --finish--> done
      ^  |               |  \\--fail--> failed (or back to queued with retry=True, up to max_attempts)
      |  |               \\--requeue (could not start)--> queued
      |  \\--expires_at passes--> expired
      \\---- reopened after a crash while running

Jobs done, failed or expired are kept `ttl_s` after they finished, so that a client can still fetch the outcome,
then deleted. A request's bytes are dropped when its job ends; the response is kept. Every write is one short
transaction behind a lock, usable from any thread. Reads (get, counts) take tens of microseconds; a write waits
for its fsync (under a millisecond on an SSD, a few on eMMC or an SD card), so the event loop should make
submit, claim, finish, fail and requeue through `asyncio.to_thread`.

Errors (sqlite3's are turned into these in one place, `_storage_errors`; a misuse of sqlite3 stays a bug):

    QueueFull              the bound: `max_jobs` jobs queued or running
    JobNotRunning          finish, fail or requeue of a job that is not running
    StoreUnavailable       the database refused a read or a write (I/O error, corrupt file, lock held too long)
      \\-- StoreFull       ... because the disk is full

A failed write leaves the store as it was (its transaction rolled back) and usable: the next write after space
returns succeeds. Reads (get, counts) never write, so a full disk does not keep a client from its job's answer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edge_agent.errors import AgentError

QUEUED = "queued"
RUNNING = "running"
DONE = "done"
FAILED = "failed"
EXPIRED = "expired"
STATUSES = (QUEUED, RUNNING, DONE, FAILED, EXPIRED)
ENDED = (DONE, FAILED, EXPIRED)


def _json_loader() -> Callable[[bytes], Any]:
    try:
        import orjson  # optional: several times faster on a large response
    except ImportError:
        return json.loads
    return orjson.loads


_loads = _json_loader()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- submission order: claims are FIFO
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    version TEXT,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    request BLOB,
    header_length INTEGER,
    response BLOB
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
"""
_COLUMNS = ("id, model, version, status, created_at, expires_at, started_at, finished_at, attempts, error, "
            "header_length, response")  # fmt: skip


_EXPIRED_ERROR = "expired before it could run"


class QueueFull(AgentError):
    """The store already holds `max_jobs` jobs queued or running."""


class JobNotRunning(AgentError, LookupError):
    """finish, fail or requeue of a job that is not running: unknown, never claimed, or already ended."""


class StoreUnavailable(AgentError):
    """The database refused a read or a write; nothing was changed. `reason` is the stable code a client is told."""

    status = 503
    reason = "async_storage_unavailable"


class StoreFull(StoreUnavailable):
    """The disk (or the database's size limit) has no room for the write; it works again once space returns."""

    reason = "async_storage_full"


# Errors that say the disk is full. SQLITE_IOERR_SHMSIZE: the WAL index could not grow, which on Linux is ENOSPC.
_FULL = frozenset({"SQLITE_FULL", "SQLITE_IOERR_SHMSIZE"})
# Errors that are a misuse of sqlite3 (a bug of ours), never a state of the disk: not turned into StoreUnavailable.
_BUGS = (sqlite3.ProgrammingError, sqlite3.IntegrityError, sqlite3.NotSupportedError, sqlite3.InterfaceError)


@contextmanager
def _storage_errors(path: Path) -> Iterator[None]:
    """The one border where sqlite3's errors become the store's."""
    try:
        yield
    except _BUGS:
        raise
    except sqlite3.Error as exc:
        # sqlite_errorname is Python 3.11+; on 3.10 the message of SQLITE_FULL is the only sign.
        name = getattr(exc, "sqlite_errorname", None)
        full = name in _FULL if name is not None else "database or disk is full" in str(exc)
        raise (StoreFull if full else StoreUnavailable)(f"the job store {path}: {exc}") from exc


@contextmanager
def _transaction(db: sqlite3.Connection, path: Path) -> Iterator[sqlite3.Connection]:
    """One BEGIN IMMEDIATE ... COMMIT on `db`, rolled back when the block (or the commit) raises."""
    with _storage_errors(path):
        _rollback(db)  # a transaction a failed rollback left open would refuse every BEGIN after it
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)
            raise


def _rollback(db: sqlite3.Connection) -> None:
    # SQLite rolls some failures back by itself (SQLITE_FULL at COMMIT): then there is nothing to roll back, and a
    # ROLLBACK would raise over the error that matters.
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")


@dataclass(frozen=True)
class Job:
    """One accepted request and what became of it."""

    id: str
    model: str
    version: str | None
    status: str  # "queued" | "running" | "done" | "failed" | "expired"
    created_at: float  # the store's clock: seconds since the epoch by default
    expires_at: float  # a job still queued then is never run
    started_at: float | None  # the latest claim
    finished_at: float | None
    attempts: int  # claims so far, less those given back with requeue
    error: str | None
    request: bytes | None  # the original body; only from claim, or get(..., with_request=True), while not ended
    header_length: int | None  # the request's Inference-Header-Content-Length, None for a JSON-only body
    response: bytes | None  # a JSON V2 response body, once done

    def json(self) -> dict[str, Any]:
        """Everything but the request's bytes, with the response as a JSON object."""
        return {
            "id": self.id,
            "model": self.model,
            "version": self.version,
            "status": self.status,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "attempts": self.attempts,
            "error": self.error,
            "header_length": self.header_length,
            "response": None if self.response is None else _loads(self.response),
        }


def _job(row: tuple[Any, ...], request: bytes | None = None) -> Job:
    id_, model, version, status, created, expires, started, finished, attempts, error, header_length, response = row
    return Job(id_, model, version, status, created, expires, started, finished, attempts, error, request,
               header_length, response)  # fmt: skip


class JobStore:
    """Jobs in one SQLite file, safe to call from any thread (one connection behind a lock)."""

    def __init__(
        self,
        path: Path,
        *,
        max_jobs: int = 1000,
        ttl_s: float = 3600.0,
        max_attempts: int = 3,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open or create the store, and queue again the jobs a previous process left running.

        Args:
            path: the database file; its folder is made when missing.
            max_jobs: at most this many jobs queued or running; `submit` raises QueueFull beyond it.
            ttl_s: a job not started within ttl_s of its submission expires; an ended job is deleted ttl_s after.
            max_attempts: the default for `fail(retry=True)`, and a job left running by as many crashed processes
                is failed at open rather than queued again (a request that kills the process must not loop).
            clock: seconds since the epoch (stored on disk, so it must survive a restart).

        A database the disk refuses to open or create (full, say) does not stop the agent: `opened` is False, and
        every call tries to open it again first, raising StoreUnavailable (StoreFull) while it cannot.
        """
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.path = Path(path)
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.max_attempts = max_attempts
        self._clock = clock
        self._lock = threading.Lock()
        self._db_or_none: sqlite3.Connection | None = None
        self._closed = False
        with self._lock, contextlib.suppress(StoreUnavailable):
            self._open()

    @property
    def opened(self) -> bool:
        return self._db_or_none is not None

    def _open(self) -> sqlite3.Connection:
        """Connect, create the schema, queue again what a previous process left running (the lock is held)."""
        if self._db_or_none is not None:
            return self._db_or_none
        if self._closed:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise (StoreFull if full else StoreUnavailable)(f"the job store {self.path}: {exc}") from exc
        # isolation_level=None: no implicit transactions; each write below is one explicit BEGIN IMMEDIATE.
        with _storage_errors(self.path):
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        try:
            with _storage_errors(self.path):
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")  # WAL + NORMAL may lose the last commits on power loss
            with _transaction(db, self.path):
                for statement in filter(str.strip, _SCHEMA.split(";")):  # not executescript: it commits
                    db.execute(statement)
                now = self._clock()
                db.execute(
                    "UPDATE jobs SET status = ?, finished_at = ?, request = NULL, "
                    "error = 'interrupted ' || attempts || ' times: the agent stopped while running it' "
                    "WHERE status = ? AND attempts >= ?",
                    (FAILED, now, RUNNING, self.max_attempts),
                )
                db.execute("UPDATE jobs SET status = ?, started_at = NULL WHERE status = ?", (QUEUED, RUNNING))
        except BaseException:
            db.close()
            raise
        self._db_or_none = db
        return db

    def submit(self, model: str, version: str | None, request: bytes, header_length: int | None) -> Job:
        """Accept a request; durable on disk when this returns. The Job carries no request bytes.

        Raises:
            QueueFull: `max_jobs` jobs are already queued or running.
            StoreUnavailable: the database refused the write (StoreFull: the disk is full); nothing was stored.
        """
        now = self._clock()
        job_id = secrets.token_urlsafe(16)
        with self._write() as db:
            self._expire_queued(db, now)
            (waiting,) = db.execute("SELECT count(*) FROM jobs WHERE status IN (?, ?)", (QUEUED, RUNNING)).fetchone()
            if waiting >= self.max_jobs:
                raise QueueFull(f"{waiting} jobs are queued or running (max_jobs={self.max_jobs})")
            db.execute(
                "INSERT INTO jobs (id, model, version, status, created_at, expires_at, request, header_length) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, model, version, QUEUED, now, now + self.ttl_s, request, header_length),
            )
        return Job(job_id, model, version, QUEUED, now, now + self.ttl_s, None, None, 0, None, None, header_length,
                   None)  # fmt: skip

    def claim(self, models: Collection[str] | None = None) -> Job | None:
        """The oldest queued job that has not expired (of one of `models`, when given), now running; None if none."""
        now = self._clock()
        where, params = "status = ? AND expires_at > ?", [QUEUED, now]
        if models is not None:
            if isinstance(models, str):  # a str is a Collection of its letters
                raise TypeError("models must be a collection of model names, not one str")
            models = list(models)
            if not models:
                return None
            where += f" AND model IN ({', '.join('?' * len(models))})"
            params += models
        with self._write() as db:
            self._expire_queued(db, now)
            row = db.execute(
                f"SELECT seq, request FROM jobs WHERE {where} ORDER BY seq LIMIT 1",  # noqa: S608 (placeholders only)
                params,
            ).fetchone()
            if row is None:
                return None
            seq, request = row
            db.execute(
                "UPDATE jobs SET status = ?, started_at = ?, attempts = attempts + 1 WHERE seq = ?", (RUNNING, now, seq)
            )
            found = db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE seq = ?", (seq,)).fetchone()  # noqa: S608
        return _job(found, request)

    def finish(self, job_id: str, response: bytes) -> None:
        """A running job succeeded with `response`, a JSON object (checked here, so that `Job.json` cannot fail)."""
        if not isinstance(_loads(response), dict):
            raise ValueError("a job's response must be a JSON object")
        self._update_running(job_id, "status = ?, finished_at = ?, response = ?, error = NULL, request = NULL",
                  (DONE, self._clock(), response))  # fmt: skip

    def fail(self, job_id: str, error: str, *, retry: bool = False, max_attempts: int | None = None) -> None:
        """A running job failed: with `retry`, queued again unless it has had `max_attempts` (the store's default)."""
        limit = self.max_attempts if max_attempts is None else max_attempts
        with self._write() as db:
            row = db.execute("SELECT attempts FROM jobs WHERE id = ? AND status = ?", (job_id, RUNNING)).fetchone()
            if row is None:
                raise JobNotRunning(job_id)
            if retry and row[0] < limit:
                db.execute("UPDATE jobs SET status = ?, started_at = NULL, error = ? WHERE id = ?",
                           (QUEUED, error, job_id))  # fmt: skip
            else:
                db.execute("UPDATE jobs SET status = ?, finished_at = ?, error = ?, request = NULL WHERE id = ?",
                           (FAILED, self._clock(), error, job_id))  # fmt: skip

    def requeue(self, job_id: str) -> None:
        """A claimed job that could not start (refused by admission, say): queued again, the attempt not counted."""
        self._update_running(job_id, "status = ?, started_at = NULL, attempts = max(attempts - 1, 0)", (QUEUED,))

    def get(self, job_id: str, *, with_request: bool = False) -> Job | None:
        """The job, or None when there is none (never was, or `ttl_s` past its end). A read only: a queued job past
        `expires_at` is shown expired, and one past its `ttl_s` as gone, before `expire` or `claim` writes it so."""
        now = self._clock()
        columns = f"{_COLUMNS}, request" if with_request else _COLUMNS
        with self._read() as db:
            found = db.execute(f"SELECT {columns} FROM jobs WHERE id = ?", (job_id,)).fetchone()  # noqa: S608
        if found is None:
            return None
        job = _job(found[:12], found[12] if with_request else None)
        if job.status == QUEUED and job.expires_at <= now:
            job = replace(job, status=EXPIRED, finished_at=job.expires_at, error=_EXPIRED_ERROR, request=None)
        if job.status in ENDED and job.finished_at is not None and job.finished_at + self.ttl_s <= now:
            return None
        return job

    def expire(self) -> int:
        """Mark queued jobs past `expires_at` expired, delete ended jobs `ttl_s` after they ended; how many changed."""
        now = self._clock()
        with self._write() as db:
            expired = self._expire_queued(db, now)
            deleted = db.execute("DELETE FROM jobs WHERE status IN (?, ?, ?) AND finished_at <= ?",
                                 (*ENDED, now - self.ttl_s)).rowcount  # fmt: skip
        return expired + deleted

    def counts(self) -> dict[str, int]:
        """How many jobs in each status, every status named (queued jobs past expires_at counted as expired)."""
        with self._read() as db:
            rows = db.execute(
                "SELECT CASE WHEN status = ? AND expires_at <= ? THEN ? ELSE status END, count(*) FROM jobs GROUP BY 1",
                (QUEUED, self._clock(), EXPIRED),
            ).fetchall()
        return {status: 0 for status in STATUSES} | dict(rows)

    def close(self) -> None:
        """Close the database; calling it again does nothing."""
        with self._lock:
            self._closed = True
            if self._db_or_none is not None:
                self._db_or_none.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, holding the lock; committed when the block ends, rolled back when it (or the commit)
        raises, so that a failed write leaves nothing half done and the next one starts clean."""
        with self._lock, _transaction(self._open(), self.path) as db:
            yield db

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """Reads with the lock held, outside any write transaction (each statement sees one committed state)."""
        with self._lock:
            db = self._open()
            with _storage_errors(self.path):
                yield db

    def _update_running(self, job_id: str, assignments: str, params: tuple[Any, ...]) -> None:
        with self._write() as db:
            changed = db.execute(
                f"UPDATE jobs SET {assignments} WHERE id = ? AND status = ?",  # noqa: S608 (constants only)
                (*params, job_id, RUNNING),
            ).rowcount
            if changed == 0:
                raise JobNotRunning(job_id)

    @staticmethod
    def _expire_queued(db: sqlite3.Connection, now: float) -> int:
        # An expired job ended when it expired: it is kept ttl_s from then, whenever this sweep happens to run.
        return db.execute(
            "UPDATE jobs SET status = ?, finished_at = expires_at, error = ?, request = NULL "
            "WHERE status = ? AND expires_at <= ?",
            (EXPIRED, _EXPIRED_ERROR, QUEUED, now),
        ).rowcount
