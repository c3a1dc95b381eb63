"""The control plane's tables as a typed SQLAlchemy 2.0 ORM; the schema itself changes only through Alembic."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite drops the zone; this puts it back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime stored; use timezone-aware UTC")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


JSONType = JSON().with_variant(JSONB(), "postgresql")
# Events use an integer id that only grows; SQLite needs INTEGER PRIMARY KEY to autoincrement.
EventId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSONType, list[Any]: JSONType}


class Resource(Base):
    """Operator-edited rows: an id, a unique name, and a version that `If-Match` checks."""

    __abstract__ = True

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    # Every ORM update runs `UPDATE ... WHERE version = <read>` and bumps it: of two concurrent writers with
    # the same If-Match, the second matches no row and gets 412 instead of silently overwriting the first.
    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return {"version_id_col": cls.version}


class Agent(Resource):
    __tablename__ = "agents"

    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    device_class: Mapped[str] = mapped_column(String(32))
    token_hash: Mapped[str] = mapped_column(String(64))
    last_seen: Mapped[datetime | None] = mapped_column(default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    __mapper_args__ = {"version_id_col": version}


class Slo(Resource):
    __tablename__ = "slos"

    description: Mapped[str] = mapped_column(Text, default="")
    selector: Mapped[dict[str, Any]] = mapped_column()
    sli_kind: Mapped[str] = mapped_column(String(16))
    threshold_ms: Mapped[float | None] = mapped_column(Float, default=None)
    objective: Mapped[float] = mapped_column(Float)
    window: Mapped[int] = mapped_column(Integer)  # seconds
    alert_windows: Mapped[list[Any]] = mapped_column(default=list)


class Rule(Resource):
    __tablename__ = "rules"

    description: Mapped[str] = mapped_column(Text, default="")
    selector: Mapped[dict[str, Any]] = mapped_column()
    condition: Mapped[dict[str, Any]] = mapped_column()
    action: Mapped[dict[str, Any]] = mapped_column()
    hysteresis: Mapped[dict[str, Any]] = mapped_column(default=dict)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False)


class Backend(Resource):
    __tablename__ = "backends"

    url: Mapped[str] = mapped_column(String(2048))
    protocol: Mapped[str] = mapped_column(String(16), default="v2")  # v2 | openai
    models: Mapped[list[Any]] = mapped_column(default=list)
    model_map: Mapped[dict[str, Any]] = mapped_column(default=dict)  # openai: edge model -> the backend's name
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_concurrency: Mapped[int] = mapped_column(Integer, default=64)
    timeout_ms: Mapped[int] = mapped_column(Integer, default=10_000)
    binary_tensors: Mapped[bool] = mapped_column(Boolean, default=True)
    # {tenant: the most of this backend's in-flight requests (a fraction) that tenant may hold}; none named: no cap.
    tenant_share: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Sent to the backend as `Authorization`; write-only through the API, never returned or logged.
    auth_header: Mapped[str | None] = mapped_column(Text, default=None)

    @property
    def auth_header_set(self) -> bool:
        return bool(self.auth_header)


class Tenant(Resource):
    """An application sharing the agents its selector picks: a weight, quotas and a priority ceiling (the contract's
    `TenantLimits`); its tokens are `TenantToken` rows. The policy document of each agent it selects carries it."""

    __tablename__ = "tenants"

    description: Mapped[str] = mapped_column(Text, default="")
    selector: Mapped[dict[str, Any]] = mapped_column(default=dict)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_in_flight: Mapped[int | None] = mapped_column(Integer, default=None)
    rate_rps: Mapped[float | None] = mapped_column(Float, default=None)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    max_streams: Mapped[int | None] = mapped_column(Integer, default=None)
    max_priority: Mapped[int | None] = mapped_column(Integer, default=None)


class TenantToken(Base):
    """One bearer token of a tenant, kept as its SHA-256 digest only (the secret is shown once, when made)."""

    __tablename__ = "tenant_tokens"
    __table_args__ = (Index("ix_tenant_tokens_tenant_id", "tenant_id"),)

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(16), ForeignKey("tenants.id", ondelete="CASCADE"))
    label: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_kind_id", "kind", "id"),
        Index("ix_events_agent_id_id", "agent_id", "id"),
        Index("ix_events_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(64))
    actor: Mapped[str] = mapped_column(String(160))
    subject_type: Mapped[str] = mapped_column(String(32))
    subject_id: Mapped[str | None] = mapped_column(String(64), default=None)
    agent_id: Mapped[str | None] = mapped_column(String(16), default=None)
    rule_id: Mapped[str | None] = mapped_column(String(16), default=None)
    reason: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class MetricRollup(Base):
    """One series' data in one minute, summed over the agent's exports (deltas: cumulative streams converted)."""

    __tablename__ = "metric_rollups"
    __table_args__ = (
        UniqueConstraint("agent_id", "series", "minute", name="uq_metric_rollups_series_minute"),
        Index("ix_metric_rollups_agent_metric_minute", "agent_id", "metric", "minute"),
        Index("ix_metric_rollups_metric_minute", "metric", "minute"),
    )

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(16))
    metric: Mapped[str] = mapped_column(String(255))
    series: Mapped[str] = mapped_column(String(64))  # sha256 of metric + attributes
    attributes: Mapped[dict[str, Any]] = mapped_column(default=dict)
    minute: Mapped[datetime] = mapped_column()
    kind: Mapped[str] = mapped_column(String(16))  # sum | histogram | gauge
    count: Mapped[int] = mapped_column(BigInteger, default=0)  # histogram observations, or gauge samples
    total: Mapped[float] = mapped_column(Float, default=0.0)  # sum increase, histogram sum, or sum of gauge samples
    buckets: Mapped[list[Any]] = mapped_column(default=list)
    bounds: Mapped[list[Any]] = mapped_column(default=list)
    last: Mapped[float | None] = mapped_column(Float, default=None)  # gauges
    min: Mapped[float | None] = mapped_column(Float, default=None)
    max: Mapped[float | None] = mapped_column(Float, default=None)


class Policy(Base):
    """The policy document last published for one agent (what `GET /api/v1/agents/{id}/policy` serves)."""

    __tablename__ = "policies"

    agent_id: Mapped[str] = mapped_column(String(16), ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    etag: Mapped[str] = mapped_column(String(80))
    document: Mapped[dict[str, Any]] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class RuleState(Base):
    """Where one rule stands for one agent (the control loop's memory across cycles and replicas)."""

    __tablename__ = "rule_states"

    rule_id: Mapped[str] = mapped_column(String(16), ForeignKey("rules.id", ondelete="CASCADE"), primary_key=True)
    agent_id: Mapped[str] = mapped_column(String(16), ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))  # ok | pending | firing | recovering
    since: Mapped[datetime] = mapped_column()
    fired_at: Mapped[datetime | None] = mapped_column(default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)
    flaps: Mapped[list[Any]] = mapped_column(default=list)  # when it recovered, within the last hour
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the numbers of the last transition


