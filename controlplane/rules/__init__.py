"""The control loop: degradation rules evaluated against telemetry, composed into per-agent policy documents."""
