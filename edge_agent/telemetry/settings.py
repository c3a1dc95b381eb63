"""What the agent's telemetry is: who the agent is, where its metrics go, and the buckets and interval (frozen: a
policy's change builds new settings and a new pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.contract.names import DEFAULT_LATENCY_BUCKETS_MS


class TelemetryConfigError(ValueError):
    """Telemetry settings the agent cannot honour (a protocol whose exporter is not installed, say): refused at
    start, with the fix."""


@dataclass(frozen=True)
class OtlpDestination:
    """One OTLP metrics destination: the URL, exactly the headers it gets (secrets: kept out of repr and logs) and
    the protocol (`http/protobuf`, or `grpc` through spillway[otlp-grpc])."""

    endpoint: str
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    protocol: str = "http/protobuf"


@dataclass(frozen=True)
class TelemetrySettings:
    """Who the agent is and where its metrics go (besides `/metrics`, which is always served)."""

    agent_id: str
    device_class: str = "cpu"
    labels: dict[str, str] = field(default_factory=dict)
    control_plane: str | None = None  # metrics go to <control_plane>/v1/metrics with the agent token
    agent_token: str | None = field(default=None, repr=False)
    otlp_endpoints: tuple[OtlpDestination, ...] = ()  # further OTLP destinations (collectors), never the agent token
    export_interval_s: float = 5.0
    export_timeout_s: float = 5.0
    latency_buckets_ms: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS_MS
    resource_attributes: dict[str, str] = field(default_factory=dict)  # OTEL_RESOURCE_ATTRIBUTES: the agent's own win

    def destinations(self) -> tuple[OtlpDestination, ...]:
        """Every OTLP destination: the control plane's (with the agent token, and nothing else) first."""
        if not self.control_plane:
            return self.otlp_endpoints
        headers = (("authorization", f"Bearer {self.agent_token}"),) if self.agent_token else ()
        plane = OtlpDestination(self.control_plane.rstrip("/") + "/v1/metrics", headers)
        return (plane, *self.otlp_endpoints)
