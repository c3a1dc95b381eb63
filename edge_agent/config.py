"""The agent's configuration: a YAML file, with command-line options on top; nonsense is refused at start."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from edge_agent.telemetry.metrics import TelemetrySettings
from spillway.contract.names import DEFAULT_LATENCY_BUCKETS_MS
from spillway.contract.tenants import (
    MAX_TENANTS,
    NAME_PATTERN,
    RESERVED_NAMES,
    Tenant,
    TenantLimits,
    check_unique,
    hash_token,
)


class BreakerSettings(BaseModel):
    """The overflow circuit breaker, in Sentinel's terms (edge_agent/overflow/breaker.py)."""

    model_config = ConfigDict(extra="forbid")

    slow_rt_ms: float = Field(default=1000.0, gt=0, description="an overflowed request slower than this is slow")
    slow_ratio: float | None = Field(default=0.5, gt=0, le=1, description="open above this share slow (null: never)")
    error_ratio: float | None = Field(default=0.5, gt=0, le=1, description="open above this share failed (null: never)")
    min_requests: int = Field(default=5, ge=1, description="judge no window with fewer requests than this")
    stat_interval_s: float = Field(default=10.0, gt=0, description="the sliding window the ratios are over")
    open_s: float = Field(default=5.0, gt=0, description="how long an open breaker refuses before one probe")


class OverflowSettings(BaseModel):
    """Where the requests this agent will not serve go (the control plane's gateway), and what answers when the
    cloud cannot: the fallback chain cache -> default outputs -> async queue -> 503."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False, description="overflow predicted deadline misses without a policy saying so (a policy wins)"
    )
    fraction: float = Field(default=0.0, ge=0, le=1, description="with enabled: overflow this share of the rest too")
    at_or_below: int | None = Field(
        default=None, ge=1, le=64, description="with enabled: overflow every request at this priority level or lower"
    )
    gateway: str | None = Field(default=None, description="gateway base URL; default: the control plane")
    max_in_flight: int = Field(default=256, ge=1, le=65536, description="requests overflowing at once, at most")
    default_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="for requests without a deadline")
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    default_outputs: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict, description="model -> V2 output tensors answered as fallback_default"
    )
    cache_ttl_s: float | None = Field(
        default=300.0, gt=0, description="answers older than this are not served as fallback_cache (None: no limit)"
    )


class AsyncJobSettings(BaseModel):
    """The async queue: requests to these models that neither the device nor the cloud can serve now are accepted
    (202 and a job id), kept on disk, run when the device has room, and fetched at /spillway/v1/jobs/{id}."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list, description="models whose requests may be answered later")
    max_jobs: int = Field(default=1000, ge=1, le=1_000_000, description="queued and running jobs, at most")
    ttl_s: float = Field(default=3600.0, gt=0, description="a job not run within this long expires")
    drain_below: float = Field(
        default=0.5, gt=0, le=4, description="run jobs while the model's utilisation is below this"
    )


