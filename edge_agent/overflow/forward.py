"""Overflow: send a request the agent will not serve itself to the control plane's gateway, which hands it to a
cloud backend, behind a local circuit breaker and a cap on requests in flight.

The body goes unchanged (JSON or binary tensors) to the same path on the gateway, with the agent's token, the
request's tenant (`spillway-tenant`: the gateway may cap a tenant's share of a backend) and the request's remaining
deadline less a margin (`Spillway-Timeout-Us`), and the attempt itself is bounded by that deadline
and a grace for an answer on its way back (LATE_GRACE_S). Any
answer but a 200 is a failure the caller turns into its local fallback; so is an open breaker or a full cap,
without a network round trip. aiohttp is imported when the first request overflows.

Generative answers go through the same client, breaker and cap as streams (`open_stream`, stream.py): the deadline
is the first byte's, and between chunks the stream may stay silent at most `idle_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_agent.overflow.breaker import BreakerConfig, CircuitBreaker
from edge_agent.overflow.stream import ForwardedStream
from spillway.contract import names

if TYPE_CHECKING:
    import aiohttp

# Refusals that say the cloud is busy right now, not broken: they do not count against it in the breaker. A 429
# (a full TGI or vLLM, OpenAI's rate limit) is busy whatever code its body gives (`_code`).
BUSY = frozenset({"deadline_unmeetable", "queue_full", "no_capacity", "shed", "timeout", "deadline_exceeded", "429",
                  "rate_limit_exceeded"})  # fmt: skip
MARGIN_S, MARGIN_SHARE = 0.020, 0.2  # of the deadline, kept back from the gateway's share (at most 20 ms)
# The gateway answers by the deadline less the margin, but on a busy machine (either process waiting for a core) its
# answer can still land after the deadline: it is taken for this long after it. Only silence beyond is the gateway's
# failure in the breaker; counting a late 504 as one opened the breaker under CPU contention with the gateway well.
LATE_GRACE_S = 0.1
# Headers of the gateway's answer that the agent passes on to its client.
_PASSED_ON = ("content-type", "inference-header-content-length", "spillway-backend", "spillway-attempts")


@dataclass(frozen=True)
class Forwarded:
    """The gateway's 200: the body as the backend answered, and the headers worth passing on."""

    body: bytes
    headers: dict[str, str]
    elapsed_s: float


@dataclass(frozen=True)
class NotForwarded:
    """Why the overflow did not produce an answer: `reason` is a stable code, `message` says more."""

    reason: (
        str  # breaker_open | overflow_busy | deadline_passed | gateway_unreachable | gateway_timeout | gateway_<code>
    )
    message: str
    retry_after_s: float = 1.0


