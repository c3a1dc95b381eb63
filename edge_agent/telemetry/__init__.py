"""OpenTelemetry for the agent: the request, queue, compute and batch instruments, device probes, `/metrics` in the
Prometheus text format (always), OTLP export (where configured: the agent config, else the standard OTEL_*
variables)."""

from edge_agent.telemetry.live import LiveTelemetry
from edge_agent.telemetry.metrics import AgentTelemetry, ModelRecorder
from edge_agent.telemetry.settings import OtlpDestination, TelemetryConfigError, TelemetrySettings

__all__ = ["AgentTelemetry", "LiveTelemetry", "ModelRecorder", "OtlpDestination", "TelemetryConfigError",
           "TelemetrySettings"]  # fmt: skip
