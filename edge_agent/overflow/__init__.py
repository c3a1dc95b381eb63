"""What the agent does with requests it will not serve itself: overflow to the control plane's gateway behind a
circuit breaker (`forward`, `breaker`), and the local fallbacks when the cloud cannot answer: the cached answer
(`fallback`), the configured default outputs, and the durable async queue (`jobs`, `queue`).

aiohttp (forwarding) is imported only when a request first overflows."""

from edge_agent.overflow.fallback import ResponseCache, default_answer, inputs_key

__all__ = ["ResponseCache", "default_answer", "inputs_key"]
