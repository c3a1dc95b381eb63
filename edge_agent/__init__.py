"""Spillway edge agent: serves models on the device, within its SLOs."""

__version__ = "0.2.0"

__all__ = ["__version__"]
