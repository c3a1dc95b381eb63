"""The agent's one error tree. Every error the agent raises on purpose is an `AgentError`; each keeps the builtin
base it always had (a `ValueError` stays one), so callers that catch those still do.

AgentError
├── ModelConfigError      a model config or file the agent refuses to serve (at start: exit 2)       ValueError
├── RunnerError           a model version no runner here can load                                     RuntimeError
├── GpuMemoryError        a model that would not fit in the free GPU memory                           RuntimeError
├── HostMemoryError       a model that would not fit in the available host memory                     RuntimeError
├── UnknownModelError     404 unknown_model: no served model or version by that name                  LookupError
├── Refused               503 <its reason> + Retry-After: the scheduler cannot serve it in time
├── ExecutionFailed       500 error: the model run failed for the request's whole batch
├── QueueFull             the async queue holds its maximum of jobs (the fallback chain goes on)
├── JobNotRunning         a job's end for a job that is not running                                   LookupError
├── StoreUnavailable      503 async_storage_unavailable + Retry-After: the job store refused
│   └── StoreFull         503 async_storage_full: the disk has no room
├── PollFailed            one policy poll got no usable answer (the poller retries)
├── PolicyRefused         a policy document this agent will not apply (the last good one stays)       ValueError
├── CacheUnreadable       the cached policy file holds no usable document                             ValueError
└── CacheUnwritable       the disk refused the new cached document

Malformed requests are the contract's `TensorError` (a ValueError): 400 invalid_request. What an answered error
looks like on the wire (status, body, headers) is decided in one place, `edge_agent/serving/pipeline.py`.
"""

from __future__ import annotations

__all__ = ["AgentError"]


class AgentError(Exception):
    """Base of the agent's own errors. `status` and `reason`: the HTTP answer when one reaches a client."""

    status: int = 500
    reason: str = "error"
