"""The gateway's OpenAI-compatible relay: `POST /v1/completions` and `POST /v1/chat/completions` from edge agents,
to the `openai` backends that serve the model (vLLM, TGI, llama.cpp's server, a Spillway agent in cloud role).

The choice of backend, the retries and the retry budget are the V2 path's (`Gateway.forward`, the pool). What
differs is the answer, which is a stream of tokens:
- The request's `model` is the edge's name; each backend gets its own name for it (`model_map`).
- Another backend is tried only before the first byte of the answer's body: the deadline (`spillway-timeout-us`, else
  the backend's `timeout_ms`) bounds the wait for it (time to first token, for a stream). Headers alone are not an
  answer: a backend that sends them and then nothing is retried elsewhere, as nothing has reached the client yet.
- From then on the body is relayed chunk by chunk as it arrives (server-sent events a whole event at a time), never
  gathered. A backend that fails mid-answer (the connection drops, or no chunk within its `timeout_ms`) leaves the
  client one OpenAI-shaped error event and an end without `data: [DONE]`, never a stream that looks complete; the
  failure counts against the backend (outlier ejection).
- What the gateway answers itself is OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with
  the gateway's precise reason in `spillway-reason` (docs/overflow/gateway.md); a tenant over its share of the backends
  (429, reason `tenant_quota`) gets OpenAI's rate-limit shape, `code: rate_limit_exceeded`, `type: requests`.
- The request's tenant (`spillway-tenant`) is passed on and counted against each backend's `tenant_share`, as on the
  V2 path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from anyio import to_thread
from starlette.types import Message, Receive, Scope, Send

from controlplane.errors import InvalidRequest, SpillwayError
from controlplane.gateway.attempt import (
    DEADLINE_MARGIN_S,
    DEADLINE_MARGIN_SHARE,
    INLINE_JSON,
    RETRIABLE_STATUS,
    Failure,
    answer_headers,
    failure_details,
    refuse,
)
from controlplane.gateway.backend import BackendSpec, BackendState
from controlplane.gateway.deadline import read_body, timeout_header_us
from controlplane.gateway.errors import (
    BackendUnavailable,
    BadBackendResponse,
    InvalidModelName,
    NoCapacity,
    Refusal,
    TenantQuota,
)
from controlplane.gateway.tenant import quota_tenant, request_tenant
from spillway.contract.v2 import ClientGone

if TYPE_CHECKING:
    from controlplane.gateway.forward import Gateway

log = logging.getLogger("spillway.controlplane.gateway")

PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PROTOCOL = "openai"
_WATCHED_MESSAGES = 1000  # messages after the body before the watcher stops watching a server that sends them
_HOLD_LIMIT = 1 << 20  # an unfinished server-sent event held back longer than this is passed on as it is
_PASSED_ON = frozenset(
    {b"content-type", b"content-encoding", b"cache-control", b"retry-after", b"spillway-reason", b"spillway-outcome"}
)  # not content-length: a body cut off mid-answer ends with an error event the length would not allow
_EVENT_STREAM = b"text/event-stream"
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_TOO_MANY = 429  # a backend at its concurrency limit (TGI, vLLM behind a router): busy


def error_event(message: str) -> bytes:
    """The server-sent event that ends a stream whose backend failed mid-answer (no `[DONE]` follows)."""
    error = {"message": message, "type": "server_error", "param": None, "code": "backend_failed"}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


def openai_error(exc: SpillwayError) -> dict[str, Any]:
    """A refusal in OpenAI's shape. `code`: no_backend, no_healthy_backend or no_capacity (no backend could take it;
    no_capacity also when every backend tried was busy, refusing with Retry-After: the agent's breaker does not
    count that against the cloud), backend_failed (every attempt failed), deadline_exceeded, else the gateway's own
    code (invalid_request, unauthenticated, ...)."""
    status = exc.status_code
    if isinstance(exc, TenantQuota):  # OpenAI's own shape of a rate limit: clients' SDKs know it
        return {"error": {"message": exc.message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    if isinstance(exc, Refusal):
        code = exc.code
    elif isinstance(exc, BackendUnavailable | BadBackendResponse):
        code = "backend_failed"
    else:
        code = exc.code
    if status == 401:
        kind = "authentication_error"
    elif status == 403:
        kind = "permission_error"
    elif status < 500:
        kind = "invalid_request_error"
    else:
        kind = "server_error"
    param = exc.details.get("param") if isinstance(exc.details, dict) else None
    if isinstance(exc, InvalidModelName):
        param = "model"
    return {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}


@dataclass
class _Call:
    """One client request, parsed once for all its attempts."""

    path: str
    body: bytes
    doc: dict[str, Any]
    model: str
    accept: str | None
    tenant: str | None = None  # as the agent named it (`spillway-tenant`, checked); None: none named
    _bodies: dict[str, bytes] = field(default_factory=dict, repr=False)

    def payload(self, spec: BackendSpec) -> bytes:
        """The body for `spec`: the request as it came, with the backend's name for the model."""
        cloud = spec.cloud_model(self.model)
        if cloud == self.model:
            return self.body
        body = self._bodies.get(cloud)
        if body is None:
            body = self._bodies[cloud] = orjson.dumps({**self.doc, "model": cloud})
        return body