class IngestStream(Base):
    """Where one cumulative OTLP stream of an agent stands: the last reading of its newest run (`start`; `earlier`:
    the older runs still kept, JSON `[[start, time, count, total, buckets], ...]`). Read and written in the
    transaction that adds the stream's deltas to the rollups, so every replica converts against the same state.
    `start` NULL: a row made only to be locked (PostgreSQL), no reading yet. An applier may keep the rows it wrote in
    memory: its next write of one is conditional on `version` being what it wrote, else it reads them again."""

    __tablename__ = "ingest_streams"

    agent_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    stream: Mapped[str] = mapped_column(String(64), primary_key=True)  # the series as sent (with its layout)
    start: Mapped[int | None] = mapped_column(BigInteger, default=None)  # start_time_unix_nano
    time: Mapped[int | None] = mapped_column(BigInteger, default=None)  # time_unix_nano of the last point
    count: Mapped[int] = mapped_column(BigInteger, default=0)  # histograms
    total: Mapped[float] = mapped_column(Float, default=0.0)  # a sum's value, a histogram's sum
    buckets: Mapped[str] = mapped_column(Text, default="[]")  # JSON list
    earlier: Mapped[str] = mapped_column(Text, default="[]")
    version: Mapped[int] = mapped_column(BigInteger, default=0)  # bumped by every write (an applier's cache checks it)


class IngestLogPosition(Base):
    """How far one ingest log (a process's slot, by the id in its folder) has been applied to the rollups: written
    in the same transaction as the rollups of its records, so a replay applies each record exactly once."""

    __tablename__ = "ingest_log_positions"

    log_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    applied_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class IngestHorizon(Base):
    """One row: since when (ns) stream state is kept in `ingest_streams`. A run begun before it with no state may
    have been counted by a control plane before 0008 (which kept the state in memory): its first point is a
    baseline. 0 on a database that had no rollups when the table was made."""

    __tablename__ = "ingest_horizon"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    since_ns: Mapped[int] = mapped_column(BigInteger)
