"""Answers the agent gives without running the model: local fallbacks (the overflow issue adds forwarding)."""

from edge_agent.overflow.fallback import ResponseCache, default_answer, inputs_key

__all__ = ["ResponseCache", "default_answer", "inputs_key"]
