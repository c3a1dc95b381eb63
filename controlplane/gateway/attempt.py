"""What the gateway's two paths (V2 infer, forward.py; the OpenAI-compatible relay, relay.py) share about one
try at one backend: how a retriable failure is kept, the headers that say who answered, and the per-backend metric
children."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from controlplane.errors import SpillwayError
from controlplane.gateway.backend import BackendSpec, BackendState
from controlplane.monitoring import GatewayMetrics

RETRIABLE_STATUS = frozenset({502, 503, 504})
INLINE_JSON = 256 << 10  # request JSON up to this size is parsed on the event loop
DEADLINE_MARGIN_S, DEADLINE_MARGIN_SHARE = 0.010, 0.1  # kept back from the backend's share of the deadline
JSON = b"application/json"


async def refuse(send: Send, exc: SpillwayError, body: bytes) -> None:
    """Answer `exc` with `body` (each path's own error shape): the status, the code in `spillway-reason`, and the
    headers that go with it (WWW-Authenticate on a 401, Retry-After on a 429 or 503, who was tried last after
    attempts)."""
    headers = [(b"content-type", JSON), (b"content-length", str(len(body)).encode()),
               (b"spillway-reason", exc.code.encode())]  # fmt: skip
    if exc.status_code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    elif exc.status_code in (429, 503):
        headers.append((b"retry-after", b"1"))
    elif exc.status_code == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    if isinstance(exc.details, dict) and "attempts" in exc.details:
        headers += [(b"spillway-backend", str(exc.details["last_backend"]).encode()),
                    (b"spillway-attempts", str(exc.details["attempts"]).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Failure:
    """A retriable attempt: a transport failure or a 502/503/504, kept to answer with if it is the last."""

    kind: str  # connect | reset | timeout | status_5xx
    message: str
    backend: BackendSpec
    status: int | None = None
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()


Attempt = Callable[[BackendState, float, int], Awaitable[Failure | None]]
"""One try at one backend: (backend, seconds it may take, attempt number) -> None (answered) or a retriable Failure."""
GiveUp = Callable[[Failure, int, str], Awaitable[None]]
"""Answers with the last failure: (failure, attempts, why no other backend was tried)."""


class Instruments:
    """One backend's labelled metric children, made once (a `.labels()` lookup costs microseconds)."""

    def __init__(self, metrics: GatewayMetrics, name: str) -> None:
        self.metrics = metrics
        self.name = name
        self.outstanding = metrics.outstanding.labels(name)
        self.duration = metrics.duration.labels(name)
        self._codes: dict[str, Any] = {}
        self._kinds: dict[str, Any] = {}

    def attempt(self, code: str, failure: str | None, seconds: float) -> None:
        counter = self._codes.get(code)
        if counter is None:
            counter = self._codes[code] = self.metrics.requests.labels(self.name, code)
        counter.inc()
        if failure is not None:
            kind = self._kinds.get(failure)
            if kind is None:
                kind = self._kinds[failure] = self.metrics.errors.labels(self.name, failure)
            kind.inc()
        self.duration.observe(seconds)


def answer_headers(spec: BackendSpec, attempts: int) -> list[tuple[bytes, bytes]]:
    return [(b"spillway-backend", spec.name.encode()), (b"spillway-backend-id", spec.id.encode()),
            (b"spillway-attempts", str(attempts).encode())]  # fmt: skip


def failure_details(last: Failure | None, attempts: int) -> dict[str, Any] | None:
    if last is None:
        return None
    return {"attempts": attempts, "last_backend": last.backend.name, "last_error": last.message}
