"""The names both sides of the wire agree on: metrics and their attributes (the OTLP stream), request outcomes and
reasons, and the HTTP headers an agent and the gateway exchange. Defined once here; the agent, the control plane,
the dashboard and the demo import them, so a rename is one edit and a typo is an import error."""

from __future__ import annotations

from typing import Literal, get_args

# ---- metrics (OTLP), as the agent exports them and the control plane stores them ----------------------------------

REQUESTS = "spillway.requests"  # counter: model, priority, outcome
REQUEST_DURATION = "spillway.request.duration"  # histogram, s: arrival at the agent to answer
QUEUE_DURATION = "spillway.queue.duration"  # histogram, s
COMPUTE_DURATION = "spillway.compute.duration"  # histogram, s: the model run of the request's batch
BATCH_SIZE = "spillway.batch.size"  # histogram, rows
QUEUE_DEPTH = "spillway.queue.depth"  # gauge: model, priority
POLICY_REFUSALS = "spillway.policy.refusals"  # counter: source
POLICY_VERSION = "spillway.policy.version"  # gauge
DURATIONS = (REQUEST_DURATION, QUEUE_DURATION, COMPUTE_DURATION)

GPU_MEMORY_USAGE = "hw.gpu.memory.usage"  # gauge, By
GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"  # gauge, By
GPU_UTILIZATION = "hw.gpu.utilization"  # gauge, 0..1
TEMPERATURE = "hw.temperature"  # gauge, Cel
DEVICE_GAUGES = (GPU_MEMORY_USAGE, GPU_MEMORY_LIMIT, GPU_UTILIZATION, TEMPERATURE)

# Generative models: the OTel GenAI semantic conventions (status Development), with their recommended buckets.
GENAI_TTFT = "gen_ai.server.time_to_first_token"  # histogram, s
GENAI_TPOT = "gen_ai.server.time_per_output_token"  # histogram, s: after the first token
GENAI_REQUEST_DURATION = "gen_ai.server.request.duration"  # histogram, s
GENAI_TOKEN_USAGE = "gen_ai.client.token.usage"  # noqa: S105 (a metric name) histogram, {token}, by gen_ai.token.type
GENAI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
KV_BLOCKS_USED = "spillway.kv.blocks.used"  # gauge: model
# gauge: model; the budget's blocks. OTel's `.limit` (as hw.gpu.memory.limit): Prometheus keeps `_total` for counters.
KV_BLOCKS_TOTAL = "spillway.kv.blocks.limit"
PREEMPTIONS = "spillway.generation.preemptions"  # counter: model
STEP_TOKENS = "spillway.generation.step.tokens"  # histogram, {token}: tokens one engine step computed; model
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # spillway.batch.size's bounds, rows
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ACTIVE_STREAMS = "spillway.generation.streams.active"  # gauge: model; sequences admitted and not yet finished
GENAI_METRICS = (GENAI_TTFT, GENAI_TPOT, GENAI_REQUEST_DURATION, GENAI_TOKEN_USAGE)
GENERATION_GAUGES = (KV_BLOCKS_USED, KV_BLOCKS_TOTAL, ACTIVE_STREAMS)
ATTR_GENAI_MODEL = "gen_ai.request.model"
ATTR_GENAI_OPERATION = "gen_ai.operation.name"  # chat | text_completion
ATTR_GENAI_TOKEN_TYPE = "gen_ai.token.type"  # noqa: S105 (an attribute name): input or output

# Attributes on the points and on the resource: namespaced, as OTel's naming rules ask (semconv names where they
# exist: the gen_ai.* ones above).
ATTR_MODEL = "spillway.model"
ATTR_VERSION = "spillway.model.version"
ATTR_PRIORITY = "spillway.priority"
ATTR_OUTCOME = "spillway.outcome"
ATTR_POLICY_SOURCE = "spillway.policy.source"
# The tenant a request belonged to (spillway.contract.tenants): a configured name, `default` (the operator's), or
# `other` (a tenant the agent no longer knows); on spillway.requests and the duration histograms.
ATTR_TENANT = "spillway.tenant"
# The names agents before 0.2 sent; the control plane reads them as the new ones for one release (then drop this).
LEGACY_ATTRIBUTES = {"model": ATTR_MODEL, "model.version": ATTR_VERSION, "priority": ATTR_PRIORITY,
                     "outcome": ATTR_OUTCOME, "policy.source": ATTR_POLICY_SOURCE}  # fmt: skip
# Metric names agents before 0.2 sent; the control plane reads them as the new ones for one release (then drop this).
LEGACY_METRICS = {"spillway.kv.blocks.total": KV_BLOCKS_TOTAL}
ATTR_DEVICE_CLASS = "spillway.device.class"
SERVICE_NAME = "spillway-edge-agent"

# Histogram bucket boundaries of the latency histograms, in milliseconds, unless a policy says otherwise. Latency
# SLO thresholds must sit on one of them, so the control plane checks SLOs against the same list.
DEFAULT_LATENCY_BUCKETS_MS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)

# ---- outcomes: every request gets exactly one -----------------------------------------------------------------------