class GenerationSettings(BaseModel):
    """How the agent serves generative models; a model's config (`parameters`, `dynamic_batching`) overrides them."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=8, ge=1, le=1024, description="sequences running at once")
    max_num_batched_tokens: int = Field(default=512, ge=1, description="tokens one step computes")
    long_prefill_threshold: int = Field(default=128, ge=1, description="the largest prompt chunk of one step")
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV-cache block")
    kv_budget_bytes: int | None = Field(default=None, gt=0, description="the KV cache's bytes (default: a share)")
    kv_budget_share: float = Field(default=0.25, gt=0, le=1, description="share of free memory for the KV cache")
    levels: int = Field(default=3, ge=1, le=16, description="priority levels (1 the highest)")
    default_level: int = Field(default=2, ge=1, description="the level of a request without a priority")
    default_max_tokens: int = Field(default=256, ge=1, description="max_tokens of a chat request without one")
    fallback_text: str | None = Field(
        default=None, min_length=1, max_length=65536,
        description="the answer of a fallback `default` (policy mode default without default_text, overflow failed)",
    )  # fmt: skip
    queue_policy: Literal["priority", "fcfs", "shortest_prompt_first"] = Field(
        default="priority", description="order of waiting requests: by level, by arrival, or shortest prompt first"
    )
    aging_s: float | None = Field(default=None, gt=0, description="a request waiting this long goes first")

    @model_validator(mode="after")
    def _levels_fit(self) -> GenerationSettings:
        if self.default_level > self.levels:
            raise ValueError(f"default_level {self.default_level} is not one of the {self.levels} levels")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs (a decode token for each)")
        return self


class TenantConfig(TenantLimits):
    """One tenant as the agent config names it: its token in clear (as the operator's own `token`), or digests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="lower case letters, digits, '_', '.', '-'")
    token: SecretStr | list[SecretStr] | None = Field(
        default=None, description="the tenant's bearer token(s) for the agent's APIs"
    )
    token_sha256: list[str] = Field(
        default_factory=list, max_length=16, description="or their SHA-256 hex digests (a file that holds no secret)"
    )

    @model_validator(mode="after")
    def _has_a_token(self) -> TenantConfig:
        if self.name in RESERVED_NAMES:
            raise ValueError(f"tenant name '{self.name}' is reserved")
        if self.token is None and not self.token_sha256:
            raise ValueError(f"tenant '{self.name}' needs a token (or token_sha256)")
        return self

    def tenant(self) -> Tenant:
        """The contract's form: the tokens hashed (the clear ones are not kept beyond this)."""
        tokens = [] if self.token is None else self.token if isinstance(self.token, list) else [self.token]
        digests = [hash_token(t.get_secret_value()) for t in tokens] + list(self.token_sha256)
        limits = self.model_dump(exclude={"name", "token", "token_sha256"})
        return Tenant(name=self.name, token_sha256=list(dict.fromkeys(digests)), **limits)


class OtlpEndpoint(BaseModel):
    """One OTLP metrics destination with its own headers (an API key: never logged) and protocol."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(min_length=1, description="the full metrics URL (http/protobuf) or host:port URL (grpc)")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export")
    protocol: Literal["http/protobuf", "grpc"] = Field(
        default="http/protobuf", description="grpc needs spillway[otlp-grpc]"
    )


class AgentConfig(BaseModel):
    """Everything `spillway agent serve` needs; field names are the YAML keys."""

    model_config = ConfigDict(extra="forbid")

    model_repository: Path
    host: str = "127.0.0.1"
    # Triton's ports: HTTP 8000, gRPC 8001 (Triton's metrics port 8002 is not used: /metrics is on the HTTP port).
    # Until 0.2 the HTTP default was 8001; an agent whose config sets no `port` still answers HTTP/1.1 there for one
    # release (the legacy listener tells gRPC from HTTP/1.1 by the connection's first bytes).
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (V2, OpenAI, /metrics)")
    grpc_port: int | None = Field(
        default=8001, ge=0, le=65535, description="V2 gRPC port (needs spillway[grpc]); null: no gRPC"
    )
    token: SecretStr | None = Field(
        default=None, description="bearer token the inference API requires: the operator's (the `default` tenant)"
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, max_length=MAX_TENANTS,
        description="applications sharing the agent: tokens, weight, quotas, priority ceiling (a policy may add more)",
    )  # fmt: skip
    allow_unauthenticated: bool = False
    max_body_bytes: int = Field(default=64 << 20, gt=0)
    intra_op_threads: int = Field(default=0, ge=0, description="onnxruntime threads per run; 0: all cores")
    inter_op_threads: int = Field(default=1, ge=1)
    providers: list[str] | None = Field(
        default=None, description="onnxruntime providers to try in order; default TensorRT, CUDA, CPU as installed"
    )
    device_id: int = Field(default=0, ge=0, description="GPU to use")
    gpu_mem_limit: int | None = Field(default=None, gt=0, description="bytes the CUDA arena may take per session")
    gpu_memory_budget_bytes: int | None = Field(
        default=None,
        gt=0,
        description="GPU memory all the agent's models together may take; a load beyond it is refused",
    )
    max_queued_requests: int = Field(default=4096, ge=1)
    aging_s: float | None = Field(default=None, gt=0, description="serve a request waiting this long first")
    allow_non_finite: bool = Field(default=True, description="accept NaN/Inf in float inputs")
    drain_timeout_s: float = Field(default=30.0, gt=0)
    # Telemetry: always on at GET /metrics (Prometheus); OTLP pushes to the control plane, `otlp_endpoints` or the
    # standard OTEL_EXPORTER_OTLP_* variables when one is set.
    agent_id: str | None = Field(default=None, max_length=64, description="service.instance.id; default the host name")
    device_class: str = Field(default="cpu", max_length=32)
    labels: dict[str, str] = Field(default_factory=dict)
    control_plane: str | None = Field(default=None, description="control plane base URL: metrics to /v1/metrics")
    agent_token: SecretStr | None = Field(default=None, description="the agent's token from the control plane")
    otlp_endpoints: list[str | OtlpEndpoint] = Field(
        default_factory=list,
        description="more OTLP metrics endpoints (a URL, or {endpoint, headers, protocol}); default: the standard "
        "OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT variables",
    )
    export_interval_s: float = Field(default=5.0, gt=0)
    latency_buckets_ms: list[float] = Field(
        default_factory=lambda: list(DEFAULT_LATENCY_BUCKETS_MS),
        min_length=1,
        description="histogram boundaries; every SLO latency threshold should be one",
    )

    # Policy documents from the control plane (polled when `control_plane` is set) and what they may switch on.
    policy_poll_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="how often to poll for the policy; a document's poll_interval_s wins"
    )
    state_dir: Path = Field(
        default_factory=lambda: default_state_dir(), description="where the last good policy document is cached"
    )
    default_versions: dict[str, int] = Field(
        default_factory=dict, description="model -> the version requests without one get (default: the newest)"
    )
    fallback_cache_bytes: int = Field(
        default=8 << 20, ge=0, description="bytes of recent answers kept for `cache` fallbacks; 0: none"
    )
    load_headroom_bytes: int = Field(
        default=256 << 20, ge=0, description="memory that must stay free when a variant loads beside a version"
    )
    # Overflow to the cloud and the fallbacks behind it.
    role: Literal["edge", "cloud"] = Field(
        default="edge", description="cloud: a backend behind the gateway; it never overflows itself"
    )
    overflow: OverflowSettings = Field(default_factory=OverflowSettings)
    async_jobs: AsyncJobSettings = Field(default_factory=AsyncJobSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)

    @model_validator(mode="after")
    def _tenants_unique(self) -> AgentConfig:
        check_unique(self.tenant_list())
        return self

    def tenant_list(self) -> list[Tenant]:
        """The configured tenants in the contract's form (tokens as digests)."""
        return [t.tenant() for t in self.tenants]

    @model_validator(mode="after")
    def _overflow_fits_the_role(self) -> AgentConfig:
        if self.role == "cloud" and (self.overflow.enabled or self.overflow.gateway):
            raise ValueError("role cloud: a cloud backend never overflows (remove overflow.enabled / overflow.gateway)")
        if self.overflow.enabled and self.overflow.gateway is None and self.control_plane is None:
            raise ValueError("overflow.enabled needs a gateway: set overflow.gateway or control_plane")
        if self.overflow.gateway is not None and self.agent_token is None:
            raise ValueError("overflow.gateway needs agent_token: the gateway serves enrolled agents only")
        return self

    def gateway(self) -> str | None:
        """Where overflow goes (None: nowhere; cloud agents and agents without a control plane)."""
        if self.role == "cloud":
            return None
        return self.overflow.gateway or self.control_plane

    @model_validator(mode="after")
    def _telemetry_needs_a_token(self) -> AgentConfig:
        if self.control_plane is not None and self.agent_token is None:
            raise ValueError("control_plane needs agent_token: the control plane accepts metrics only from agents")
        if any(b <= 0 for b in self.latency_buckets_ms):
            raise ValueError("latency_buckets_ms must be positive")
        return self

    def telemetry(self, environ: dict[str, str] | None = None) -> TelemetrySettings:
        """Telemetry settings: this config's, with the standard OTEL_* variables (`environ`, default the process's)
        where it says nothing (edge_agent/telemetry/environment.py). The config wins where both are set:
        `otlp_endpoints` set -> the OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is not used; `export_interval_s` set ->
        OTEL_METRIC_EXPORT_INTERVAL is not; `agent_id` set -> it is service.instance.id, whatever
        OTEL_RESOURCE_ATTRIBUTES says (without it, that one wins over the host name). The OTEL headers go to every
        OTLP endpoint without headers of its own, never to the control plane. ValueError names a variable it cannot
        use."""
        from edge_agent.telemetry import environment
        from edge_agent.telemetry.settings import OtlpDestination

        env = dict(os.environ) if environ is None else environ
        resource = environment.resource_attributes(env)
        env_headers = tuple(environment.headers(env).items())
        destinations: list[OtlpDestination] = []
        for entry in self.otlp_endpoints:
            if isinstance(entry, str):
                destinations.append(OtlpDestination(entry, env_headers))
            else:
                own = tuple((key.lower(), value) for key, value in entry.headers.items())
                destinations.append(OtlpDestination(entry.endpoint, own or env_headers, entry.protocol))
        if not self.otlp_endpoints:
            protocol = environment.protocol(env)
            endpoint = environment.endpoint(env, protocol)
            if endpoint is not None:
                destinations.append(OtlpDestination(endpoint, env_headers, protocol))
        interval = None if "export_interval_s" in self.model_fields_set else environment.export_interval_s(env)
        return TelemetrySettings(
            agent_id=self.agent_id or resource.get("service.instance.id") or socket.gethostname(),
            device_class=self.device_class,
            labels=dict(self.labels),
            control_plane=self.control_plane,
            agent_token=self.agent_token.get_secret_value() if self.agent_token else None,
            otlp_endpoints=tuple(destinations),
            export_interval_s=self.export_interval_s if interval is None else interval,
            latency_buckets_ms=tuple(self.latency_buckets_ms),
            resource_attributes=resource,
        )

    @model_validator(mode="after")
    def _auth_beyond_loopback(self) -> AgentConfig:
        if not is_loopback(self.host) and self.token is None and not self.tenants and not self.allow_unauthenticated:
            raise ValueError(
                f"host {self.host} is beyond loopback: set a token (agent config `token`) "
                "or start with --allow-unauthenticated"
            )
        return self

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> AgentConfig:
        """The settings of the YAML file `path` with the command line's `overrides` on top (None: not given).

        Raises:
            AgentConfigError: one line per problem, naming the file, line and key (or the option) and the fix.
        """
        from pydantic import ValidationError

        from edge_agent.config_errors import SettingsSource, describe_validation, read_settings

        data: dict[str, Any] = {}
        document: yaml.Node | None = None
        if path is not None:
            data, document = read_settings(path)
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls.model_validate({**data, **given})
        except ValidationError as exc:
            source = SettingsSource(str(path) if path is not None else None, document, frozenset(overrides),
                                    frozenset(given))  # fmt: skip
            raise describe_validation(exc, cls, source) from exc


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/spillway`, else `~/.local/state/spillway`."""
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser() / "spillway"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
