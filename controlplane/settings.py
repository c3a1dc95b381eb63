"""The control plane's settings: one validated `Settings` per process, read from `SPILLWAY_*` variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway.contract.names import DEFAULT_LATENCY_BUCKETS_MS


class Settings(BaseSettings):
    """Every knob of the control plane; nonsense is refused at start with the variable's name."""

    model_config = SettingsConfigDict(env_prefix="SPILLWAY_", extra="ignore")

    env: Literal["development", "production"] = Field(
        default="development",
        description="`production` refuses unsafe defaults (e.g. binding beyond loopback without TLS).",
    )
    database_url: str = Field(
        default="sqlite:///./spillway.db",
        description="SQLAlchemy URL: a SQLite file or `postgresql://user:pass@host/db`.",
    )
    host: str = Field(default="127.0.0.1", description="Address the control plane listens on.")
    port: int = Field(default=8400, ge=1, le=65535, description="Port the control plane listens on.")
    migrate_on_start: bool = Field(
        default=True, description="`serve` migrates the database to the newest schema (Alembic head) at start."
    )
    max_body_bytes: int = Field(
        default=1 << 20, gt=0, description="Largest request body the REST API accepts (413 beyond)."
    )
    ingest_max_body_bytes: int = Field(
        default=16 << 20, gt=0, description="Largest OTLP metrics export accepted (also after gzip inflation)."
    )
    max_series_per_agent: int = Field(
        default=10_000,
        gt=0,
        description="Series one agent may report (cardinality); more are refused through `partial_success`.",
    )
    ingest_max_concurrent: int = Field(
        default=8, gt=0, description="OTLP exports processed at once; beyond it 503 with Retry-After (overload)."
    )
    ingest_ack: Literal["logged", "applied"] = Field(
        default="logged",
        description="When an OTLP export is answered: `logged` once it is in the ingest log (replayed after a "
        "crash; rollups written just after), `applied` once its rollups are committed (slower; no log).",
    )
    ingest_log_dir: str | None = Field(
        default=None,
        description="Folder of the ingest log (`logged`); default: beside a SQLite file, else "
        "$XDG_STATE_HOME/spillway/ingest-log. One subfolder per database; each process holds one slot of it. Keep it "
        "on a local persistent disk.",
    )
    ingest_log_fsync: bool = Field(
        default=True,
        description="fsync the ingest log before answering (group commit): an answered export survives a power "
        "loss, not only a crash of the process.",
    )
    agent_auth_cache_s: float = Field(
        default=5.0, ge=0, le=300,
        description="How long an agent token checked on the ingest and policy paths is trusted without the "
        "database (a revoked token works at most this long); 0: checked on every request.",
    )  # fmt: skip
    workers: int = Field(
        default=1, ge=1, le=64,
        description="Control-plane processes serving one port (SO_REUSEPORT); more than one needs PostgreSQL.",
    )  # fmt: skip
    retention_days: float = Field(
        default=35.0,
        gt=0,
        description="Minute rollups older than this are deleted (at start, then hourly).",
    )
    evaluation_interval_s: float = Field(
        default=5.0, ge=0, description="SLO status is recomputed at most this often (seconds); 0: on every request."
    )
    latency_buckets_ms: list[float] = Field(
        default_factory=lambda: list(DEFAULT_LATENCY_BUCKETS_MS), min_length=1,
        description="The agents' latency histogram boundaries (JSON list); a latency SLO's threshold must be one.",
    )  # fmt: skip
    control_loop_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="How often the control loop evaluates the rules (seconds); 0: never (on this replica).",
    )
    policy_poll_interval_s: float = Field(
        default=5.0,
        ge=0.5,
        le=3600,
        description="How often agents poll their policy (seconds; sent to them in the policy).",
    )
    agent_export_interval_s: float = Field(
        default=5.0,
        ge=0.5,
        le=3600,
        description="How often agents export metrics (seconds; sent to them in the policy).",
    )
    stale_after_s: float = Field(
        default=15.0,
        gt=0,
        description="An agent not seen for this long (seconds) counts as `stale` (three export intervals).",
    )
    tls_certfile: str | None = Field(default=None, description="PEM certificate: set with the key file to serve HTTPS.")
    tls_keyfile: str | None = Field(default=None, description="PEM private key for `tls_certfile`.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Server log level: `debug`, `info`, `warning` or `error`."
    )
    # The overflow gateway (docs/overflow/gateway.md).
    gateway_refresh_s: float = Field(
        default=2.0,
        gt=0,
        le=3600,
        description="How often the overflow gateway reloads the backends from the database (seconds; at once after a "
        "change through this process's API).",
    )
    gateway_health_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often each backend's `/v2/health/ready` and `/v2/models/{m}/ready` are checked (active "
        "checks, seconds).",
    )
    gateway_health_timeout_s: float = Field(
        default=1.0, gt=0, le=60, description="How long one readiness check may take (seconds; at most the interval)."
    )
    gateway_unhealthy_threshold: int = Field(
        default=2,
        ge=1,
        le=100,
        description="Failed readiness checks in a row that take a backend's model out (unhealthy).",
    )
    gateway_healthy_threshold: int = Field(
        default=1, ge=1, le=100, description="Passed readiness checks in a row that put it back (healthy again)."
    )
    gateway_consecutive_failures: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="5xx answers or connect/reset/timeout failures in a row that eject a backend.",
    )
    gateway_base_ejection_s: float = Field(
        default=30.0,
        gt=0,
        le=86400,
        description="An ejection lasts this long (seconds) times the backend's ejection count.",
    )
    gateway_max_ejection_s: float = Field(default=300.0, gt=0, le=86400, description="The longest one ejection lasts.")
    gateway_outlier_interval_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="Each such interval back in the pool takes one off a backend's ejection multiplier (seconds).",
    )
    gateway_max_ejection_percent: float = Field(
        default=10.0, ge=0, le=100, description="Most of a model's backends ejected at once (one always may be)."
    )
    gateway_retry_budget_percent: float = Field(
        default=20.0,
        ge=0,
        le=100,
        description="Retries in flight allowed, as a share of the gateway's requests in flight.",
    )
    gateway_min_retry_concurrency: int = Field(
        default=3, ge=0, le=100_000, description="Retries in flight always allowed, whatever the budget says."
    )
    gateway_auth_ttl_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long a checked agent token is trusted without the database (seconds; a deleted agent works "
        "that much longer).",
    )
    gateway_max_connections: int = Field(
        default=1024, ge=1, le=100_000, description="Connections the gateway keeps open to all backends together."
    )

    @field_validator("database_url")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        """`SPILLWAY_DATABASE_URL` is a `sqlite://` or `postgresql://` URL."""
        if not value.startswith(("sqlite", "postgresql", "postgres://")):
            raise ValueError("SPILLWAY_DATABASE_URL must be a sqlite:// or postgresql:// URL")
        return value

    @model_validator(mode="after")
    def _ejection_bounds(self) -> Settings:
        """`SPILLWAY_GATEWAY_MAX_EJECTION_S` is at least `SPILLWAY_GATEWAY_BASE_EJECTION_S`."""
        if self.gateway_max_ejection_s < self.gateway_base_ejection_s:
            raise ValueError(
                "SPILLWAY_GATEWAY_MAX_EJECTION_S must be at least SPILLWAY_GATEWAY_BASE_EJECTION_S "
                f"({self.gateway_max_ejection_s:g} < {self.gateway_base_ejection_s:g})"
            )
        return self

    @model_validator(mode="after")
    def _workers_need_postgres(self) -> Settings:
        """`SPILLWAY_WORKERS` above 1 needs PostgreSQL: a SQLite file has one writer, and each process would run
        the control loop."""
        if self.workers > 1 and self.database_url.startswith("sqlite"):
            raise ValueError(
                f"SPILLWAY_WORKERS={self.workers} needs PostgreSQL: a SQLite file has one writer and each process "
                "would run the control loop (use one worker, or SPILLWAY_DATABASE_URL=postgresql://...)"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        """`SPILLWAY_TLS_CERTFILE` and `SPILLWAY_TLS_KEYFILE` are set together; with `SPILLWAY_ENV=production`, a
        `SPILLWAY_HOST` beyond loopback needs them (or TLS terminated in front, and the control plane bound to
        loopback)."""
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("SPILLWAY_TLS_CERTFILE and SPILLWAY_TLS_KEYFILE must be set together")
        loopback = self.host in ("127.0.0.1", "localhost", "::1")
        if self.env == "production" and not loopback and self.tls_certfile is None:
            raise ValueError(
                "SPILLWAY_HOST is beyond loopback in production without TLS: "
                "set SPILLWAY_TLS_CERTFILE/SPILLWAY_TLS_KEYFILE or terminate TLS in front and bind to loopback"
            )
        return self
