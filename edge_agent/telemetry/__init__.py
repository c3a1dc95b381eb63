"""OpenTelemetry for the agent: the request, queue, compute and batch instruments, device probes, OTLP export."""

from edge_agent.telemetry.live import LiveTelemetry
from edge_agent.telemetry.metrics import AgentTelemetry, ModelRecorder, TelemetrySettings

__all__ = ["AgentTelemetry", "LiveTelemetry", "ModelRecorder", "TelemetrySettings"]
