"""One place that turns every failure into JSON `{"error", "message", "details"}` with the right status."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.api.methods import allowed_methods
from controlplane.errors import SpillwayError, ValidationFailed

log = logging.getLogger("spillway.controlplane")

_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def error_response(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": code, "message": message, "details": details}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpillwayError)
    async def _domain(_: Request, exc: SpillwayError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        if exc.status_code in (429, 503):
            retry = exc.details.get("retry_after_s", 1) if isinstance(exc.details, dict) else 1
            headers = {"Retry-After": str(retry)}
        return error_response(exc.status_code, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        failed = ValidationFailed.of(exc.errors())
        return error_response(422, failed.code, failed.message, failed.details)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = _CODES.get(exc.status_code, HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"))
        message = str(exc.detail)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be parsed: send UTF-8 encoded JSON"
        if exc.status_code == 405 and (allowed := allowed_methods(request.app, request.scope)):
            # No route declares OPTIONS: the path exists (else 404), so this is the answer to it.
            if request.method == "OPTIONS":
                return Response(status_code=204, headers={"Allow": ", ".join(allowed)})
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            message = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
        return error_response(exc.status_code, code, message, None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal error; the server log has the details")
