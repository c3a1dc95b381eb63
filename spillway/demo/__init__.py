"""The demo and its tools: stories that run real processes on loopback, burst clients, demo model builders, and the
one process harness (start, wait ready, stop). Neither the agent nor the control plane imports anything here."""

__all__ = ["burst", "generative_overflow_story", "harness", "models", "overflow_story", "progress", "run", "story"]