class Forwarder:
    """One gateway, one pooled HTTP client, one breaker. Used from the agent's event loop only."""

    def __init__(
        self,
        gateway: str,
        token: str,
        *,
        breaker: BreakerConfig,
        max_in_flight: int = 256,
        default_timeout_s: float = 30.0,
        on_breaker_change: Callable[[str, str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self._auth = f"Bearer {token}"
        self.breaker = CircuitBreaker(breaker, clock=clock, on_change=on_breaker_change)
        self.max_in_flight = max_in_flight
        self.default_timeout_s = default_timeout_s
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.in_flight = 0
        self.sent = 0
        self.answered = 0
        self.failed: dict[str, int] = {}

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.max_in_flight, keepalive_timeout=30, ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  skip_auto_headers=("User-Agent",))  # fmt: skip
        return self._session

    async def forward(
        self, path: str, body: bytes, headers: dict[str, str], remaining_s: float | None, *, tenant: str | None = None
    ) -> Forwarded | NotForwarded:
        """Send `body` to `path` on the gateway within `remaining_s` (None: the default timeout), on behalf of
        `tenant` (None: the header is not sent)."""
        budget = self.default_timeout_s if remaining_s is None else remaining_s
        refused = self._refused(budget)
        if refused is not None:
            return refused
        import aiohttp

        sent = self._headers(headers, budget, tenant)
        self.in_flight += 1
        self.sent += 1
        started = self._clock()
        try:
            async with self._session_now().post(
                self.gateway + path, data=body, headers=sent, timeout=aiohttp.ClientTimeout(total=budget + LATE_GRACE_S)
            ) as response:
                payload = await response.read()
                elapsed = self._clock() - started
                if response.status == 200:
                    self.breaker.record(True, elapsed)
                    self.answered += 1
                    kept = {k: response.headers[k] for k in _PASSED_ON if k in response.headers}
                    return Forwarded(payload, kept, elapsed)
                code = _code(response.status, response.headers.get("spillway-reason"), payload)
                if code in BUSY or response.status == 429:
                    self.breaker.release()  # the cloud is full, not failing: no verdict on its health
                else:
                    self.breaker.record(False, elapsed)
                retry = _retry_after(response.headers.get("retry-after"))
                return self._fail(f"gateway_{code}", f"the gateway answered {response.status}: {_brief(payload)}",
                                  retry_after_s=retry)  # fmt: skip
        except asyncio.TimeoutError:
            self.breaker.record(False, self._clock() - started)
            waited_ms = (budget + LATE_GRACE_S) * 1e3
            return self._fail("gateway_timeout", f"the gateway did not answer within {waited_ms:.0f} ms")
        except aiohttp.ClientError as exc:
            self.breaker.record(False, self._clock() - started)
            return self._fail("gateway_unreachable", f"the gateway could not be reached: {exc}")
        except asyncio.CancelledError:
            self.breaker.release()
            raise
        finally:
            self.in_flight -= 1

    async def open_stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        first_byte_s: float | None,
        *,
        idle_s: float | None = None,
        tenant: str | None = None,
    ) -> ForwardedStream | NotForwarded:
        """Send `body` to `path` on the gateway and wait for the first bytes of its answer's body within
        `first_byte_s` (None: the default timeout); then the caller reads the rest (`ForwardedStream.rest`) and
        ends it with `finish`. Between chunks the stream may be silent `idle_s` (None: the default timeout).
        `tenant`: the request's (None: the header is not sent)."""
        budget = self.default_timeout_s if first_byte_s is None else first_byte_s
        refused = self._refused(budget)
        if refused is not None:
            return refused
        import aiohttp

        sent = self._headers(headers, budget, tenant)
        idle = self.default_timeout_s if idle_s is None else idle_s
        self.in_flight += 1
        self.sent += 1
        started = self._clock()
        response: aiohttp.ClientResponse | None = None
        handed_over = False

        def done() -> None:
            self.in_flight -= 1

        try:
            response = await asyncio.wait_for(
                self._session_now().post(self.gateway + path, data=body, headers=sent,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=idle)),
                budget + LATE_GRACE_S,
            )  # fmt: skip
            if response.status != 200:
                payload = await asyncio.wait_for(response.read(), max(budget + LATE_GRACE_S - (self._clock() - started),
                                                                      LATE_GRACE_S))  # fmt: skip
                elapsed = self._clock() - started
                code = _code(response.status, response.headers.get("spillway-reason"), payload)
                if code in BUSY or response.status == 429:
                    self.breaker.release()
                else:
                    self.breaker.record(False, elapsed)
                retry = _retry_after(response.headers.get("retry-after"))
                return self._fail(f"gateway_{code}", f"the gateway answered {response.status}: {_brief(payload)}",
                                  retry_after_s=retry)  # fmt: skip
            left = budget + LATE_GRACE_S - (self._clock() - started)
            first = await asyncio.wait_for(response.content.readany(), max(left, 0.001))
            if not first:
                self.breaker.record(False, self._clock() - started)
                return self._fail("gateway_empty", "the gateway's answer ended before its first byte")
            kept = {k: response.headers[k] for k in _PASSED_ON if k in response.headers}
            handed_over = True
            self.answered += 1
            return ForwardedStream(response.status, kept, first, self._clock() - started, response, self.breaker, done)
        except asyncio.TimeoutError:
            self.breaker.record(False, self._clock() - started)
            waited_ms = (budget + LATE_GRACE_S) * 1e3
            return self._fail("gateway_timeout", f"the gateway sent no byte within {waited_ms:.0f} ms")
        except aiohttp.ClientError as exc:
            self.breaker.record(False, self._clock() - started)
            return self._fail("gateway_unreachable", f"the gateway could not be reached: {exc}")
        except asyncio.CancelledError:
            self.breaker.release()
            raise
        finally:
            if not handed_over:
                if response is not None:
                    response.close()
                done()

    def _refused(self, budget_s: float) -> NotForwarded | None:
        """Why an overflow is not even tried now, without a round trip: the cap on overflows in flight, no time left,
        the open breaker (asked last: a half-open breaker's `allow` takes its one probe)."""
        if self.in_flight >= self.max_in_flight:
            return self._fail("overflow_busy", f"{self.in_flight} requests are already overflowing (the cap)")
        if budget_s <= 0.001:
            return self._fail("deadline_passed", "no time is left of the request's deadline to overflow it")
        if not self.breaker.allow():
            return self._fail("breaker_open", "the overflow breaker is open: the gateway failed or was slow lately",
                              retry_after_s=max(1.0, self.breaker.config.open_s))  # fmt: skip
        return None

    def _headers(self, headers: dict[str, str], budget_s: float, tenant: str | None = None) -> dict[str, str]:
        """`headers` with the agent's token, the tenant, and the deadline less a margin, so that the gateway says "too
        late" (504, the cloud was busy) before this side gives up on it (a timeout here means the gateway itself did
        not answer: a failure)."""
        margin = min(MARGIN_S, budget_s * MARGIN_SHARE)
        sent = {**headers, "authorization": self._auth, "spillway-timeout-us": str(int((budget_s - margin) * 1e6))}
        if tenant is not None:
            sent[names.H_TENANT] = tenant
        return sent

    def _fail(self, reason: str, message: str, retry_after_s: float = 1.0) -> NotForwarded:
        self.failed[reason] = self.failed.get(reason, 0) + 1
        return NotForwarded(reason, message, retry_after_s)

    def json(self) -> dict[str, Any]:
        return {
            "gateway": self.gateway,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "sent": self.sent,
            "answered": self.answered,
            "failed": dict(self.failed),
            "breaker": self.breaker.json(),
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _code(status: int, reason: str | None, payload: bytes) -> str:
    """The refusal's stable code: the gateway's `spillway-reason`, else the body's code, else the status."""
    return reason or _error_code(payload) or str(status)


def _error_code(payload: bytes) -> str | None:
    """A stable error code in the body: an agent's `reason`, or the control plane's `error` (`no_capacity`)."""
    import json

    try:
        body = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    for key in ("reason", "error"):
        code = body.get(key)
        if key == "error" and isinstance(code, dict):  # OpenAI's shape: {"error": {"message", "type", "code"}}
            code = code.get("code")
        if isinstance(code, str) and code.isidentifier() and len(code) <= 64:
            return code
    return None


def _retry_after(value: str | None) -> float:
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def _brief(payload: bytes, limit: int = 200) -> str:
    text = payload[:limit].decode("utf-8", "replace")
    return text + ("..." if len(payload) > limit else "")
