"""Authentication as ASGI middleware: every request but the probes is authenticated before anything else
(routing, body parsing), so a route can never be reached without credentials, whatever it declares.

On the two paths every agent calls every few seconds, `POST /v1/metrics` and its policy poll, a verified agent
token is trusted for `SPILLWAY_AGENT_AUTH_CACHE_S` (`AgentTokenCache`): a hit costs no database read and no thread.
The price: a rotated token, or a deleted agent, keeps working on those two paths for at most that long. Operator
keys and every other path are checked against the database on each request (a revoked key stops at once).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.auth import Principal, authenticate, authorize_agent
from controlplane.errors import Unauthenticated

PROBES = frozenset({"/healthz", "/readyz"})
INGEST_PATH = "/v1/metrics"


def agent_hot_path(path: str) -> bool:
    """`POST /v1/metrics` or `GET /api/v1/agents/{id}/policy`: the paths whose agent tokens are cached."""
    return path == INGEST_PATH or (
        path.startswith("/api/v1/agents/") and path.endswith("/policy") and path.count("/") == 5
    )


class AgentTokenCache:
    """Verified agent tokens, each trusted until `ttl_s` after its check. Keyed by the SHA-256 of the raw header:
    the secret itself is never kept. Bounded: past `max_entries` the expired entries go, then the oldest half."""

    def __init__(
        self, ttl_s: float, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: dict[bytes, tuple[float, Principal]] = {}

    @staticmethod
    def key(authorization: bytes) -> bytes:
        return hashlib.sha256(authorization).digest()

    def get(self, key: bytes) -> Principal | None:
        found = self._entries.get(key)
        if found is None:
            return None
        if self.clock() >= found[0]:
            del self._entries[key]
            return None
        return found[1]

    def put(self, key: bytes, principal: Principal) -> None:
        if self.ttl_s <= 0 or principal.kind != "agent":
            return
        now = self.clock()
        if len(self._entries) >= self.max_entries:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            if len(self._entries) >= self.max_entries:
                kept = sorted(self._entries.items(), key=lambda kv: kv[1][0])[self.max_entries // 2 :]
                self._entries = dict(kept)
        self._entries[key] = (now + self.ttl_s, principal)


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
