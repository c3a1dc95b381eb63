"""Authentication as ASGI middleware: every request but the probes is authenticated before anything else
(routing, body parsing), so a route can never be reached without credentials, whatever it declares.

On the two paths every agent calls every few seconds, `POST /v1/metrics` and its policy poll, a verified agent
token is trusted for `SPILLWAY_AGENT_AUTH_CACHE_S` (`AgentTokenCache`): a hit costs no database read and no thread.
The price: a rotated token, or a deleted agent, keeps working on those two paths for at most that long. Operator
keys and every other path are checked against the database on each request (a revoked key stops at once).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.auth import Principal, authenticate, authorize_agent
from controlplane.errors import Unauthenticated
from controlplane.gateway.tokens import TokenCache, credential_key

PROBES = frozenset({"/healthz", "/readyz"})
INGEST_PATH = "/v1/metrics"


def agent_hot_path(path: str) -> bool:
    """`POST /v1/metrics` or `GET /api/v1/agents/{id}/policy`: the paths whose agent tokens are cached."""
    return path == INGEST_PATH or (
        path.startswith("/api/v1/agents/") and path.endswith("/policy") and path.count("/") == 5
    )


class AgentTokenCache(TokenCache):
    """Verified agent tokens, each trusted until `ttl_s` after its check: the gateway's cache (keyed by the
    SHA-256 of the raw header, bounded), holding agents only (an operator key is checked on every request)."""

    def __init__(
        self, ttl_s: float, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(ttl_s, max_entries=max_entries, clock=clock)

    key = staticmethod(credential_key)

    def put(self, key: bytes, principal: Principal) -> None:
        if principal.kind == "agent":
            super().put(key, principal)


def _check(factory: sessionmaker[Session], header: bytes | None, note_agent: bool) -> Principal:
    """The database's word on a credential (in a worker thread); an agent exporting also notes its `last_seen`."""
    with factory() as session:
        principal = authenticate(session, header.decode("latin-1") if header is not None else None)
        if note_agent and principal.kind == "agent":
            authorize_agent(session, principal)
        return principal


class Authenticate:
    def __init__(self, app: ASGIApp, cache: AgentTokenCache) -> None:
        self.app = app
        self.cache = cache

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        path = scope["path"]
        key = self.cache.key(header) if header is not None and agent_hot_path(path) else None
        principal = self.cache.get(key) if key is not None else None
        if principal is None:
            factory = scope["app"].state.sessionmaker
            try:
                principal = await to_thread.run_sync(_check, factory, header, path == INGEST_PATH)
            except Unauthenticated as exc:
                body = json.dumps({"error": exc.code, "message": exc.message, "details": None}).encode()
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
            if key is not None:
                self.cache.put(key, principal)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
