"""Checked credentials kept in memory for a short while, so that the hot path asks the database once per
TTL and caller instead of once per request. Keyed by the SHA-256 of the raw header: the secret is never kept.

The price: a deleted agent, or a rotated token, keeps working through the gateway for up to the TTL.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker

from controlplane.api.auth import Principal, authenticate, authorize_agent
from controlplane.errors import Forbidden, Unauthenticated


def credential_key(authorization: bytes) -> bytes:
    return hashlib.sha256(authorization).digest()


class TokenCache:
    def __init__(self, ttl_s: float, *, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: dict[bytes, tuple[float, Principal]] = {}

    def get(self, key: bytes) -> Principal | None:
        found = self._entries.get(key)
        if found is None:
            return None
        if self.clock() >= found[0]:
            del self._entries[key]
            return None
        return found[1]

    def put(self, key: bytes, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        now = self.clock()
        if len(self._entries) >= self.max_entries:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            if len(self._entries) >= self.max_entries:  # all fresh: forget the oldest half
                keep = sorted(self._entries.items(), key=lambda kv: kv[1][0])[self.max_entries // 2 :]
                self._entries = dict(keep)
        self._entries[key] = (now + self.ttl_s, principal)

    def clear(self) -> None:
        self._entries.clear()


class AgentTokens:
    """Who may use the gateway: agents, by their token. A miss is resolved against the database in a worker
    thread (never on the event loop), and an agent's call notes its `last_seen` as the agent endpoints do."""

    def __init__(self, cache: TokenCache) -> None:
        self.cache = cache
        self.factory: sessionmaker[Session] | None = None

    async def check(self, authorization: bytes | None) -> Principal:
        """The agent behind the header; raises Unauthenticated (401) or Forbidden (403, an operator's key)."""
        if authorization is None:
            raise Unauthenticated("missing credentials: send 'Authorization: Bearer <agent token>'")
        key = credential_key(authorization)
        principal = self.cache.get(key)
        if principal is None:
            principal = await to_thread.run_sync(self._resolve, authorization.decode("latin-1"))
            self.cache.put(key, principal)
        if principal.kind != "agent":
            raise Forbidden("the gateway is for agents: send an agent token, not an operator's API key")
        return principal

    def _resolve(self, authorization: str) -> Principal:
        assert self.factory is not None, "no database yet"
        with self.factory() as session:
            principal = authenticate(session, authorization)
            if principal.kind == "agent":
                authorize_agent(session, principal)  # notes the agent's last_seen (at most once a minute)
            return principal
