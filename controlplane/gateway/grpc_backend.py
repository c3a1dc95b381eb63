"""`v2_grpc` backends: a V2 gRPC server (Triton's or KServe's GRPCInferenceService, a Spillway agent's `grpc_port`)
behind the gateway, reached with grpc.aio through tritonclient's generated stub.

One channel per backend, made on its first use and kept while the backend stays registered at the same address
(closed, after its requests in flight, when it is removed or moves). An attempt is one `ModelInfer` whose gRPC
deadline is the attempt's share of the request's deadline; the backend also gets that share less a margin in the
`spillway-timeout-us` metadata (as the HTTP path's header), so that a Spillway agent's own "too late" arrives before
the gateway gives up. Readiness: `ServerReady` and `ModelReady` for each model it lists.

A gRPC status is judged as forward.py judges an HTTP status (`judge`):

    UNAVAILABLE with retry-after                       busy: tried elsewhere, no mark against the backend
    RESOURCE_EXHAUSTED with retry-after, or with a     (the last one's 503 / 429 is the answer)
      spillway-reason that says busy (queue_full, ...)
    UNAVAILABLE without (no server, or a broken one)   connect: tried elsewhere, counted (outlier ejection)
    RESOURCE_EXHAUSTED without either                  too large (grpc's "larger than max", an agent's 507): the
                                                       same everywhere, so passed on as 413, not retried, not counted
    DEADLINE_EXCEEDED                                  timeout: tried elsewhere while time is left, counted; else
                                                       the gateway's 504 deadline_exceeded
    CANCELLED                                          reset: tried elsewhere, counted
    INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, ...  the client's error: passed on (400, 404, 401, ...), not retried
    INTERNAL, UNKNOWN, UNIMPLEMENTED, DATA_LOSS        the backend's error: passed on (500, 501), counted, not retried
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from controlplane.gateway.backend import BackendSpec
from controlplane.schemas.backends import grpc_target

__all__ = ["GrpcAnswer", "GrpcBackends", "GrpcRefusal", "Verdict", "judge"]

_OPTIONS = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))
_METADATA = frozenset({"spillway-outcome", "spillway-reason", "retry-after"})  # kept from a backend's answer
_DETAILS_LIMIT = 1000
Code = grpc.StatusCode


@dataclass(frozen=True)
class GrpcAnswer:
    """A ModelInferResponse, and the metadata of the answer worth passing on (lower-case keys)."""

    response: Any
    metadata: dict[str, str]


@dataclass(frozen=True)
class GrpcRefusal:
    """A non-OK status: its code, its details, and its metadata worth passing on."""

    code: grpc.StatusCode
    details: str
    metadata: dict[str, str]


@dataclass(frozen=True)
class Verdict:
    """What a non-OK gRPC status means to the gateway."""

    status: int  # the HTTP status the client gets when this is the answer
    failure: str | None  # counted against the backend: connect | timeout | reset | status_5xx; None: not counted
    retried: bool  # another backend may take the request
    busy: bool = False  # the backend shed the request: it answers, it is not broken

    @property
    def label(self) -> str:
        """The `code` label of the attempt's metric, as the HTTP path's (a status, or the transport failure)."""
        return self.failure if self.failure in ("connect", "timeout", "reset") else str(self.status)


_PASSED = {Code.INVALID_ARGUMENT: 400, Code.OUT_OF_RANGE: 400, Code.UNAUTHENTICATED: 401,
           Code.PERMISSION_DENIED: 403, Code.NOT_FOUND: 404, Code.ALREADY_EXISTS: 409, Code.FAILED_PRECONDITION: 409,
           Code.ABORTED: 409}  # fmt: skip
_BACKEND_ERROR = {Code.UNIMPLEMENTED: 501}  # others (INTERNAL, UNKNOWN, DATA_LOSS): 500
# A Spillway agent's reasons that say "busy now" (its 429 carries one, with retry-after, as trailing metadata).
_BUSY_REASONS = frozenset({"queue_full", "deadline_unmeetable", "no_capacity", "shed", "draining"})


def judge(code: grpc.StatusCode, metadata: dict[str, str]) -> Verdict:
    """A non-OK status as the gateway's outcome (the table in the module's docstring)."""
    if code == Code.UNAVAILABLE:
        if "retry-after" in metadata:  # as the HTTP path's 503
            return Verdict(503, None, retried=True, busy=True)
        return Verdict(503, "connect", retried=True)
    if code == Code.RESOURCE_EXHAUSTED:
        if "retry-after" in metadata or metadata.get("spillway-reason") in _BUSY_REASONS:
            return Verdict(429, None, retried=True, busy=True)
        # grpc's own "message larger than max", or a backend out of memory for it: the request is the problem
        return Verdict(413, None, retried=False)
    if code == Code.DEADLINE_EXCEEDED:
        return Verdict(504, "timeout", retried=True)
    if code == Code.CANCELLED:
        return Verdict(502, "reset", retried=True)
    if code in _PASSED:
        return Verdict(_PASSED[code], None, retried=False)
    return Verdict(_BACKEND_ERROR.get(code, 500), "status_5xx", retried=False)


class _Channel:
    """One backend's channel, and its calls in flight (a channel retired closes when they end)."""

    def __init__(self, url: str, channel: grpc.aio.Channel) -> None:
        self.url = url
        self.channel = channel
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        self.calls = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @contextlib.contextmanager
    def call(self) -> Iterator[Any]:
        self.calls += 1
        self.idle.clear()
        try:
            yield self.stub
        finally:
            self.calls -= 1
            if not self.calls:
                self.idle.set()


