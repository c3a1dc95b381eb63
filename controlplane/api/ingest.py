"""`POST /v1/metrics`: the OTLP/HTTP metrics receiver, for agents only (each writes only its own metrics)."""

import asyncio
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request, Response
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)
from starlette.requests import ClientDisconnect

from controlplane.api.deps import AgentCaller, SettingsDep
from controlplane.errors import Overloaded
from controlplane.ingest.receiver import Ingestor, decode
from controlplane.schemas.common import ErrorBody

router = APIRouter(tags=["telemetry"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "accepted (partial_success says what was refused and why)",
          "content": {"application/x-protobuf": {}, "application/json": {}}},
    415: {"model": ErrorBody, "description": "not application/x-protobuf or application/json"},
    503: {"model": ErrorBody, "description": "overloaded: retry after the Retry-After header's seconds"},
}  # fmt: skip


@router.post("/v1/metrics", summary="Export metrics (OTLP/HTTP, protobuf or JSON, optionally gzip)",
             responses=_RESPONSES, response_class=Response)  # fmt: skip
async def export_metrics(request: Request, agent: AgentCaller, settings: SettingsDep) -> Response:
    """Each data point is stored or refused; refusals are counted and explained in `partial_success` (HTTP 200, the
    rest of the export stored). A histogram the control plane reads must come on its bounds (the duration histograms
    on SPILLWAY_LATENCY_BUCKETS_MS in seconds, the GenAI ones on the semantic conventions'), on finer bounds that
    include them (re-bucketed exactly), or, for the duration histograms, on some of them. The attribute names of
    agents before 0.2 (`model`, `model.version`, `priority`, `outcome`, `policy.source`) are stored as the namespaced
    ones (`spillway.model`, ...)."""
    slots: asyncio.Semaphore = request.app.state.ingest_slots
    if slots.locked():  # every slot busy: tell the exporter to come back (it retries 503 with backoff)
        raise Overloaded("the control plane is ingesting at capacity; retry later", details={"retry_after_s": 1})
    async with slots:
        return await _export(request, agent.id, settings)


async def _export(request: Request, agent_id: str, settings: Any) -> Response:
    try:
        body = await request.body()
    except ClientDisconnect:  # the exporter gave up (its timeout) mid-body: nobody is left to answer, nothing stored
        return Response(status_code=400, content=b"the exporter disconnected before its body arrived")
    ingestor: Ingestor = request.app.state.ingestor
    content_type = request.headers.get("content-type", "")
    encoding = request.headers.get("content-encoding", "")

    def work() -> Any:
        message = decode(body, content_type, encoding, settings.ingest_max_body_bytes)
        return ingestor.ingest(agent_id, message)

    result = await to_thread.run_sync(work)
    request.app.state.monitoring.ingested(result.accepted, result.rejected)
    reply = ExportMetricsServiceResponse()
    if result.rejected:
        reply.partial_success.CopyFrom(
            ExportMetricsPartialSuccess(rejected_data_points=result.rejected, error_message=result.message)
        )
    if content_type.split(";")[0].strip().lower() == "application/json":
        from google.protobuf import json_format

        return Response(json_format.MessageToJson(reply), media_type="application/json")
    return Response(reply.SerializeToString(), media_type="application/x-protobuf")
