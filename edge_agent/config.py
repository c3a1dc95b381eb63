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

    slow_rt_ms: float = Field(
        default=1000.0, gt=0, description="an overflowed request slower than this (ms) counts as slow"
    )
    slow_ratio: float | None = Field(default=0.5, gt=0, le=1, description="open above this share slow (null: never)")
    error_ratio: float | None = Field(default=0.5, gt=0, le=1, description="open above this share failed (null: never)")
    min_requests: int = Field(default=5, ge=1, description="judge no window with fewer requests than this")
    stat_interval_s: float = Field(default=10.0, gt=0, description="the sliding window the ratios are over (seconds)")
    open_s: float = Field(default=5.0, gt=0, description="how long an open breaker refuses (seconds) before one probe")


class OverflowSettings(BaseModel):
    """Where the requests this agent will not serve go (the control plane's gateway), and what answers when the
    cloud cannot: the fallback chain cache -> default outputs -> async queue -> 503."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False, description="overflow predicted deadline misses even before any policy says so (a policy wins)"
    )
    fraction: float = Field(default=0.0, ge=0, le=1, description="with enabled: ... and this share of the rest")
    at_or_below: int | None = Field(
        default=None, ge=1, le=64, description="with enabled: ... and every request at this priority level or lower"
    )
    gateway: str | None = Field(
        default=None,
        description="gateway base URL; default: control_plane (whose gateway is POST <URL>/v2/models/{m}/infer)",
    )
    max_in_flight: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="requests overflowing at once; beyond: fallbacks (reason overflow_busy)",
    )
    default_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="timeout (seconds) of requests without a deadline"
    )
    breaker: BreakerSettings = Field(
        default_factory=BreakerSettings, description="the circuit breaker on overflowed requests' answers"
    )
    default_outputs: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict, description="model -> V2 output tensors answered as fallback_default when overflow fails"
    )
    cache_ttl_s: float | None = Field(
        default=300.0,
        gt=0,
        description="cached answers older than this (seconds) are not served as fallback_cache (null: no limit)",
    )


class AsyncJobSettings(BaseModel):
    """The async queue: requests to these models that neither the device nor the cloud can serve now are accepted
    (202 and a job id), kept on disk, run when the device has room, and fetched at /spillway/v1/jobs/{id}."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(
        default_factory=list,
        description="models whose requests may be accepted as jobs when nothing else can answer",
    )
    max_jobs: int = Field(default=1000, ge=1, le=1_000_000, description="queued + running jobs, at most; beyond: 503")
    ttl_s: float = Field(default=3600.0, gt=0, description="a job not run within this long (seconds) expires")
    drain_below: float = Field(
        default=0.5,
        gt=0,
        le=4,
        description="jobs run while the model's utilisation (running + queued batches per instance) is below this",
    )