Outcome = Literal["local", "overflow", "fallback_cache", "fallback_default", "queued_async", "rejected", "error"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
LOCAL: Outcome = "local"
OVERFLOW: Outcome = "overflow"
FALLBACK_CACHE: Outcome = "fallback_cache"
FALLBACK_DEFAULT: Outcome = "fallback_default"
QUEUED_ASYNC: Outcome = "queued_async"
REJECTED: Outcome = "rejected"
ERROR: Outcome = "error"
# Answered with a result (the device's, the cloud's, a fallback's, or a promise of one): good for availability.
GOOD_OUTCOMES: frozenset[Outcome] = frozenset({LOCAL, OVERFLOW, FALLBACK_CACHE, FALLBACK_DEFAULT, QUEUED_ASYNC})

# Why a request was refused or sent elsewhere (the `reason` of a `rejected` answer, or of a fallback's).
Reason = Literal[
    "invalid_request",
    "unknown_model",
    "payload_too_large",
    "deadline_unmeetable",
    "queue_full",
    "timeout",
    "draining",
    "shed",
    "fallback_miss",
    "no_gateway",
    "async_storage_full",
    "async_storage_unavailable",
    "tenant_quota",  # 429: the tenant is over one of its quotas (in flight, requests/s, tokens/s, streams)
]

# ---- HTTP headers (lower case, as ASGI carries them) ----------------------------------------------------------------

H_OUTCOME = "spillway-outcome"  # on every inference answer: one of OUTCOMES
H_REASON = "spillway-reason"  # on a refusal or a fallback: why
H_VARIANT = "spillway-variant"  # the version that served, when a policy switched variant
H_BACKEND = "spillway-backend"  # the cloud backend that answered an overflowed request
H_JOB_ID = "spillway-job-id"
H_JOB_STATUS = "spillway-job-status"
H_TIMEOUT_US = "spillway-timeout-us"  # what is left of an overflowed request's deadline, in microseconds
H_HEADER_LENGTH = "inference-header-content-length"  # Triton's binary extension: the JSON part's length
H_RETRY_AFTER = "retry-after"
H_TENANT = "spillway-tenant"  # an overflowed request's tenant, agent -> gateway (the gateway may cap its share)
# On a generative answer whose max_tokens a policy capped: the cap applied (the answer ends with finish_reason length
# when it reaches it).
H_MAX_TOKENS_CAP = "spillway-max-tokens-cap"
# The field of an OpenAI-shaped answer (the body of a whole one; one extra chunk, `choices: []`, before `data: [DONE]`
# of a stream) that says how Spillway answered: {"outcome": ..., "backend": ... (overflow), "reason": ...}.
OPENAI_FIELD = "spillway"

__all__ = [
    "ACTIVE_STREAMS",
    "ATTR_DEVICE_CLASS",
    "ATTR_GENAI_MODEL",
    "ATTR_GENAI_OPERATION",
    "ATTR_GENAI_TOKEN_TYPE",
    "ATTR_MODEL",
    "ATTR_OUTCOME",
    "ATTR_POLICY_SOURCE",
    "ATTR_PRIORITY",
    "ATTR_TENANT",
    "ATTR_VERSION",
    "BATCH_SIZE",
    "BATCH_SIZE_BUCKETS",
    "COMPUTE_DURATION",
    "DEFAULT_LATENCY_BUCKETS_MS",
    "DEVICE_GAUGES",
    "DURATIONS",
    "ERROR",
    "FALLBACK_CACHE",
    "FALLBACK_DEFAULT",
    "GENAI_DURATION_BUCKETS",
    "GENAI_METRICS",
    "GENAI_REQUEST_DURATION",
    "GENAI_TOKEN_BUCKETS",
    "GENAI_TOKEN_USAGE",
    "GENAI_TPOT",
    "GENAI_TPOT_BUCKETS",
    "GENAI_TTFT",
    "GENAI_TTFT_BUCKETS",
    "GENERATION_GAUGES",
    "GOOD_OUTCOMES",
    "GPU_MEMORY_LIMIT",
    "GPU_MEMORY_USAGE",
    "GPU_UTILIZATION",
    "H_BACKEND",
    "H_HEADER_LENGTH",
    "H_JOB_ID",
    "H_JOB_STATUS",
    "H_MAX_TOKENS_CAP",
    "H_OUTCOME",
    "H_REASON",
    "H_RETRY_AFTER",
    "H_TENANT",
    "H_TIMEOUT_US",
    "H_VARIANT",
    "KV_BLOCKS_TOTAL",
    "KV_BLOCKS_USED",
    "LEGACY_ATTRIBUTES",
    "LEGACY_METRICS",
    "LOCAL",
    "OPENAI_FIELD",
    "OUTCOMES",
    "OVERFLOW",
    "POLICY_REFUSALS",
    "POLICY_VERSION",
    "PREEMPTIONS",
    "QUEUED_ASYNC",
    "QUEUE_DEPTH",
    "QUEUE_DURATION",
    "REJECTED",
    "REQUESTS",
    "REQUEST_DURATION",
    "SERVICE_NAME",
    "STEP_TOKENS",
    "STEP_TOKEN_BUCKETS",
    "TEMPERATURE",
    "Outcome",
    "Reason",
]
