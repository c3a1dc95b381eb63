"""The gateway's async shell: authenticate, read the body, pick a backend, forward, retry elsewhere on a
retriable failure while the deadline and the retry budget allow, stream the answer back. A V2 request goes to `v2`
backends over HTTP and to `v2_grpc` ones as a gRPC ModelInfer (grpc_backend.py), which may be peers.

Plain ASGI on purpose: the FastAPI stack (routing, dependencies, middleware) would cost more than the
whole millisecond the gateway may add. Decisions are the pool's (pool.py); this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import aiohttp
import orjson
from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Message, Receive, Scope, Send

from controlplane.db.models import utcnow
from controlplane.errors import InvalidRequest, SpillwayError
from controlplane.gateway.attempt import (
    DEADLINE_MARGIN_S,
    DEADLINE_MARGIN_SHARE,
    INLINE_JSON,
    JSON,
    RETRIABLE_STATUS,
    Attempt,
    Failure,
    GiveUp,
    Instruments,
    answer_headers,
    failure_details,
    refuse,
)
from controlplane.gateway.backend import BackendSpec, BackendState
from controlplane.gateway.budget import RetryBudget
from controlplane.gateway.catalog import BackendCatalog
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.deadline import deadline_us, header_length, read_body, timeout_header_us, timeout_parameter_us
from controlplane.gateway.errors import BackendUnavailable, BadBackendResponse, DeadlineExceeded, Refusal
from controlplane.gateway.eventlog import EventLog
from controlplane.gateway.grpc_backend import GrpcAnswer, GrpcBackends, judge
from controlplane.gateway.grpc_messages import GrpcRequest, http_answer, infer_request
from controlplane.gateway.health import ReadinessChecker
from controlplane.gateway.pool import BackendPool
from controlplane.gateway.relay import OpenAIRelay
from controlplane.gateway.tenant import quota_tenant, request_tenant
from controlplane.gateway.tokens import AgentTokens, TokenCache
from controlplane.gateway.translate import Translated, TranslationError, request_to_json, response_from_json
from controlplane.gateway.upstream import Answer, UpstreamConnect, UpstreamReset, Upstreams, UpstreamTimeout
from controlplane.monitoring import GatewayMetrics
from spillway.contract.v2 import ClientGone

log = logging.getLogger("spillway.controlplane.gateway")

_ERROR_BODY_LIMIT = 64 << 10  # a retriable error's body is kept (to pass on if it is the last) up to this
_SLACK_S = 0.0005  # less time than this left: no attempt is worth starting
_VERSION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_PASSED_ON = frozenset(
    {b"content-type", b"content-length", b"content-encoding", b"inference-header-content-length", b"retry-after",
     b"spillway-reason", b"spillway-outcome"}
)  # fmt: skip


@dataclass
class _Request:
    """One client request, parsed once for all its attempts."""

    path: str
    body: bytes
    header_length: int | None
    headers: dict[str, str]  # passed to every backend
    compressed: bool
    model: str
    version: str | None
    tenant: str | None = None  # as the agent named it (`spillway-tenant`, checked); None: none named
    _translated: Translated | None = field(default=None, repr=False)
    _grpc: GrpcRequest | None = field(default=None, repr=False)

    def translated(self) -> Translated:
        if self._translated is None:
            if self.compressed:
                raise InvalidRequest("a compressed request cannot be translated for a backend without binary tensors")
            try:
                self._translated = request_to_json(self.body, self.header_length)
            except TranslationError as exc:
                raise InvalidRequest(str(exc)) from None
        return self._translated

    def converted(self) -> bool:
        return self._grpc is not None

    def grpc(self) -> GrpcRequest:
        if self._grpc is None:
            if self.compressed:
                raise InvalidRequest("a compressed request cannot be sent to a gRPC backend")
            try:
                self._grpc = infer_request(self.body, self.header_length, self.model, self.version)
            except TranslationError as exc:
                raise InvalidRequest(str(exc)) from None
        return self._grpc


class Gateway:
    """The V2 infer proxy, and the OpenAI-compatible relay beside it (`relay`). Made with the app; `start` (in the
    lifespan) opens the HTTP client, loads the backends and starts the background tasks (refresh, readiness checks,
    events); `close` stops them."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        pool: BackendPool | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.pool = pool or BackendPool(config.outlier, config.readiness, clock=clock)
        self.catalog = BackendCatalog(self.pool, refresh_s=config.refresh_s, clock=clock, on_removed=self._forget)
        self.budget = RetryBudget(config.retry_budget_percent, config.min_retry_concurrency)
        self.tokens = AgentTokens(TokenCache(config.auth_ttl_s, clock=clock))
        self.events: EventLog | None = None
        self.checker: ReadinessChecker | None = None
        self._http: aiohttp.ClientSession | None = None  # readiness checks and the OpenAI-compatible relay
        self.upstreams = Upstreams(config.max_connections)  # V2 requests to `v2` backends (upstream.py)
        self._tasks: list[asyncio.Task[None]] = []
        self._instruments: dict[str, Instruments] = {}
        self.grpc = GrpcBackends()  # the channels to v2_grpc backends
        self.relay = OpenAIRelay(self)  # POST /v1/completions and /v1/chat/completions

    async def start(self, factory: sessionmaker[Session]) -> None:
        self.tokens.factory = factory
        self.catalog.attach(factory)
        self.events = EventLog(factory)
        connector = aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0, ttl_dns_cache=60,
                                         keepalive_timeout=30)  # fmt: skip
        # Bytes pass as they are: no decompression, no Accept-Encoding the client did not send, no cookies.
        self.upstreams = Upstreams(self.config.max_connections)  # a fresh one per start (and event loop)
        self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                           skip_auto_headers=("Accept-Encoding", "User-Agent"),
                                           cookie_jar=aiohttp.DummyCookieJar())  # fmt: skip
        timeout = min(self.config.health_timeout_s, self.config.health_interval_s)
        self.checker = ReadinessChecker(self.http, self.pool, timeout_s=timeout, grpc=self.grpc)
        try:
            await self.catalog.reload()
        except Exception:  # e.g. not migrated yet: the refresh loop and the first request try again
            log.warning("gateway: could not load the backends at start", exc_info=True)
        self._tasks = [asyncio.create_task(self.catalog.run(after=self._tick)),
                       asyncio.create_task(self._health_loop()), asyncio.create_task(self.events.run())]  # fmt: skip

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.catalog.detach()
        if self.events is not None:
            self._emit()
            await self.events.flush()
        if self._http is not None:
            await self._http.close()
            self._http = None
        await self.upstreams.close()
        await self.grpc.close()

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("the gateway has not been started")
        return self._http

    def backends_changed(self) -> None:
        """Called (from any thread) when this process changed a backend; see BackendCatalog.changed."""
        self.catalog.changed()

    async def _health_loop(self) -> None:
        assert self.checker is not None
        while True:
            began = self.clock()
            try:
                await self.checker.check_all()
            except Exception:
                log.warning("gateway: readiness checks failed", exc_info=True)
            self._tick()
            await asyncio.sleep(max(0.0, self.config.health_interval_s - (self.clock() - began)))

    def _tick(self) -> None:
        self.pool.sweep()
        self._emit()

    def _emit(self) -> None:
        if not self.pool.transitions:
            return
        transitions = self.pool.drain()
        for t in transitions:
            if t.kind == "backend.ejected":
                self.metrics.ejections.labels(t.backend).inc()
        if self.events is not None:
            self.events.add(transitions)

    def _forget(self, state: BackendState) -> None:
        self.grpc.forget(state.id, grace_s=state.spec.timeout_ms / 1000)
        instruments = self._instruments.pop(state.id, None)
        if instruments is not None:
            self.metrics.forget(instruments.name)

    def instruments_of(self, spec: BackendSpec) -> Instruments:
        instruments = self._instruments.get(spec.id)
        if instruments is None or instruments.name != spec.name:  # new, or renamed
            if instruments is not None:
                self.metrics.forget(instruments.name)
            instruments = self._instruments[spec.id] = Instruments(self.metrics, spec.name)
        return instruments

    # ---- requests ---------------------------------------------------------------------------------

    async def serve(self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None) -> None:
        """Answer one `POST /v2/models/{model}[/versions/{version}]/infer`."""
        sent = False

        async def tracking(message: Message) -> None:
            nonlocal sent
            sent = True
            await send(message)

        try:
            await self._serve(scope, receive, tracking, model, version)
        except ClientGone:
            return
        except SpillwayError as exc:
            if not sent:
                await self._refuse(send, exc)
        except Exception:
            log.exception("gateway: unexpected error on %s", scope["path"])
            if not sent:
                await self._refuse(send, SpillwayError("internal error; the server log has the details"))

    async def _serve(self, scope: Scope, receive: Receive, send: Send, model: str, version: str | None) -> None:
        authorization = content_type = ihcl = timeout = declared = accept_encoding = content_encoding = None
        tenant_header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"spillway-tenant":
                tenant_header = value
            elif name == b"content-type":
                content_type = value
            elif name == b"inference-header-content-length":
                ihcl = value
            elif name == b"spillway-timeout-us":
                timeout = value
            elif name == b"content-length":
                declared = value
            elif name == b"accept-encoding":
                accept_encoding = value
            elif name == b"content-encoding":
                content_encoding = value
        await self.tokens.check(authorization)
        if version is not None and not _VERSION.match(version):
            raise InvalidRequest(f"version: '{version[:64]}' is not a version (letters, digits, '.', '_', '-')")
        body = await read_body(receive, declared, self.config.max_body_bytes)
        length = header_length(ihcl, len(body))
        compressed = content_encoding is not None and content_encoding.strip().lower() != b"identity"
        parameter = None
        if not compressed:
            head = body if length is None else body[:length]
            if len(head) <= INLINE_JSON:
                parameter = timeout_parameter_us(head)
            else:
                parameter = await to_thread.run_sync(timeout_parameter_us, head)
        limit_us = deadline_us(timeout_header_us(timeout), parameter)
        await self.catalog.current(model)

        headers = {"Content-Type": (content_type or (JSON if length is None else b"application/octet-stream"))
                   .decode("latin-1")}  # fmt: skip
        if length is not None:
            headers["Inference-Header-Content-Length"] = str(length)
        if accept_encoding is not None:
            headers["Accept-Encoding"] = accept_encoding.decode("latin-1")
        if compressed:
            assert content_encoding is not None
            headers["Content-Encoding"] = content_encoding.decode("latin-1")
        tenant = request_tenant(tenant_header)
        if tenant is not None:
            headers["Spillway-Tenant"] = tenant
        path = f"/v2/models/{model}/versions/{version}/infer" if version else f"/v2/models/{model}/infer"
        request = _Request(path, body, length, headers, compressed, model, version, tenant)
        await self.forward(model, limit_us, partial(self._attempt, send, request), partial(self._give_up, send),
                           tenant=quota_tenant(tenant))  # fmt: skip

    async def forward(
        self, model: str, limit_us: int | None, attempt: Attempt, give_up: GiveUp, protocol: str = "v2",
        tenant: str | None = None,
    ) -> None:  # fmt: skip
        """Try backends of `protocol` serving `model` one after another: `attempt(state, timeout_s, n)` answers
        (None) or reports a retriable failure; another backend is tried while the deadline (`limit_us`, else the
        first backend's timeout) and the retry budget allow, else `give_up(last failure, attempts, why)` answers.
        Each attempt holds a part of `tenant`'s share of its backend (None: no share counted).
        Raises the pool's Refusal when no backend could take it at all (TenantQuota: none within the tenant's share),
        DeadlineExceeded when time ran out."""
        started = self.clock()
        deadline = None if limit_us is None else started + limit_us / 1e6
        tried: list[str] = []
        last: Failure | None = None
        budget = self.budget
        budget.active_requests += 1
        try:
            while True:
                if deadline is not None and deadline - self.clock() < _SLACK_S:
                    if last is None or last.kind == "timeout":
                        raise DeadlineExceeded(_spent(limit_us, last, len(tried)), failure_details(last, len(tried)))
                    return await give_up(last, len(tried), "no time is left of the deadline")
                retry = bool(tried)
                if retry:
                    assert last is not None
                    if not budget.try_retry():
                        return await give_up(last, len(tried), "the retry budget is spent")
                try:
                    try:
                        state = self.pool.acquire(model, tried, protocol, tenant)
                    except Refusal:
                        self._emit()
                        if last is None:
                            raise
                        return await give_up(last, len(tried), "no other backend can take it")
                    try:
                        if retry:
                            self.metrics.retries.inc()
                        if deadline is None:  # the caller set none: the first backend's timeout bounds the request
                            deadline = started + state.spec.timeout_ms / 1000
                        timeout_s = min(deadline - self.clock(), state.spec.timeout_ms / 1000)
                        tried.append(state.id)
                        failure = await attempt(state, timeout_s, len(tried))
                    finally:
                        self.pool.left(state, tenant)
                finally:
                    if retry:
                        budget.retry_done()
                self._emit()
                if failure is None:
                    return
                last = failure
        finally:
            budget.active_requests -= 1

    async def _attempt(
        self, send: Send, request: _Request, state: BackendState, timeout_s: float, attempt: int
    ) -> Failure | None:
        """One try at one backend. None: answered (or cut off mid-stream); a Failure: retriable."""
        spec = state.spec
        if spec.protocol == "v2_grpc":
            return await self._attempt_grpc(send, request, state, timeout_s, attempt)
        instruments = self.instruments_of(spec)
        translated: Translated | None = None
        failure: str | None = None
        error: str | None = None
        code = "error"
        streaming = busy = False
        try:
            headers = dict(request.headers)
            payload = request.body
            if not spec.binary_tensors:
                translated = request.translated()
                payload = translated.body
                headers["Content-Type"] = "application/json"
                headers.pop("Inference-Header-Content-Length", None)
                headers.pop("Accept-Encoding", None)  # the answer is read here, whole
            # The backend gets the deadline less a margin, so that a Spillway agent's own refusal ("too late",
            # 503 with Retry-After) arrives before this attempt times out (a timeout counts against a backend).
            margin = min(DEADLINE_MARGIN_S, timeout_s * DEADLINE_MARGIN_SHARE)
            headers["Spillway-Timeout-Us"] = str(max(1, int((timeout_s - margin) * 1e6)))
            if spec.auth_header:
                headers["Authorization"] = spec.auth_header
        except BaseException:
            self.pool.release(state)  # never sent: nothing to learn about the backend
            raise
        instruments.outstanding.inc()
        began = self.clock()
        answer: Answer | None = None
        try:
            answer = await self.upstreams.post(spec.url, request.path, headers, payload, timeout_s)
            status = answer.status
            code = str(status)
            # A 503 with Retry-After is a backend shedding load (a busy Spillway agent, Triton's queue full):
            # retried elsewhere like any 503, but no mark against the backend's health (unlike Envoy).
            busy = status == 503 and answer.header(b"retry-after") is not None
            if status >= 500 and not busy:
                failure, error = "status_5xx", f"answered {status}"
            if status in RETRIABLE_STATUS:
                kept = await answer.read(_ERROR_BODY_LIMIT)
                passed = tuple((k, v) for k, v in answer.headers if k in _PASSED_ON and k != b"content-length")
                kind = "busy" if busy else "status_5xx"
                return Failure(kind, f"backend '{spec.name}' answered {status}", spec, status, kept, passed)
            extra = answer_headers(spec, attempt)
            if translated is not None and status == 200:
                raw = await answer.read()
                try:
                    body, length = response_from_json(raw, translated)
                except TranslationError as exc:
                    failure, error = "bad_response", str(exc)[:300]
                    raise BadBackendResponse(f"backend '{spec.name}': {exc}", {"backend": spec.name}) from None
                ctype = b"application/octet-stream" if length is not None else JSON
                extra += [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
                if length is not None:
                    extra.append((b"inference-header-content-length", str(length).encode()))
                await send({"type": "http.response.start", "status": 200, "headers": extra})
                await send({"type": "http.response.body", "body": body})
                return None
            passed_on = [(k, v) for k, v in answer.headers if k in _PASSED_ON]
            start = {"type": "http.response.start", "status": status, "headers": passed_on + extra}
            if answer.complete:  # the whole answer came with its head (a small one): one message for the body
                body = await answer.read()
                await send(start)
                streaming = True
                await send({"type": "http.response.body", "body": body})
                return None
            await send(start)
            streaming = True
            async for chunk in answer.chunks_as_they_come():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return None
        except UpstreamTimeout:
            failure, code, error = "timeout", "timeout", f"no answer within {timeout_s * 1000:.0f} ms"
        except UpstreamConnect as exc:
            failure, code, error = "connect", "connect", f"could not connect: {exc}"
        except UpstreamReset as exc:
            failure, code, error = "reset", "reset", f"connection failed: {exc}"
        finally:
            if answer is not None:
                answer.release()
            seconds = self.clock() - began
            instruments.outstanding.dec()
            instruments.attempt(code, failure, seconds)
            self.pool.release(state, failure=failure, error=error, seconds=seconds, busy=busy)
        assert failure is not None and error is not None
        if streaming:  # the status line has gone out: cut the connection rather than end a broken body cleanly
            log.warning("gateway: backend %s failed mid-answer (%s); the client's connection is cut", spec.name, error)
            return None
        return Failure(failure, f"backend '{spec.name}': {error}", spec)

    async def _attempt_grpc(
        self, send: Send, request: _Request, state: BackendState, timeout_s: float, attempt: int
    ) -> Failure | None:
        """One try at one `v2_grpc` backend: a ModelInfer, its answer written back as the V2 HTTP answer the client
        asked for, its status judged as an HTTP one would be (grpc_backend.py)."""
        spec = state.spec
        instruments = self.instruments_of(spec)
        try:
            if len(request.body) <= INLINE_JSON or request.converted():
                message = request.grpc()
            else:
                message = await to_thread.run_sync(request.grpc)
        except BaseException:
            self.pool.release(state)  # never sent: nothing to learn about the backend
            raise
        margin = min(DEADLINE_MARGIN_S, timeout_s * DEADLINE_MARGIN_SHARE)
        failure: str | None = None
        error: str | None = None
        code = "error"
        busy = False
        instruments.outstanding.inc()
        began = self.clock()
        try:
            result = await self.grpc.infer(spec, message.message, timeout_s, max(1, int((timeout_s - margin) * 1e6)),
                                           tenant=request.tenant)  # fmt: skip
            # The backend's metadata worth passing on (spillway-outcome, spillway-reason, retry-after) as headers.
            passed = [(key.encode(), value.encode("latin-1", "replace")) for key, value in result.metadata.items()]
            extra = passed + answer_headers(spec, attempt)
            if isinstance(result, GrpcAnswer):
                code = "200"
                try:
                    if result.response.ByteSize() <= INLINE_JSON:
                        body, length = http_answer(result.response, message.outputs)
                    else:
                        body, length = await to_thread.run_sync(http_answer, result.response, message.outputs)
                except TranslationError as exc:
                    failure, error = "bad_response", str(exc)[:300]
                    raise BadBackendResponse(f"backend '{spec.name}': {exc}", {"backend": spec.name}) from None
                extra += [(b"content-type", JSON if length is None else b"application/octet-stream"),
                          (b"content-length", str(len(body)).encode())]  # fmt: skip
                if length is not None:
                    extra.append((b"inference-header-content-length", str(length).encode()))
                await send({"type": "http.response.start", "status": 200, "headers": extra})
                await send({"type": "http.response.body", "body": body})
                return None
            verdict = judge(result.code, result.metadata)
            code, failure, busy = verdict.label, verdict.failure, verdict.busy
            said = f"{result.code.name}: {result.details}"
            if failure is not None:
                error = said[:300]
            if verdict.status == 413:  # too large for this backend (grpc's own limit, or its memory): say whose
                said = f"payload too large for backend '{spec.name}': {said}"
                if "spillway-reason" not in result.metadata:
                    extra.append((b"spillway-reason", b"payload_too_large"))
            body = orjson.dumps({"error": said})  # the V2 error shape
            if verdict.retried:
                if failure is None:  # busy: the last one's refusal is the answer
                    return Failure("busy", f"backend '{spec.name}' answered {said}", spec, verdict.status, body,
                                   ((b"content-type", JSON), *passed))  # fmt: skip
                return Failure(failure, f"backend '{spec.name}': {said}", spec)
            extra += [(b"content-type", JSON), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": verdict.status, "headers": extra})
            await send({"type": "http.response.body", "body": body})
            return None
        finally:
            seconds = self.clock() - began
            instruments.outstanding.dec()
            instruments.attempt(code, failure, seconds)
            self.pool.release(state, failure=failure, error=error, seconds=seconds, busy=busy)

    async def _give_up(self, send: Send, last: Failure, attempts: int, why: str) -> None:
        """No (further) retry: the last failure is the answer; a backend's 502/503/504 passes as it came."""
        if last.status is not None:
            length = (b"content-length", str(len(last.body)).encode())
            headers = [*last.headers, length, *answer_headers(last.backend, attempts)]
            await send({"type": "http.response.start", "status": last.status, "headers": headers})
            await send({"type": "http.response.body", "body": last.body})
            return
        message = f"{attempts} attempt{'s' if attempts > 1 else ''} failed and {why}; the last: {last.message}"
        raise BackendUnavailable(message, failure_details(last, attempts))

    async def _refuse(self, send: Send, exc: SpillwayError) -> None:
        self.metrics.rejected.labels(exc.code).inc()
        await refuse(send, exc, orjson.dumps({"error": exc.code, "message": exc.message, "details": exc.details}))

    # ---- status -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The `gateway` section of `GET /api/v1/status`."""
        now = utcnow()
        backends = []
        for row in self.pool.snapshot():
            left = row.pop("ejected_for_s")
            row["ejected_until"] = None if left is None else now + timedelta(seconds=left)
            backends.append(row)
        at = self.catalog.loaded_at
        loaded = None if at is None else now - timedelta(seconds=self.clock() - at)
        return {
            "active_requests": self.budget.active_requests,
            "active_retries": self.budget.active_retries,
            "retry_limit": self.budget.limit,
            "loaded_at": loaded,
            "backends": backends,
        }


def _spent(limit_us: int | None, last: Failure | None, attempts: int) -> str:
    text = "the backend's timeout passed" if limit_us is None else f"the deadline of {limit_us / 1000:g} ms passed"
    if last is not None:
        text += f" after {attempts} attempt{'s' if attempts > 1 else ''}; the last: {last.message}"
    return text