class GenerationSettings(BaseModel):
    """How the agent serves generative models; a model's config (`parameters`, `dynamic_batching`) overrides them."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(default=8, ge=1, le=1024, description="sequences running at once")
    max_num_batched_tokens: int = Field(
        default=512, ge=1, description="tokens one step computes (the step's token budget)"
    )
    long_prefill_threshold: int = Field(default=128, ge=1, description="the largest prompt chunk of one step")
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV-cache block")
    kv_budget_bytes: int | None = Field(
        default=None, gt=0, description="the KV cache's bytes (default: kv_budget_share of the free memory)"
    )
    kv_budget_share: float = Field(
        default=0.25, gt=0, le=1, description="share of the memory free at load for the KV cache"
    )
    levels: int = Field(default=3, ge=1, le=16, description="priority levels (1 the highest)")
    default_level: int = Field(default=2, ge=1, description="the level of a request without a priority")
    default_max_tokens: int = Field(default=256, ge=1, description="max_tokens of a chat request that sets none")
    fallback_text: str | None = Field(
        default=None, min_length=1, max_length=65536,
        description="the answer of a fallback `default` (policy mode default without default_text, overflow failed)",
    )  # fmt: skip
    queue_policy: Literal["priority", "fcfs", "shortest_prompt_first"] = Field(
        default="priority", description="order of waiting requests: by level, by arrival, or shortest prompt first"
    )
    aging_s: float | None = Field(
        default=None, gt=0, description="a request waiting this long (seconds) goes before every level"
    )

    @model_validator(mode="after")
    def _levels_fit(self) -> GenerationSettings:
        """`default_level` is one of the `levels`; `max_num_batched_tokens` is at least `max_num_seqs` (a decode
        token for each)."""
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
        """A tenant's name is not reserved (`default`, `other`), and it has a `token` or `token_sha256`."""
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

    model_repository: Path = Field(
        description="the model repository, in Triton's layout: <repo>/<model>/config.pbtxt (or config.yaml) and "
        "<repo>/<model>/<version>/model.onnx"
    )
    host: str = Field(default="127.0.0.1", description="listen address of the HTTP and gRPC ports")
    # Triton's ports: HTTP 8000, gRPC 8001 (Triton's metrics port 8002 is not used: /metrics is on the HTTP port).
    # Until 0.2 the HTTP default was 8001; an agent whose config sets no `port` still answers HTTP/1.1 there for one
    # release (the legacy listener tells gRPC from HTTP/1.1 by the connection's first bytes).
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (V2, OpenAI, /metrics)")
    grpc_port: int | None = Field(
        default=8001, ge=0, le=65535, description="V2 gRPC port (needs spillway[grpc]); null: no gRPC"
    )
    token: SecretStr | None = Field(
        default=None,
        description="bearer token the API requires on every route but /v2/health/live (required beyond loopback): the "
        "operator's (the `default` tenant)",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, max_length=MAX_TENANTS,
        description="applications sharing the agent: tokens, weight, quotas, priority ceiling (a policy may add more); "
        "with any tenant a token is always required",
    )  # fmt: skip
    allow_unauthenticated: bool = Field(
        default=False, description="serve beyond loopback without a token (not recommended)"
    )
    max_body_bytes: int = Field(default=64 << 20, gt=0, description="largest request body; larger requests get 413")
    intra_op_threads: int = Field(default=0, ge=0, description="onnxruntime intra-op threads per session; 0: all cores")
    inter_op_threads: int = Field(default=1, ge=1, description="onnxruntime inter-op threads per session")
    providers: list[str] | None = Field(
        default=None,
        description="onnxruntime providers to try, in order, among those installed; default TensorRT, CUDA, CPU",
    )
    device_id: int = Field(default=0, ge=0, description="the GPU to use (CUDA device index)")
    gpu_mem_limit: int | None = Field(
        default=None, gt=0, description="bytes the CUDA arena may take per session (a bounded arena on GPU)"
    )
    gpu_memory_budget_bytes: int | None = Field(
        default=None,
        gt=0,
        description="GPU memory all the agent's models together may take; a load beyond it is refused",
    )
    max_queued_requests: int = Field(
        default=4096, ge=1, description="cap on queued requests per model version, whatever the model config says"
    )
    aging_s: float | None = Field(
        default=None, gt=0, description="a request waiting this long (seconds) is served before higher levels"
    )
    allow_non_finite: bool = Field(default=True, description="accept NaN/Inf in float inputs (false: 400)")
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="longest a SIGTERM waits for queued requests (seconds)"
    )
    # Telemetry: always on at GET /metrics (Prometheus); OTLP pushes to the control plane, `otlp_endpoints` or the
    # standard OTEL_EXPORTER_OTLP_* variables when one is set.
    agent_id: str | None = Field(
        default=None,
        max_length=64,
        description="the agent's id at the control plane: service.instance.id of its metrics, its policy's URL; "
        "default: the host name",
    )
    device_class: str = Field(default="cpu", max_length=32, description="resource attribute spillway.device.class")
    labels: dict[str, str] = Field(default_factory=dict, description="resource attributes spillway.label.<key>")
    control_plane: str | None = Field(
        default=None,
        description="control plane base URL: OTLP metrics go to <URL>/v1/metrics, policies are polled from it (needs "
        "agent_token)",
    )
    agent_token: SecretStr | None = Field(
        default=None,
        description="the agent's token from the control plane (--agent-token or SPILLWAY_AGENT_TOKEN), sent as "
        "Authorization: Bearer",
    )
    otlp_endpoints: list[str | OtlpEndpoint] = Field(
        default_factory=list,
        description="more OTLP metrics endpoints: a URL (a collector's http://host:4318/v1/metrics), or {endpoint, "
        "headers, protocol}; default: the standard "
        "OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT variables",
    )
    export_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="how often metrics are exported (seconds); unset: OTEL_METRIC_EXPORT_INTERVAL when that is set",
    )
    latency_buckets_ms: list[float] = Field(
        default_factory=lambda: list(DEFAULT_LATENCY_BUCKETS_MS),
        min_length=1,
        description="histogram boundaries of the duration metrics; make every SLO latency threshold one",
    )

    # Policy documents from the control plane (polled when `control_plane` is set) and what they may switch on.
    policy_poll_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="how often to poll for the policy (seconds, jittered); a document's poll_interval_s wins",
    )
    state_dir: Path = Field(
        default_factory=lambda: default_state_dir(), description="where the last good policy document is cached"
    )
    default_versions: dict[str, int] = Field(
        default_factory=dict, description="model -> the version requests without one get (default: the newest served)"
    )
    fallback_cache_bytes: int = Field(
        default=8 << 20,
        ge=0,
        description="size in bytes of the LRU of recent answers for `cache` fallbacks; 0: no cache",
    )
    load_headroom_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="memory (bytes) that must stay free after a variant loads beside the running version",
    )
    # Overflow to the cloud and the fallbacks behind it.
    role: Literal["edge", "cloud"] = Field(
        default="edge",
        description="cloud: a backend behind the gateway (it never overflows itself; overflow must stay off)",
    )
    overflow: OverflowSettings = Field(
        default_factory=OverflowSettings, description="overflow to the gateway, its circuit breaker and fallbacks"
    )
    async_jobs: AsyncJobSettings = Field(default_factory=AsyncJobSettings, description="the async queue")
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings, description="how generative models are served"
    )

    @model_validator(mode="after")
    def _tenants_unique(self) -> AgentConfig:
        """No two tenants share a name, and no token (digest) belongs to two tenants."""
        check_unique(self.tenant_list())
        return self

    def tenant_list(self) -> list[Tenant]:
        """The configured tenants in the contract's form (tokens as digests)."""
        return [t.tenant() for t in self.tenants]

    @model_validator(mode="after")
    def _overflow_fits_the_role(self) -> AgentConfig:
        """`role: cloud` sets neither `overflow.enabled` nor `overflow.gateway`; `overflow.enabled` needs a gateway
        (`overflow.gateway` or `control_plane`); `overflow.gateway` needs `agent_token` (the gateway serves enrolled
        agents only)."""
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
        """`control_plane` needs `agent_token` (the control plane accepts metrics only from agents); every
        `latency_buckets_ms` boundary is positive."""
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
        """A `host` beyond loopback needs a `token` (or tenants), or `--allow-unauthenticated` /
        `allow_unauthenticated: true`."""
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
