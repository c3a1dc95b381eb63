"""`POST /v1/metrics`: the OTLP/HTTP metrics receiver, for agents only (each writes only its own metrics).

The hot path of a fleet: every agent calls it every few seconds. So it is served by `serve_export` alone
(`LeanRoute`), without FastAPI's dependency solving; the `Authenticate` middleware has already checked the token
(from its cache, usually). A small body is decoded and folded on the event loop (cheaper than a thread hop: both
hold the GIL), a big one in a worker thread; the answer waits for the export to be durable (in the ingest log, or
committed; `Ingestor.submit`). Each failure has its answer: 401/403 credentials, 413 body limit, 415 media type,
400 undecodable, 503 (with Retry-After) when overloaded or when the export could not be stored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)
from starlette.requests import ClientDisconnect

from controlplane.api.auth import Principal
from controlplane.api.deps import AgentCaller
from controlplane.errors import Forbidden, Overloaded, Unauthenticated
from controlplane.ingest.receiver import Ingestor, Submitted, decode
from controlplane.schemas.common import ErrorBody

log = logging.getLogger("spillway.controlplane")

INLINE_MAX_BYTES = 32 * 1024
"""Uncompressed bodies up to this size are decoded and folded on the event loop (a millisecond of CPU at most; a
thread hop costs more than a small export's fold); bigger ones, and every gzip body (it may inflate a thousandfold),
in a worker thread."""

_PROTOBUF = "application/x-protobuf"

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "accepted (partial_success says what was refused and why)",
          "content": {"application/x-protobuf": {}, "application/json": {}}},
    400: {"model": ErrorBody, "description": "the body is not an OTLP metrics export (or not valid gzip)"},
    415: {"model": ErrorBody, "description": "not application/x-protobuf or application/json"},
    503: {"model": ErrorBody, "description": "overloaded, or the export could not be stored: retry after the "
                                             "Retry-After header's seconds"},
}  # fmt: skip


async def serve_export(request: Request) -> Response:
    """`POST /v1/metrics`: the agent (from the middleware), a slot, the body, the fold, the wait until durable."""
    principal: Principal | None = request.scope.get("state", {}).get("principal")
    if principal is None:  # only if the middleware were removed: fail closed
        raise Unauthenticated("missing credentials")
    if principal.kind != "agent":
        raise Forbidden("this endpoint is for agents: use the agent's token")
    state = request.app.state
    if not state.ingest_ready:  # its log not replayed yet (the database not there): nothing may overtake it
        raise Overloaded("the control plane is not ready to ingest yet; retry later", details={"retry_after_s": 5})
    slots: asyncio.Semaphore = state.ingest_slots
    if slots.locked():  # every slot busy: tell the exporter to come back (it retries 503 with backoff)
        raise Overloaded("the control plane is ingesting at capacity; retry later", details={"retry_after_s": 1})
    async with slots:
        try:
            body = await request.body()
        except ClientDisconnect:  # the exporter gave up (its timeout) mid-body: nobody is left to answer
            return Response(status_code=400, content=b"the exporter disconnected before its body arrived")
        headers = request.headers
        content_type = headers.get("content-type", "")
        encoding = headers.get("content-encoding", "")
        ingestor: Ingestor = state.ingestor
        max_bytes: int = state.settings.ingest_max_body_bytes
        if len(body) <= INLINE_MAX_BYTES and encoding.strip().lower() in ("", "identity"):
            submitted = _submit(ingestor, principal.id, body, content_type, encoding, max_bytes)
        else:
            submitted = await to_thread.run_sync(_submit, ingestor, principal.id, body, content_type, encoding,
                                                 max_bytes)  # fmt: skip
    # The slot bounded the work (body, decode, fold); waiting for the log's group fsync (or the commit) costs nothing
    # but this answer's time, so it is outside the slot: a slow disk must not make the exports behind it 503s.
    result, durable = submitted
    if not durable.done():
        try:
            await asyncio.wait_for(_settled(durable), DURABLE_WAIT_S)
        except TimeoutError:
            log.warning("agent %s: an export was not durable after %.0f s (answered 503)", principal.id,
                        DURABLE_WAIT_S)  # fmt: skip
            raise Overloaded("the control plane could not store the export in time; retry later",
                             details={"retry_after_s": 1}) from None  # fmt: skip
    if durable.exception() is not None:
        log.warning("agent %s: an export could not be stored (answered 503): %r", principal.id,
                    durable.exception())  # fmt: skip
        raise Overloaded("the control plane could not store the export; retry later",
                         details={"retry_after_s": 1})  # fmt: skip
    state.monitoring.ingested(result.accepted, result.rejected)
    reply = ExportMetricsServiceResponse()
    if result.rejected:
        reply.partial_success.CopyFrom(
            ExportMetricsPartialSuccess(rejected_data_points=result.rejected, error_message=result.message)
        )
    if _media(content_type) == "application/json":
        return Response(json_format.MessageToJson(reply), media_type="application/json")
    return Response(reply.SerializeToString(), media_type="application/x-protobuf")


def _submit(ingestor: Ingestor, agent_id: str, body: bytes, content_type: str, encoding: str,
            max_bytes: int) -> Submitted:  # fmt: skip
    message = decode(body, content_type, encoding, max_bytes)
    # The body is the message's protobuf encoding when it came as such: the ingest log keeps it as it came.
    raw = body if encoding.strip().lower() in ("", "identity") and _media(content_type) == _PROTOBUF else None
    return ingestor.submit(agent_id, message, raw=raw)


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


DURABLE_WAIT_S = 30.0  # the longest an answer waits for its export to be durable (a stuck disk or database): then 503


def _settled(future: concurrent.futures.Future[None]) -> asyncio.Future[None]:
    """Done (never failed) on this loop when `future` is, whatever its outcome; cancelling it leaves `future` be."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def wake(_: concurrent.futures.Future[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown): nobody waits
            loop.call_soon_threadsafe(settle)

    future.add_done_callback(wake)
    return waiter


class LeanRoute(APIRoute):
    """Documented from its endpoint like any route (OpenAPI: parameters, security, answers), served by
    `serve_export` alone: no dependency solving, no thread hops on the hot path."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return serve_export


router = APIRouter(tags=["telemetry"], route_class=LeanRoute)


@router.post("/v1/metrics", summary="Export metrics (OTLP/HTTP, protobuf or JSON, optionally gzip)",
             responses=_RESPONSES, response_class=Response)  # fmt: skip
async def export_metrics(request: Request, agent: AgentCaller) -> Response:
    """Each data point is stored or refused; refusals are counted and explained in `partial_success` (HTTP 200, the
    rest of the export stored). A histogram the control plane reads must come on its bounds (the duration histograms
    on SPILLWAY_LATENCY_BUCKETS_MS in seconds, the GenAI ones on the semantic conventions'), on finer bounds that
    include them (re-bucketed exactly), or, for the duration histograms, on some of them. The attribute names of
    agents before 0.2 (`model`, `model.version`, `priority`, `outcome`, `policy.source`) are stored as the namespaced
    ones (`spillway.model`, ...). The answer comes once the export is durable: in the control plane's ingest log
    (SPILLWAY_INGEST_ACK=logged, replayed after a crash) or in the rollups (`applied`)."""
    return await serve_export(request)  # what `LeanRoute` serves; this signature documents it
