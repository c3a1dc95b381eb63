"""What the agent's telemetry is: who the agent is, where its metrics go, and the buckets and interval (frozen: a
policy's change builds new settings and a new pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

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

    def __repr__(self) -> str:  # the endpoint as logged: a repr may end up in a log line or a traceback
        return f"OtlpDestination(endpoint={redacted(self.endpoint)!r}, protocol={self.protocol!r})"


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


def redacted(url: str) -> str:
    """The URL as log lines and errors show it: scheme, host, port and path. User info (a password or a token), the
    query and the fragment are left out: some collectors take their API key as `?api_key=...`."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return "<unparsable URL>"
    if ":" in host:  # IPv6: back in its brackets
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
