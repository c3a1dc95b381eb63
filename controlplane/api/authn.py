"""Authentication as ASGI middleware: every request but the probes is authenticated before anything else
(routing, body parsing), so a route can never be reached without credentials, whatever it declares."""

from __future__ import annotations

import json

from anyio import to_thread
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.auth import authenticate
from controlplane.errors import Unauthenticated

PROBES = frozenset({"/healthz", "/readyz"})


class Authenticate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        factory = scope["app"].state.sessionmaker

        def check() -> object:
            with factory() as session:
                return authenticate(session, header.decode("latin-1") if header is not None else None)

        try:
            principal = await to_thread.run_sync(check)
        except Unauthenticated as exc:
            body = json.dumps({"error": exc.code, "message": exc.message, "details": None}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