class _Events:
    """Holds back the unfinished tail of a server-sent event stream, so that what the client has is always whole
    events: an error event written after a failure then starts on a line of its own, not inside a broken event."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = b""

    def whole(self, chunk: bytes) -> bytes:
        data = self.held + chunk if self.held else chunk
        if data.endswith(b"\n\n"):
            self.held = b""
            return data
        end = 0
        for separator in _EVENT_ENDS:
            at = data.rfind(separator)
            if at >= 0:
                end = max(end, at + len(separator))
        if len(data) - end > _HOLD_LIMIT:
            end = len(data)
        self.held = data[end:]
        return data[:end]


class _Watch:
    """Cancels the request's task if the client disconnects while its answer is relayed (uvicorn's `send` to a
    gone client does nothing, so only `receive` tells): the backend stops generating for nobody."""

    __slots__ = ("gone", "task", "watcher")

    def __init__(self) -> None:
        self.gone = False
        self.task = asyncio.current_task()
        self.watcher: asyncio.Task[None] | None = None

    def start(self, receive: Receive) -> None:
        if self.task is not None:
            self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        for _ in range(_WATCHED_MESSAGES):  # after the body, a server sends nothing but the disconnect
            if (await receive())["type"] == "http.disconnect":
                break
        else:
            return
        self.gone = True
        assert self.task is not None
        self.task.cancel()

    async def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        if self.gone:  # a cancellation the request's task has not seen yet would end it cancelled: take it here
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
            _uncancel(self.task)


class OpenAIRelay:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one `POST /v1/completions` or `POST /v1/chat/completions`."""
        sent = False

        async def tracking(message: Message) -> None:
            nonlocal sent
            sent = True
            await send(message)

        watch = _Watch()
        try:
            await self._serve(scope, receive, tracking, watch)
        except ClientGone:
            return
        except asyncio.CancelledError:
            if not watch.gone:
                raise
        except SpillwayError as exc:
            if not sent:
                await self._refuse(send, exc)
        except Exception:
            log.exception("gateway: unexpected error on %s", scope["path"])
            if not sent:
                await self._refuse(send, SpillwayError("internal error; the server log has the details"))
        finally:
            await watch.stop()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, watch: _Watch) -> None:
        gateway = self.gateway
        authorization = timeout = declared = accept = tenant_header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"spillway-tenant":
                tenant_header = value
            elif name == b"spillway-timeout-us":
                timeout = value
            elif name == b"content-length":
                declared = value
            elif name == b"accept":
                accept = value
        await gateway.tokens.check(authorization)
        body = await read_body(receive, declared, gateway.config.max_body_bytes)
        doc = _parse(body) if len(body) <= INLINE_JSON else await to_thread.run_sync(_parse, body)
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model: required, the name of the model (a string)", {"param": "model"})
        limit_us = timeout_header_us(timeout)
        await gateway.catalog.current(model, PROTOCOL)
        tenant = request_tenant(tenant_header)
        call = _Call(scope["path"], body, doc, model, None if accept is None else accept.decode("latin-1"), tenant)
        watch.start(receive)
        await gateway.forward(model, limit_us, partial(self._attempt, send, call), self._give_up, PROTOCOL,
                              quota_tenant(tenant))  # fmt: skip

    async def _attempt(
        self, send: Send, call: _Call, state: BackendState, timeout_s: float, attempt: int
    ) -> Failure | None:
        """One try at one backend. None: answered (or ended with an error event mid-answer); a Failure: retriable,
        nothing has been sent to the client."""
        gateway = self.gateway
        spec = state.spec
        instruments = gateway.instruments_of(spec)
        try:
            payload = call.payload(spec)
            # A Spillway agent in cloud role refuses at once what it cannot start in time (see forward.py).
            margin = min(DEADLINE_MARGIN_S, timeout_s * DEADLINE_MARGIN_SHARE)
            headers = {"Content-Type": "application/json",
                       "Spillway-Timeout-Us": str(max(1, int((timeout_s - margin) * 1e6)))}  # fmt: skip
            if call.accept is not None:
                headers["Accept"] = call.accept
            if call.tenant is not None:
                headers["Spillway-Tenant"] = call.tenant
            if spec.auth_header:
                headers["Authorization"] = spec.auth_header
            read_timeout = aiohttp.ClientTimeout(total=None, sock_read=spec.timeout_ms / 1000)
        except BaseException:
            gateway.pool.release(state)  # never sent: nothing to learn about the backend
            raise
        instruments.outstanding.inc()
        began = gateway.clock()
        failure: str | None = None
        error: str | None = None
        code = "error"
        busy = streaming = False
        events: _Events | None = None
        response: aiohttp.ClientResponse | None = None
        first_at: float | None = None
        try:
            opening = self._open(spec.url + call.path, payload, headers, read_timeout)
            opened, first = await asyncio.wait_for(opening, timeout_s)
            first_at = gateway.clock()
            response = opened
            status = opened.status
            code = str(status)
            # Busy, not broken: a 503 with Retry-After (a cloud agent that cannot start it in time) or a 429 (TGI,
            # vLLM's router at their concurrency limits). Tried elsewhere, never counted against the backend.
            busy = (status == 503 and "retry-after" in opened.headers) or status == _TOO_MANY
            if status >= 500 and not busy:
                failure, error = "status_5xx", f"answered {status}"
            if status in RETRIABLE_STATUS or busy:
                kind = "busy" if busy else "status_5xx"
                return Failure(kind, f"backend '{spec.name}' answered {status}", spec, 503 if busy else status)
            if not first and 200 <= status < 300:  # an empty success is no answer: nothing reached the client yet
                failure, code, error = "reset", "empty", f"answered {status} with an empty body"
                return Failure(failure, f"backend '{spec.name}': {error}", spec)
            passed = [(k.lower(), v) for k, v in opened.raw_headers if k.lower() in _PASSED_ON]
            ctype = opened.headers.get("content-type", "").encode("latin-1")
            if ctype.startswith(_EVENT_STREAM) and "content-encoding" not in opened.headers:
                events = _Events()
            await send({"type": "http.response.start", "status": status,
                        "headers": passed + answer_headers(spec, attempt)})  # fmt: skip
            streaming = True
            chunk = first
            while chunk:
                out = chunk if events is None else events.whole(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                chunk = await opened.content.readany()
            if events is not None and events.held:
                await send({"type": "http.response.body", "body": events.held, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return None
        except asyncio.TimeoutError:
            failure, code = "timeout", "timeout"
            if streaming:
                error = f"no chunk within {spec.timeout_ms} ms"
            else:
                error = f"no first byte within {timeout_s * 1000:.0f} ms"
        except aiohttp.ClientConnectorError as exc:
            failure, code, error = "connect", "connect", f"could not connect: {exc.os_error}"
        except aiohttp.ClientError as exc:
            failure, code, error = "reset", "reset", f"connection failed: {type(exc).__name__}: {exc}"
        finally:
            if response is not None:
                response.close()
            # The backend's time to the first byte of its answer (what the pool's latency figures and the attempt
            # histogram mean for a relay); a stream's own length is the client's and the model's, not the backend's.
            seconds = (gateway.clock() if first_at is None else first_at) - began
            instruments.outstanding.dec()
            instruments.attempt(code, failure, seconds)
            gateway.pool.release(state, failure=failure, error=error, seconds=seconds, busy=busy)
        assert failure is not None and error is not None
        if streaming:
            log.warning("gateway: backend %s failed mid-answer (%s); the client gets an error event", spec.name, error)
            message = f"backend '{spec.name}' failed mid-answer: {error}"
            await send({"type": "http.response.body", "body": error_event(message), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return None
        return Failure(failure, f"backend '{spec.name}': {error}", spec)

    async def _open(
        self, url: str, payload: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """The backend's answer and the first chunk of its body (b"" for an empty body, or a retriable status)."""
        response = await self.gateway.http().post(url, data=payload, headers=headers, timeout=timeout)
        try:
            retried = response.status in RETRIABLE_STATUS or response.status == _TOO_MANY
            first = b"" if retried else await response.content.readany()
        except BaseException:
            response.close()
            raise
        return response, first

    async def _give_up(self, last: Failure, attempts: int, why: str) -> None:
        """Every attempt failed before the first byte: OpenAI's shape, with the last backend's status if it gave one
        (a 502, 503 or 504), else 502."""
        message = f"{attempts} attempt{'s' if attempts > 1 else ''} failed and {why}; the last: {last.message}"
        if last.kind == "busy":  # the cloud is busy, not broken: 503 no_capacity, as when all are at max_concurrency
            raise NoCapacity(message, failure_details(last, attempts))
        exc = BackendUnavailable(message, failure_details(last, attempts))
        if last.status is not None:
            exc.status_code = last.status
        raise exc

    async def _refuse(self, send: Send, exc: SpillwayError) -> None:
        self.gateway.metrics.rejected.labels(exc.code).inc()
        await refuse(send, exc, orjson.dumps(openai_error(exc)))


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    """Python 3.11+ counts cancellations; the watcher's, once taken, must not linger in the count."""
    if sys.version_info >= (3, 11) and task is not None:
        if task.cancelling():
            task.uncancel()


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("body: must be a JSON object")
    return doc
