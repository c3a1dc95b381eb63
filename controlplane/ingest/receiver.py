"""OTLP metrics in, minute rollups out: decode, check the sender, rename legacy metric and attribute names
(`attributes`), bring histograms onto the bounds the control plane reads them on (`bounds`), convert cumulative
streams to deltas (against the state in the database, `applier`), and add each minute's deltas (and gauge samples)
to the database. In mode `logged` an export is appended to this process's ingest log (`log`) before it is answered
and applied just after; a restart replays what the log holds beyond the applied position.

Refusals of part of the data (unsupported metric types, malformed points, histograms on bounds that cannot be
re-bucketed exactly, series beyond an agent's cardinality limit) are counted and reported back through OTLP's
`partial_success`; nothing else is ever dropped silently.

The tenant of a point (`spillway.tenant`, on the request metrics) is kept as one of its attributes, so a tenant's
series are series of their own. The agent bounds it (its configured tenants, `default` and `other`); the control
plane bounds it again, per agent: a tenant that is not a tenant name (the contract's NAME_PATTERN), or a new one
beyond `max_tenants_per_agent` distinct names since this process started, is stored as `other`. A point without
the attribute (an agent from before tenants) is stored as sent and read as tenant `default` (`query.tenant_of`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import queue
import re
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import IngestStream, MetricRollup
from controlplane.errors import Forbidden, Overloaded, UndecodableMetrics, UnsupportedMediaType
from controlplane.ingest.applier import Applier, Folded, Job, merge
from controlplane.ingest.attributes import current_metric, current_names, layout_key, series_key
from controlplane.ingest.bounds import Fit, Layouts
from controlplane.ingest.log import IngestLog
from controlplane.ingest.store import dumps
from spillway.contract.names import ATTR_TENANT, DEFAULT_LATENCY_BUCKETS_MS
from spillway.contract.tenants import DEFAULT_TENANT, MAX_TENANTS, NAME_PATTERN, OTHER_TENANT

CUMULATIVE = 2
_SERIES_CACHE_SIZE = 100_000  # (metric, attributes as sent) -> series key; cleared when it grows past this
_LOGGED_KEPT = 10_000  # (agent, reason) refusals logged once; forgotten (logged again) past this
_REASONS_SAID = 20  # distinct reasons in one answer's partial_success.error_message, at most
_MAX_BACKLOG = 20_000  # exports queued for the applier before submit answers Overloaded
_BATCH = 2_000  # exports applied in one transaction, at most
_REPLAY_BATCH = 256
_GATHER_MIN = 64  # mode logged: fewer exports queued than this, the applier waits `_GATHER_S` for more first
_GATHER_S = 0.01
_MAX_NS = (1 << 63) - 1
# NumberDataPoint's fixed64 fields before its attributes (field 7): start and time (2, 3), as_double (4), as_int (6)
_FIXED64_BEFORE_ATTRIBUTES = frozenset(
    (0x11, 0x19, 0x21, 0x31)
)  # timestamps and counts beyond a signed 64-bit column are refused
_TENANT_NAME = re.compile(NAME_PATTERN)
_ALWAYS_TENANTS = frozenset({DEFAULT_TENANT, OTHER_TENANT})  # never counted against the cap
log = logging.getLogger("spillway.controlplane")


def prune(session: Session, older_than: datetime) -> int:
    """Delete rollups of minutes before `older_than` (retention), and the state of streams silent since; returns how
    many rollups went."""
    result = session.execute(delete(MetricRollup).where(MetricRollup.minute < older_than))
    session.execute(delete(IngestStream).where(IngestStream.time < int(older_than.timestamp()) * 1_000_000_000))
    return int(getattr(result, "rowcount", 0) or 0)


def decode(body: bytes, content_type: str, content_encoding: str, max_bytes: int) -> ExportMetricsServiceRequest:
    """OTLP/HTTP protobuf or JSON, optionally gzip; a gzip bomb is cut at `max_bytes` decompressed."""
    if content_encoding.strip().lower() == "gzip":
        try:
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            body = inflater.decompress(body, max_bytes + 1)
        except zlib.error as exc:
            raise UndecodableMetrics(f"the body is not valid gzip: {exc}") from None
        if len(body) > max_bytes:
            raise UndecodableMetrics(f"the body inflates to more than {max_bytes} bytes")
    elif content_encoding.strip() not in ("", "identity"):
        raise UnsupportedMediaType(f"content encoding '{content_encoding}' is not supported; use gzip or none")
    message = ExportMetricsServiceRequest()
    media = content_type.split(";")[0].strip().lower()
    try:
        if media == "application/x-protobuf":
            message.ParseFromString(body)
        elif media == "application/json":
            json_format.Parse(body.decode("utf-8"), message, ignore_unknown_fields=True)
        else:
            raise UnsupportedMediaType(f"content type '{media}' is not OTLP: use application/x-protobuf or json")
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
        raise UndecodableMetrics(f"the body is not an OTLP metrics export: {exc}") from None
    return message


def _value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind in ("array_value", "kvlist_value", "bytes_value"):
        return json_format.MessageToDict(any_value)
    return getattr(any_value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass(frozen=True, slots=True)
class _Series:
    """A point's series (its metric and attributes: what the cardinality limit counts), the `series` column of its
    rows (a histogram's: with its layout, `layout_key`), its attributes under the current names and their JSON."""

    series: str
    row: str
    attributes: dict[str, Any]
    attributes_json: str


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    rejected: int
    message: str = ""


class Submitted(NamedTuple):
    """An export taken: what was accepted and refused (known at once), and `durable`, done when the export is in the
    ingest log (mode `logged`) or committed (no log: mode `applied`); it carries the store's error when that failed."""

    result: IngestResult
    durable: Future[None]


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class Ingestor:
    """One per control-plane process; thread-safe (routes run in a thread pool).

    `submit` checks and folds an export at once (the answer's partial_success is exact), appends it to the ingest
    log when there is one, and queues it; an applier thread takes everything queued and applies it in one
    transaction (`applier`), export after export in submission order. A batch that fails is applied export by
    export, so a bad export fails alone; when the database itself fails, logged exports are kept and retried (they
    were acknowledged), the others fail (the route answers 503). `start` first replays what the log holds beyond the
    applied position, and the records of slots no process holds.
    """

    def __init__(self, factory: sessionmaker[Session], *, max_series_per_agent: int = 10_000,
                 latency_buckets_ms: Iterable[float] = DEFAULT_LATENCY_BUCKETS_MS,
                 max_tenants_per_agent: int = MAX_TENANTS, log: IngestLog | None = None,
                 max_backlog: int = _MAX_BACKLOG) -> None:  # fmt: skip
        self.factory = factory
        self.max_series_per_agent = max_series_per_agent
        self.max_tenants_per_agent = max_tenants_per_agent  # beyond: `other` (an agent may configure MAX_TENANTS)
        self.max_backlog = max_backlog  # exports queued for the applier; beyond: Overloaded (503)
        self.layouts = Layouts(latency_buckets_ms)  # the histograms' bounds, as the agents' policies set them
        self.log = log
        engine = factory.kw.get("bind")
        if not isinstance(engine, Engine):
            raise TypeError("the Ingestor's session factory must be bound to an engine")
        self.applier = Applier(engine)
        self._known: dict[str, set[str]] = defaultdict(set)
        # agent -> the tenant names kept as they came (`default` and `other` always, beside the capped ones)
        self._tenants: dict[str, set[str]] = defaultdict(lambda: set(_ALWAYS_TENANTS))
        self._as_other: dict[str, _Series] = {}  # a row key -> the same series with tenant `other`
        # The series key, row key and attributes (legacy names renamed) of each attribute list (and histogram layout)
        # as sent: agents send the same few hundred again every export, so hashing them once saves most of the
        # per-point work. Keyed by the protobuf encoding of the attributes (`_series`), which determines the decoded
        # attributes, so a hit is exactly what a miss computes.
        self._series_cache: dict[tuple[Any, ...], _Series] = {}
        self._bounds_json: dict[tuple[float, ...], str] = {}
        self._checked: dict[tuple[float, ...], bool] = {}  # histogram bounds judged: finite and increasing or not
        self._logged: set[tuple[str, str]] = set()  # (agent, refusal reason) logged once
        self._lock = threading.Lock()  # the series sets and caches (folding)
        # The event loop submits; it must never wait for a lock the applier holds (the applier may keep the GIL for
        # milliseconds once it has it back). So submitters alone take `_submit_lock` (seqs, log order, queue order),
        # jobs go to the applier through a deque, and a SimpleQueue of tokens wakes it.
        self._submit_lock = threading.Lock()
        self._queue: collections.deque[Job] = collections.deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._queued = threading.Condition()  # `_applying`, `_applied` (wait_applied), the counters below
        self._applying: list[Job] = []  # the batch the applier has taken
        self._submitted = 0  # submissions so far (`accepted_seq`)
        self._applied = 0  # every submission up to this one is applied (or failed)
        self._counts = dict.fromkeys(("applied", "failed", "batches", "replayed", "replay_failed"), 0)
        self._start_lock = threading.Lock()
        self._started = False
        self._closing = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Replay the log's unapplied records (blocking), then start the applier thread. Idempotent."""
        with self._start_lock:
            if self._started:
                return
            if self.log is not None:
                for idle in self.log.idle_slots():
                    try:
                        self._replay(idle)
                        idle.drop_all()
                    finally:
                        idle.close()
                self._replay(self.log)
            self._thread = threading.Thread(target=self._run, name="spillway-ingest-applier", daemon=True)
            self._thread.start()
            self._started = True

    def close(self, timeout: float = 10.0) -> None:
        """Apply what is queued (up to `timeout`), stop the applier thread and release the log's slot."""
        with self._submit_lock:  # no submission after this one; first: a replay retrying under the start lock stops
            self._closing = True
        with self._start_lock:
            self._wake.put(None)
            if self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    log.warning("ingest: %d exports still queued at shutdown (the log replays them)", len(self._queue))
            if self.log is not None:
                self.log.close()

    def _replay(self, source: IngestLog) -> None:
        """Apply `source`'s records beyond its applied position, in batches (each record folded again: the same
        checks as when it came); then append after them and delete what is applied."""
        applied = self.applier.position(source.log_id)
        batch: list[Job] = []
        replayed = 0
        for record in source.replay(applied):
            folded = None
            try:
                message = ExportMetricsServiceRequest()
                message.ParseFromString(record.body)
                self._check_sender(record.agent_id, message)
                _, folded, _ = self._fold(record.agent_id, message)
            except (DecodeError, Forbidden) as exc:  # written by this code, so not expected: said, not fatal
                log.error("ingest log %s: record %d cannot be replayed: %s", source.path, record.seq, exc)
                self._counts["replay_failed"] += 1
            batch.append(Job(0, folded, source.log_id, record.seq))
            replayed += 1
            if len(batch) >= _REPLAY_BATCH:
                self._apply(batch)
                batch = []
        if batch:
            self._apply(batch)
        if source is self.log:
            source.resume(max(source.last_seq, applied) + 1)
            source.applied(max(source.last_seq, applied))
        self._counts["replayed"] += replayed
        if replayed:
            log.info("ingest log %s: %d records replayed beyond seq %d", source.path, replayed, applied)

    # ---- taking exports -------------------------------------------------------------------------------------------

    def submit(self, agent_id: str, message: ExportMetricsServiceRequest, *, raw: bytes | None = None) -> Submitted:
        """Check and fold an export, log it (mode `logged`) and queue it for the applier; CPU and the log only.

        `raw`: the message's protobuf encoding when the caller has it (spares encoding it again for the log).
        Raises Forbidden when the export is another agent's, Overloaded when the applier is too far behind.
        """
        self._check_sender(agent_id, message)
        if self._closing:
            raise RuntimeError("the ingestor is closed")
        if not self._started:
            self.start()  # an app that did not call start (tests; the route before its lifespan does)
        if len(self._queue) >= self.max_backlog:
            raise Overloaded(f"the control plane has {len(self._queue)} exports waiting to be written; retry later",
                             details={"retry_after_s": 1})  # fmt: skip
        result, folded, fresh = self._fold(agent_id, message)
        for reason in fresh:  # an SDK's exporter may not show partial_success to anyone: the operator sees this
            log.warning("agent %s: data points refused (answered in partial_success): %s", agent_id, reason)
        with self._submit_lock:
            if self._closing:
                raise RuntimeError("the ingestor is closed")
            job = Job(self._submitted + 1, folded)
            durable: Future[None]
            if folded is None:
                durable = _done()  # nothing to store
            elif self.log is not None:
                # Under the queue's lock: the log's order is the queue's, so an applied seq covers every record before.
                job.log_id = self.log.log_id
                body = message.SerializeToString() if raw is None else raw
                try:
                    job.log_seq, durable = self.log.append(agent_id, body)
                except OSError as exc:  # counted only once logged: wait_applied must not wait for it
                    log.error("ingest: the export of agent %s could not be logged: %s", agent_id, exc)
                    raise Overloaded("the control plane could not write its ingest log; retry later",
                                     details={"retry_after_s": 1}) from exc  # fmt: skip
                job.logged = durable
            else:
                durable = job.applied = Future()
            self._submitted = job.seq
            self._queue.append(job)
        self._wake.put(None)
        return Submitted(result, durable)

    def ingest(self, agent_id: str, message: ExportMetricsServiceRequest) -> IngestResult:
        """Submit an export and wait until it is durable (logged, or without a log committed)."""
        submitted = self.submit(agent_id, message)
        submitted.durable.result()
        return submitted.result

    @property
    def accepted_seq(self) -> int:
        """Exports submitted so far by this process (`wait_applied` takes one of these)."""
        return self._submitted

    def wait_applied(self, seq: int | None = None, timeout: float = 2.0) -> bool:
        """Wait until every export up to submission `seq` (None: all so far) is applied; False on timeout."""
        target = self._submitted if seq is None else seq
        with self._queued:
            return self._queued.wait_for(lambda: self._applied >= target, timeout)

    def stats(self) -> dict[str, float]:
        """Gauges and counters: what is queued and how old, the log's size, what was applied, failed, replayed."""
        with self._queued:
            queued = len(self._applying) + len(self._queue)
            first = self._applying or self._queue
            oldest = time.monotonic() - first[0].at if first else 0.0
            out: dict[str, float] = {"queued_exports": queued, "oldest_unapplied_s": oldest,
                                     "submitted_exports": self._submitted, "stale_batches": self.applier.stale,
                                     **self._counts}  # fmt: skip
        if self.log is not None:
            out["log_bytes"] = self.log.bytes
            out["log_cut_records"] = self.log.cut_records
        return out

    # ---- applying -------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.get()  # a token per submission (put after its job), and one at close
                with contextlib.suppress(queue.Empty):
                    while True:
                        self._wake.get_nowait()
                continue
            if self.log is not None and len(self._queue) < _GATHER_MIN and not self._closing:
                # Mode logged: nobody waits for this batch's commit, so a few milliseconds more make it bigger (fewer
                # transactions, more rows merged) and leave the event loop the GIL meanwhile.
                time.sleep(_GATHER_S)
            batch: list[Job] = []
            with self._queued:
                while self._queue and len(batch) < _BATCH:
                    batch.append(self._queue.popleft())
                self._applying = batch
            try:
                self._drop_unlogged(batch)
                self._apply(batch)
            except Exception as exc:  # a bug, not the database (`_apply` handles that): the batch fails, not the thread
                log.error("ingest: the applier failed on a batch of %d exports", len(batch), exc_info=True)
                for job in batch:
                    if job.applied is not None and not job.applied.done():
                        job.applied.set_exception(exc)
                self._counts["failed"] += len(batch)
            except BaseException:
                log.exception("ingest applier stopped")
                raise
            finally:
                with self._queued:
                    self._applied = max(self._applied, batch[-1].seq)
                    self._applying = []
                    self._queued.notify_all()

    @staticmethod
    def _drop_unlogged(batch: list[Job]) -> None:
        """Wait until each job's log record is durable; a job whose write or fsync failed was answered 503 (the agent
        sends it again): it is not applied (its folded export is dropped; its place in the log order stays)."""
        for job in batch:
            if job.logged is None:
                continue
            error = job.logged.exception()  # the syncer completes every future (written and fsynced, or failed)
            if error is not None:
                job.folded = None
            job.logged = None

    def _apply(self, batch: list[Job]) -> None:
        """Apply a batch in one transaction; if that fails, each export alone, so a bad export fails alone. When
        the database fails (every export alone fails with an operational error), logged exports are retried."""
        backoff = 0.05
        while True:
            try:
                durable = self._transaction(batch)
                self._finish(batch, {}, durable)
                return
            except Exception as exc:
                first = exc
            failed: dict[int, BaseException] = {}
            durable = False
            rest: list[Job] | None = None  # from a logged export the database (not the export) refused: retried
            if len(batch) == 1:
                failed[0] = first
            else:
                for i, job in enumerate(batch):
                    try:
                        durable = self._transaction([job])
                    except Exception as alone:
                        if job.log_seq is not None and _operational(alone) and not self._closing:
                            # The exports after it must not move the log's applied position past it: stop here.
                            rest, first = batch[i:], alone
                            break
                        failed[i] = alone
            if rest is not None:  # finish the exports before it; retry from it, as when the database is down
                if len(rest) < len(batch):
                    done = batch[: len(batch) - len(rest)]
                    self._finish(done, {id(batch[i]): e for i, e in failed.items()}, durable)
                    batch = rest
                log.warning("ingest: the database refused an export (%s); retrying in %.2f s", first, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            down = len(failed) == len(batch) and all(_operational(e) for e in failed.values())
            if down and batch[0].log_seq is not None and not self._closing:
                log.warning("ingest: the database refused a batch (%s); retrying in %.2f s", first, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for i, error in failed.items():
                job = batch[i]
                agent = job.folded.agent_id if job.folded is not None else "?"
                log.error("ingest: an export of agent %s could not be stored (log seq %s): %s", agent, job.log_seq,
                          error)  # fmt: skip
            self._finish(batch, {id(batch[i]): e for i, e in failed.items()}, durable)
            return

    def _transaction(self, jobs: list[Job]) -> bool:
        """Apply `jobs` in one transaction (again after a deadlock); whether the commit was durable."""
        durable = self._durable(jobs)
        for attempt in range(3):
            try:
                self.applier.apply(jobs, durable)
                return durable
            except Exception as exc:
                if attempt == 2 or not _rolled_back(exc):  # a deadlock or serialization failure: try again
                    raise
        raise AssertionError("unreachable")

    def _durable(self, jobs: list[Job]) -> bool:
        """Whether a batch's commit must survive a power loss: without a log (the answer waits for it), for records
        of another slot (deleted next), and before this log deletes a segment (its records are then only in the
        database), and in the replay at start. Otherwise the log, kept, covers a commit lost with the power."""
        own = self.log
        if own is None or not self._thread or any(job.folded is not None and job.log_id != own.log_id for job in jobs):
            return True
        last = max((job.log_seq for job in jobs if job.log_seq is not None), default=None)
        return own.fsync and last is not None and own.deletable(last)

    def _finish(self, jobs: list[Job], errors: dict[int, BaseException], durable: bool) -> None:
        """Complete the jobs' futures (`errors`: by id of the job) and the counters; the log drops what is applied."""
        last = None
        for job in jobs:
            error = errors.get(id(job))
            self._counts["failed" if error else "applied"] += 1
            if job.applied is not None and not job.applied.done():
                if error is None:
                    job.applied.set_result(None)
                else:
                    job.applied.set_exception(error)
            if error is None and job.log_seq is not None and self.log is not None and job.log_id == self.log.log_id:
                last = job.log_seq if last is None else max(last, job.log_seq)
        self._counts["batches"] += 1
        if last is not None and self.log is not None:
            self.log.applied(last, durable)

    # ---- folding --------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_sender(agent_id: str, message: ExportMetricsServiceRequest) -> None:
        for resource_metrics in message.resource_metrics:
            sender = _attributes(resource_metrics.resource.attributes).get("service.instance.id")
            if sender != agent_id:
                raise Forbidden(f"resource service.instance.id '{sender}' is not this token's agent '{agent_id}'")

    def _series(self, metric: str, dp: Any, bounds: tuple[float, ...] | None) -> _Series:
        """The series of a point (a histogram's on the bounds it is stored on: its rows are keyed by them too)."""
        key: tuple[Any, ...]
        if bounds is None:
            # A number point's encoding less its leading 8-byte fields (times, value) is its attributes (and flags)
            # as SDKs write them, field by field in order: one call instead of one per attribute. It holds every
            # attribute whatever the order, so it determines them; another order only misses the cache.
            data = dp.SerializeToString()
            i, end = 0, len(data)
            while i < end and data[i] in _FIXED64_BEFORE_ATTRIBUTES:
                i += 9
            key = (metric, data[i:])
        else:
            key = (metric, tuple([kv.SerializeToString() for kv in dp.attributes]), bounds)
        found = self._series_cache.get(key)
        if found is None:
            attributes = current_names(_attributes(dp.attributes))
            series = series_key(metric, attributes)
            found = _Series(series, series if bounds is None else layout_key(series, bounds), attributes,
                            dumps(attributes))  # fmt: skip
            if len(self._series_cache) >= _SERIES_CACHE_SIZE:
                self._series_cache.clear()
            self._series_cache[key] = found
        return found

    def _tenant(self, tenants: set[str], tenant: Any, found: _Series, metric: str, fit: Fit | None) -> _Series:
        """A point's series with a tenant this agent has not sent before (under the lock): kept as it came while
        the agent's distinct tenants stay within the cap and it is a tenant name, else the series of tenant
        `other`."""
        room = len(tenants) < self.max_tenants_per_agent + len(_ALWAYS_TENANTS)
        if room and isinstance(tenant, str) and _TENANT_NAME.fullmatch(tenant):
            tenants.add(tenant)
            return found
        other = self._as_other.get(found.row)
        if other is None:
            attributes = {**found.attributes, ATTR_TENANT: OTHER_TENANT}
            series = series_key(metric, attributes)
            other = _Series(series, series if fit is None else layout_key(series, fit.bounds), attributes,
                            dumps(attributes))  # fmt: skip
            if len(self._as_other) >= _SERIES_CACHE_SIZE:
                self._as_other.clear()
            self._as_other[found.row] = other
        return other

    def _fold(self, agent_id: str, message: ExportMetricsServiceRequest) -> tuple[IngestResult, Folded | None,
                                                                                   list[str]]:  # fmt: skip
        """Check every point and fold the accepted ones (gauges and delta points added up per row and minute,
        cumulative points kept for the applier); the answer, the folded export (None: nothing accepted) and the
        refusal reasons not logged yet for this agent."""
        folded = Folded(agent_id)
        meta, rows, points = folded.meta, folded.rows, folded.points
        accepted = rejected = 0
        reasons: set[str] = set()
        with self._lock:
            known, tenants = self._known[agent_id], self._tenants[agent_id]
            for resource_metrics in message.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        kind = metric.WhichOneof("data")
                        if kind not in ("sum", "gauge", "histogram"):
                            points_n = len(getattr(metric, kind).data_points) if kind else 0
                            rejected += points_n
                            reasons.add(f"metric type {kind} is not supported ({metric.name})")
                            continue
                        data = getattr(metric, kind)
                        cumulative = getattr(data, "aggregation_temporality", 0) == CUMULATIVE
                        histogram = kind == "histogram"
                        name = current_metric(metric.name)
                        for dp in data.data_points:
                            at, start = dp.time_unix_nano, dp.start_time_unix_nano
                            fit = None
                            if histogram:
                                bounds = tuple(dp.explicit_bounds)
                                count, total = dp.count, dp.sum
                                problem = _histogram_problem(bounds, len(dp.bucket_counts), count, total, self._checked)
                            else:
                                total = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                                problem = None if math.isfinite(total) else "a non-finite value"
                            if problem is None and (at > _MAX_NS or start > _MAX_NS):
                                problem = "a timestamp after the year 2262"
                            if problem is not None:
                                rejected += 1
                                reasons.add(f"{problem} ({metric.name})")
                                continue
                            if histogram:
                                fit = self.layouts.fit(name, metric.unit, bounds)
                                if fit.problem is not None:
                                    rejected += 1
                                    reasons.add(fit.problem)
                                    continue
                            found = stream = self._series(name, dp, None if fit is None else fit.bounds)
                            tenant = found.attributes.get(ATTR_TENANT)
                            if tenant is not None and (not isinstance(tenant, str) or tenant not in tenants):
                                found = self._tenant(tenants, tenant, found, name, fit)
                            series = found.series
                            if series not in known and len(known) >= self.max_series_per_agent:
                                rejected += 1
                                reasons.add(f"cardinality limit of {self.max_series_per_agent} series per agent")
                                continue
                            known.add(series)
                            accepted += 1
                            row = found.row
                            if row not in meta:
                                meta[row] = (name, found.attributes_json, kind, self._bounds(fit))
                            minute = at // 1_000_000_000
                            minute -= minute % 60
                            if histogram:
                                assert fit is not None
                                buckets = fit.buckets(dp.bucket_counts)
                            else:
                                count, total, buckets = 0, float(total), ()
                            if cumulative:
                                # A cumulative stream's deltas are its own (tenants folded into `other` keep theirs)
                                points.append((stream.row, row, minute, start, at, count, total, buckets, histogram))
                                continue
                            roll = rows.get((row, minute))
                            if kind == "gauge":
                                if roll is None:
                                    rows[(row, minute)] = [1, total, [], total, total, total]
                                else:
                                    merge(roll, [1, total, [], total, total, total], True)
                            elif roll is None:
                                rows[(row, minute)] = [count, total, list(buckets), None, None, None]
                            else:
                                merge(roll, [count, total, buckets, None, None, None], False)
            said = sorted(reasons)[:_REASONS_SAID]  # each refused layout is a reason: an export may bring many
            more = f"; and {len(reasons) - len(said)} more" if len(reasons) > len(said) else ""
            fresh = self._not_yet_logged(agent_id, said)
        result = IngestResult(accepted, rejected, "; ".join(said) + more)
        return result, (folded if accepted else None), fresh

    def _bounds(self, fit: Fit | None) -> str:
        if fit is None or not fit.bounds:
            return "[]"
        found = self._bounds_json.get(fit.bounds)
        if found is None:
            if len(self._bounds_json) >= _SERIES_CACHE_SIZE:
                self._bounds_json.clear()
            found = self._bounds_json[fit.bounds] = dumps(list(fit.bounds))
        return found

    def _not_yet_logged(self, agent_id: str, reasons: list[str]) -> list[str]:
        """The reasons not logged for this agent yet (remembered up to a bound, then each is logged again)."""
        fresh = sorted(reason for reason in reasons if (agent_id, reason) not in self._logged)
        if len(self._logged) + len(fresh) > _LOGGED_KEPT:
            self._logged.clear()
        self._logged.update((agent_id, reason) for reason in fresh)
        return fresh


def _operational(exc: BaseException) -> bool:
    """The database failed (unreachable, locked, out of space), not the data: PEP 249's OperationalError and
    InterfaceError, as the driver or SQLAlchemy raise them."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"OperationalError", "InterfaceError"})


def _rolled_back(exc: BaseException) -> bool:
    """PostgreSQL gave up the transaction for another (a deadlock, a serialization failure): trying again works."""
    return bool({cls.__name__ for cls in type(exc).__mro__} & {"TransactionRollback", "DeadlockDetected"})


def _histogram_problem(bounds: tuple[float, ...], counts: int, count: int, total: float,
                       checked: dict[tuple[float, ...], bool]) -> str | None:  # fmt: skip
    """Why a histogram point cannot be stored faithfully (refused through partial_success), or None. `checked`:
    bounds already judged (finite and increasing or not)."""
    if counts and counts != len(bounds) + 1:
        return f"{counts} bucket counts for {len(bounds)} explicit bounds (need one more)"
    good = checked.get(bounds)
    if good is None:
        good = all(math.isfinite(b) for b in bounds) and all(a < b for a, b in itertools.pairwise(bounds))
        if len(checked) >= _SERIES_CACHE_SIZE:
            checked.clear()
        checked[bounds] = good
    if not good:
        return "explicit bounds that are not finite and increasing"
    if not math.isfinite(total):
        return "a non-finite sum"
    if count > _MAX_NS:
        return "a count beyond 2^63"
    return None


__all__ = ["IngestResult", "Ingestor", "Submitted", "decode", "prune", "series_key"]
