"""What the agent does with requests it will not serve itself: overflow to the control plane's gateway behind a
circuit breaker (`forward`, `breaker`; streams relayed chunk by chunk: `stream`), and the local fallbacks when the
cloud cannot answer: the cached answer (`fallback`), the configured default outputs or text, and the durable async
queue (`jobs`, `queue`).

aiohttp (forwarding) is imported only when a request first overflows."""

from edge_agent.overflow.fallback import (
    Completion,
    CompletionCache,
    ResponseCache,
    completion_key,
    default_answer,
    inputs_key,
)

__all__ = ["Completion", "CompletionCache", "ResponseCache", "completion_key", "default_answer", "inputs_key"]
