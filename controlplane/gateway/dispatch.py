"""The gateway's way in: an outermost ASGI layer that takes `POST /v2/models/{m}[/versions/{v}]/infer`,
`POST /v1/completions` and `POST /v1/chat/completions` for itself and hands everything else to the FastAPI stack, so
inference never pays for routing and middleware.

The same paths are also FastAPI routes (`gateway_router`), for the OpenAPI document and for anything that
walks the app's routes; they answer through the same `Gateway.serve` should a request ever reach them.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.gateway.forward import Gateway
from controlplane.gateway.relay import PATHS as OPENAI_PATHS
from controlplane.schemas.common import ERROR_RESPONSES, ErrorBody

_PREFIX = "/v2/models/"
_SUFFIX = "/infer"


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version or None) for the two infer paths of the Open Inference Protocol, else None."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)) or len(path) <= len(_PREFIX) + len(_SUFFIX):
        return None
    parts = path[len(_PREFIX) : -len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return parts[0], parts[2]
    return None


class GatewayDispatcher:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = infer_target(scope["path"])
            if target is not None:
                await self.gateway.serve(scope, receive, send, *target)
                return
            if scope["path"] in OPENAI_PATHS:
                await self.gateway.relay.serve(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Served(Response):
    """A response that is the gateway answering the request itself."""

    def __init__(self, gateway: Gateway, model: str, version: str | None) -> None:
        super().__init__()
        self.target = (gateway, model, version)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway, model, version = self.target
        await gateway.serve(scope, receive, send, model, version)


class _Relayed(Response):
    """A response that is the gateway's OpenAI-compatible relay answering the request itself."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.relay.serve(scope, receive, send)


_OPENAPI: dict[str, Any] = {
    "security": [{"HTTPBearer": []}],  # an agent token
    "requestBody": {
        "required": True,
        "description": "an Open Inference Protocol (KServe V2) inference request, forwarded unchanged: JSON, or "
        "JSON followed by binary tensors with `Inference-Header-Content-Length`",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    **{status: ERROR_RESPONSES[status] for status in (400, 401, 403, 404, 413)},
    200: {
        "description": "the backend's answer: as it came from a `v2` backend; from a `v2_grpc` one, its "
        "ModelInferResponse as V2 JSON or binary tensors, as the request asked (headers spillway-backend, "
        "spillway-attempts)"
    },
    502: {"model": ErrorBody, "description": "backend_unavailable or bad_backend_response (or a backend's 502)"},
    503: {"model": ErrorBody, "description": "no_backend, no_healthy_backend or no_capacity (or a backend's 503)"},
    504: {"model": ErrorBody, "description": "deadline_exceeded (or a backend's 504)"},
}


_OPENAI_ERROR = {
    "type": "object",
    "description": "OpenAI's error shape; `code`: no_backend, backend_failed, deadline_exceeded, or the gateway's "
    "own (invalid_request, unauthenticated, ...); the header spillway-reason has the gateway's precise reason",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "string"}}}},
}  # fmt: skip
_OPENAI_OPENAPI: dict[str, Any] = {
    "security": [{"HTTPBearer": []}],  # an agent token
    "requestBody": {
        "required": True,
        "description": "an OpenAI completion or chat completion request; `model` is the edge's name for the model, "
        "which each backend gets as its own (`model_map`)",
        "content": {"application/json": {"schema": {"type": "object", "required": ["model"]}}},
    },
}
_OPENAI_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the backend's answer relayed as it arrives (JSON, or server-sent events); a backend that "
          "fails mid-answer leaves an error event and no `data: [DONE]` (headers spillway-backend, spillway-attempts)",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **{status: {"description": text, "content": {"application/json": {"schema": _OPENAI_ERROR}}} for status, text in (
        (400, "invalid_request or invalid_model_name"), (401, "unauthenticated: no or an invalid agent token"),
        (403, "forbidden: not an agent token"), (413, "payload_too_large"),
        (502, "backend_failed: every attempt failed before the first byte"),
        (503, "no_backend: none registered, healthy or with capacity (or the last backend's 503)"),
        (504, "deadline_exceeded: no first byte within spillway-timeout-us"))},
}  # fmt: skip


def gateway_router() -> APIRouter:
    router = APIRouter(tags=["gateway"])
    summary = "Infer on a cloud backend (agents only)"

    @router.post("/v2/models/{model}/infer", summary=summary, responses=_RESPONSES, openapi_extra=_OPENAPI,
                 response_class=Response)  # fmt: skip
    async def infer(model: str, request: Request) -> Response:
        return _Served(request.app.state.gateway, model, None)

    @router.post("/v2/models/{model}/versions/{version}/infer", summary=summary, responses=_RESPONSES,
                 openapi_extra=_OPENAPI, response_class=Response)  # fmt: skip
    async def infer_version(model: str, version: str, request: Request) -> Response:
        return _Served(request.app.state.gateway, model, version)

    relay = "Relay to an OpenAI-compatible cloud backend (agents only)"

    @router.post("/v1/completions", summary=relay, responses=_OPENAI_RESPONSES, openapi_extra=_OPENAI_OPENAPI,
                 response_class=Response)  # fmt: skip
    async def completions(request: Request) -> Response:
        return _Relayed(request.app.state.gateway)

    @router.post("/v1/chat/completions", summary=relay, responses=_OPENAI_RESPONSES, openapi_extra=_OPENAI_OPENAPI,
                 response_class=Response)  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return _Relayed(request.app.state.gateway)

    return router


class NotGatewayAccess(logging.Filter):
    """Drops uvicorn access-log records of the gateway's inference requests (`POST /v2/models/.../infer`, and the
    relay's `/v1/completions` and `/v1/chat/completions`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            path = args[2].split("?", 1)[0]
            return not ((path.startswith("/v2/models/") and path.endswith("/infer")) or path in OPENAI_PATHS)
        return True