class GrpcBackends:
    """The channels to the `v2_grpc` backends, by backend id. Used from the gateway's event loop only."""

    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._retiring: dict[asyncio.Task[None], _Channel] = {}  # channels that close once their calls end

    async def infer(
        self, spec: BackendSpec, request: Any, timeout_s: float, budget_us: int, *, tenant: str | None = None
    ) -> GrpcAnswer | GrpcRefusal:
        """One `ModelInfer` within `timeout_s`; the backend is told `budget_us` (the deadline less a margin) and the
        request's `tenant` (`spillway-tenant` metadata, where the agent named one)."""
        try:
            held = self._channel(spec)
        except ValueError as exc:  # a row written past the API's validation
            return GrpcRefusal(Code.UNAVAILABLE, str(exc), {})
        metadata = (*_auth(spec), ("spillway-timeout-us", str(budget_us)), *_tenant(tenant))
        with held.call() as stub:
            try:
                call = stub.ModelInfer(request, timeout=timeout_s, metadata=metadata)
                response = await call
                kept = _kept(await call.initial_metadata(), await call.trailing_metadata())
            except grpc.aio.AioRpcError as exc:
                kept = _kept(exc.initial_metadata(), exc.trailing_metadata())
                return GrpcRefusal(exc.code(), (exc.details() or "")[:_DETAILS_LIMIT], kept)
            except Exception as exc:  # grpc's own, when the call cannot even be sent (an auth_header that is no header)
                return GrpcRefusal(Code.UNAVAILABLE, f"the call could not be sent: {_brief(exc)}", {})
        return GrpcAnswer(response, kept)

    async def ready(self, spec: BackendSpec, timeout_s: float) -> tuple[dict[str, bool], str | None]:
        """`ServerReady` and `ModelReady` for each model: model -> passed, and the first failure (None: all passed)."""
        try:
            held = self._channel(spec)
        except ValueError as exc:
            return dict.fromkeys(spec.models, False), str(exc)
        metadata = _auth(spec)
        with held.call() as stub:
            probes = await asyncio.gather(
                _probe(stub.ServerReady, service_pb2.ServerReadyRequest(), "ServerReady", timeout_s, metadata),
                *(_probe(stub.ModelReady, service_pb2.ModelReadyRequest(name=model), f"ModelReady '{model}'",
                         timeout_s, metadata) for model in spec.models),
            )  # fmt: skip
        server_error = probes[0]
        ready = {m: server_error is None and error is None for m, error in zip(spec.models, probes[1:], strict=True)}
        return ready, next((e for e in probes if e is not None), None)

    def held(self) -> dict[str, str]:
        """The backends with an open channel: id -> the url it was opened for."""
        return {backend_id: held.url for backend_id, held in self._channels.items()}

    def forget(self, backend_id: str, grace_s: float = 30.0) -> None:
        """The backend is gone: its channel closes once its calls in flight end (at most `grace_s`)."""
        held = self._channels.pop(backend_id, None)
        if held is not None:
            self._retire(held, grace_s)

    async def close(self) -> None:
        """Close every channel now, cancelling the calls still in flight (the gateway is stopping)."""
        held = [*self._channels.values(), *self._retiring.values()]
        for task in self._retiring:
            task.cancel()
        self._channels.clear()
        await asyncio.gather(*self._retiring, *(h.channel.close(None) for h in held), return_exceptions=True)

    def _channel(self, spec: BackendSpec) -> _Channel:
        held = self._channels.get(spec.id)
        if held is not None and held.url == spec.url:
            return held
        target, secure = grpc_target(spec.url)
        if held is not None:  # the backend moved: its calls in flight end on the old channel
            self._retire(held, spec.timeout_ms / 1000)
        if secure:
            channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(target, options=_OPTIONS)
        held = self._channels[spec.id] = _Channel(spec.url, channel)
        return held

    def _retire(self, held: _Channel, grace_s: float) -> None:
        task = asyncio.get_running_loop().create_task(_close_when_idle(held, grace_s))
        self._retiring[task] = held
        task.add_done_callback(lambda done: self._retiring.pop(done, None))


async def _close_when_idle(held: _Channel, grace_s: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(held.idle.wait(), grace_s)
    await held.channel.close(None)


def _auth(spec: BackendSpec) -> tuple[tuple[str, str], ...]:
    return (("authorization", spec.auth_header),) if spec.auth_header else ()


def _tenant(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return () if tenant is None else (("spillway-tenant", tenant),)


def _kept(*metadata: Any) -> dict[str, str]:
    kept: dict[str, str] = {}
    for pairs in metadata:
        for key, value in pairs or ():
            if key in _METADATA and isinstance(value, str):
                kept[key] = value
    return kept


async def _probe(method: Any, request: Any, what: str, timeout_s: float, metadata: Any) -> str | None:
    try:
        answer = await method(request, timeout=timeout_s, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        return f"{what}: {exc.code().name}: {(exc.details() or '')[:200]}"
    except Exception as exc:
        return f"{what}: the call could not be sent: {_brief(exc)}"
    return None if answer.ready else f"{what} answered not ready"


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
