"""Spillway control plane: stores SLOs and degradation rules, reads fleet telemetry, routes overflow."""

__version__ = "0.2.0"

__all__ = ["__version__"]
