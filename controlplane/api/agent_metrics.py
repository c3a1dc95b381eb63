"""`GET /api/v1/agents/{id}/metrics`: one agent's recent telemetry, summarised from its minute rollups."""

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, BeforeValidator, Field, WithJsonSchema

from controlplane import query
from controlplane.api.deps import FreshRollups, SessionDep, SettingsDep, Viewer
from controlplane.schemas.common import Duration
from spillway.contract.tenants import NAME_PATTERN

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])


def _seconds_in_query(value: Any) -> Any:
    """A query string carries numbers as text: '300' means 300 seconds, as a number would in JSON."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


Window = Annotated[
    Duration,
    BeforeValidator(_seconds_in_query),
    Field(ge=60),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 60, "description": "seconds"},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d|w)\s*$", "examples": ["5m", "1h"]},
            ]
        },
        mode="validation",
    ),
    Query(description="how far back: at least 1m, at most the rollup retention (e.g. 5m, 1h, 7d)"),
]


class Latency(BaseModel):
    count: float = Field(description="requests served locally (outcome `local`) that the percentiles describe")
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None


class QueueDepth(BaseModel):
    last: float = Field(description="the latest reading (summed over the model's versions)")
    max: float = Field(description="the highest reading in the window (summed over versions within a minute)")


class Traffic(BaseModel):
    model: str | None
    priority: int | None
    versions: list[str] = Field(description="model versions seen in the window")
    requests: float
    rps: float = Field(description="requests per second over the window")
    outcomes: dict[str, float] = Field(description="requests per outcome")
    latency_ms: Latency = Field(
        description="request duration of requests served locally, percentiles interpolated inside histogram buckets"
    )
    queue_ms_mean: float | None = Field(description="mean time queued, of requests served locally")
    compute_ms_mean: float | None = Field(description="mean model run time, of requests served locally")
    queue_depth: QueueDepth | None = Field(description="requests queued at this priority; null if never reported")


class Batches(BaseModel):
    model: str | None
    batches: float = Field(description="batches run in the window")
    mean: float | None = Field(description="mean rows per batch")
    p50: float | None
    p99: float | None


class GaugeReading(BaseModel):
    metric: str = Field(description="e.g. hw.gpu.memory.usage, hw.temperature, system.memory.usage")
    attributes: dict[str, Any]
    last: float | None
    at: datetime | None = Field(description="start of the minute of the last reading")
    min: float | None
    max: float | None


class Percentiles(BaseModel):
    count: float = Field(description="observations (streams) the figures describe")
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


class Generation(BaseModel):
    """One generative model: the OTel GenAI histograms (streams the agent answered with tokens, served locally or
    overflowed), its `spillway.requests` and its generation gauges."""

    model: str
    requests: float = Field(description="requests of this model, every outcome (spillway.requests)")
    streams_per_s: float = Field(description="streams answered with tokens per second (GenAI request durations)")
    ttft_ms: Percentiles = Field(description="time to first token, interpolated inside histogram buckets")
    tpot_ms: Percentiles = Field(description="mean time per output token after the first, per stream")
    duration_ms: Percentiles = Field(description="arrival to the last token")
    tokens_in_per_s: float = Field(description="prompt tokens per second (gen_ai.client.token.usage, input)")
    tokens_out_per_s: float = Field(description="generated tokens per second (gen_ai.client.token.usage, output)")
    kv_blocks_used: float | None = Field(description="KV-cache blocks held, the latest reading; null if never reported")
    kv_blocks_total: float | None = Field(
        description="KV-cache blocks of the budget (the spillway.kv.blocks.limit gauge), the latest reading"
    )
    kv_cache_use: float | None = Field(description="used / total of the latest minute with both readings, 0..1")
    preemptions: float = Field(description="sequences preempted (recomputed) in the window")
    preemptions_per_min: float = Field(description="preemptions per minute over the window")
    active_streams: float | None = Field(description="sequences admitted and not finished, the latest reading")
    outcomes: dict[str, float] = Field(description="requests per outcome")


class TenantTraffic(BaseModel):
    """One tenant's requests on the agent (`spillway.tenant`; requests an agent from before tenants reported are the
    `default` tenant's)."""

    tenant: str = Field(description="a tenant's name, `default` (the operator's) or `other` (beyond the bound)")
    requests: float = Field(description="requests of this tenant, every outcome, V2 and generative")
    rps: float = Field(description="requests per second over the window")
    outcomes: dict[str, float] = Field(description="requests per outcome (`rejected` includes its quota refusals)")
    served: float = Field(description="requests served on the device (outcome `local`)")
    share: float | None = Field(
        description="its part of the requests served on the device, 0..1, over every tenant; null if none was"
    )
    rejected: float = Field(description="requests refused (outcome `rejected`: over a quota, queue full, ...)")
    latency_ms: Latency = Field(description="request duration of its requests served locally")
    ttft_ms: Percentiles = Field(description="generative streams: time to first token")
    tokens_out_per_s: float = Field(description="generative: tokens generated per second")


class AgentMetrics(BaseModel):
    agent: str
    name: str
    window: Duration
    since: datetime = Field(description="start of the oldest minute rollup read (the window in whole minutes)")
    until: datetime = Field(description="now; rates are per second of since..until")
    requests: float
    rps: float
    outcomes: dict[str, float] = Field(description="requests per outcome (local, rejected, error, ...)")
    traffic: list[Traffic] = Field(description="per (model, priority)")
    batches: list[Batches] = Field(description="batch sizes per model")
    device: list[GaugeReading] = Field(description="device and host gauges, per metric and attributes")
    generation: list[Generation] = Field(description="generative models, by model name")
    tenant: str | None = Field(
        default=None,
        description="the tenant asked for: requests, outcomes, traffic, latencies and generative figures are its "
        "own; batches, queue depths and gauges are the device's",
    )
    by_tenant: list[TenantTraffic] = Field(description="per tenant (only the one asked for, if any), by name")


TenantFilter = Annotated[
    str | None,
    Query(pattern=NAME_PATTERN, max_length=63,
          description="only this tenant's requests (`default`: the operator's, and those of agents before tenants)"),
]  # fmt: skip


@router.get("/{item_id}/metrics", response_model=AgentMetrics, summary="An agent's recent telemetry",
            dependencies=[FreshRollups])  # fmt: skip
def agent_metrics(
    item_id: str, session: SessionDep, settings: SettingsDep, _: Viewer, window: Window = 300,
    tenant: TenantFilter = None,
) -> Any:  # fmt: skip
    return query.agent_metrics(session, item_id, window, retention_s=settings.retention_days * 86400, tenant=tenant)
