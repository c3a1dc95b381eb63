"""Request body limit as plain ASGI: refuses by Content-Length up front, or as soon as a streamed body passes it."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from `receive` so that the framework answers 413 through its usual error handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


class BodyLimit:
    """413 for bodies over `max_bytes`, without ever holding more than `max_bytes` of one."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.per_path.get(scope["path"], self.default_max_bytes)
        if "\x00" in scope["path"] or b"%00" in scope["query_string"].lower():
            await self._send_error(send, 400, "bad_request", "NUL characters are not allowed in URLs", None)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > max_bytes:
                    await self._refuse(send, max_bytes)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, max_bytes)

    async def _refuse(self, send: Send, max_bytes: int) -> None:
        message = f"request body exceeds {max_bytes} bytes"
        await self._send_error(send, 413, "payload_too_large", message, {"max_bytes": max_bytes})

    @staticmethod
    async def _send_error(send: Send, status: int, code: str, message: str, details: object) -> None:
        body = json.dumps({"error": code, "message": message, "details": details}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
