"""The agent's V2 gRPC endpoint: Triton's `GRPCInferenceService` (tritonclient's generated servicer and messages), in
the agent's event loop, answering every RPC through the agent's own ASGI app in-process.

Each RPC becomes one HTTP request to `InferenceApp` (a synthetic `http` scope, its body in one `http.request`
message; `receive` then waits until the RPC ends and says `http.disconnect`), so authentication (the `authorization`
metadata is the header), admission, priorities (the `priority` request parameter), deadlines (the RPC's time
remaining is the `spillway-timeout-us` header), bad-input rules and outcomes are exactly HTTP's:

    ServerLive/Ready             GET  /v2/health/live|ready
    ServerMetadata               GET  /v2
    ModelMetadata/Ready/Config   GET  /v2/models/{m}[/versions/{v}][/ready|/config]
    ModelStatistics              GET  /v2/models[/{m}[/versions/{v}]]/stats
    RepositoryIndex/Load/Unload  POST /v2/repository/index, /v2/repository/models/{m}/load|unload
    ModelInfer                   POST /v2/models/{m}[/versions/{v}]/infer (a binary body, every output binary)
    ModelStreamInfer             each request: `infer` (one response), or for a generative model Triton's generate
                                 extension (`generate_stream`: one response per event, the last one with the
                                 parameter `triton_final_response: true`; `generate` when its `stream` input is false)

A request the codec cannot write as the app's body (typed contents that do not fit their shape...) is still the
app's to refuse: it is sent on with an empty body, which the app refuses after the token and the model as any bad
request (400 `invalid_request`, counted on the model), and the answer carries the codec's words.

An HTTP error is the RPC's status (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND,
405 UNIMPLEMENTED, 409 FAILED_PRECONDITION, 413 INVALID_ARGUMENT, 429 and 507 RESOURCE_EXHAUSTED, 500 INTERNAL, 503
UNAVAILABLE, 504 DEADLINE_EXCEEDED) with the error's text as its message; on a stream it is that request's
`error_message`, and the stream goes on. `spillway-outcome`, `spillway-reason`, `retry-after`, `spillway-variant`,
`spillway-backend` and `spillway-job-id` are the trailing metadata of a ModelInfer, answered or not; a successful
answer also says `spillway_outcome` in its parameters, as the HTTP body does. A request the async queue accepted (HTTP
202) is a ModelInferResponse without outputs whose parameters say `spillway_outcome: queued_async`,
`spillway_job_id` and `spillway_job_location` (its answer: `GET /spillway/v1/jobs/{id}` on the HTTP port).

A ModelStreamInfer holds at most `STREAM_IN_FLIGHT` requests in flight: the stream reads no more until one has had
its last response sent (HTTP/2 flow control then holds the client back). The server takes at most
`MAX_CONCURRENT_RPCS` RPCs at once (each holds its request); one more is refused RESOURCE_EXHAUSTED by gRPC itself,
without an outcome, as a connection the kernel's backlog refuses is for HTTP. Messages up to the agent's
`max_body_bytes` plus `PROTOBUF_OVERHEAD_BYTES` are received, so a request over the limit normally meets the app's own
refusal (413, counted); a bigger one is refused by gRPC (RESOURCE_EXHAUSTED).

When the agent drains, each request a stream has read is answered (one in flight as usual; one read from now on with
the `error_message` "the agent is shutting down"); the stream ends once nothing is in flight: OK when the client had
closed its side, else UNAVAILABLE, since the client may have sent requests the agent will not read.

The shared memory, trace and log RPCs answer UNIMPLEMENTED. Needs grpcio (`pip install 'spillway[grpc]'`); this
module is imported only when gRPC serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_agent.serving.app import InferenceApp
from edge_agent.serving.grpc_generate import event_error, generate_body, generated, sse_events
from edge_agent.serving.ports import PortBusy, check_free
from spillway.contract import names
from spillway.contract.grpc_codec import infer_request_to_v2, parameters_to_dict, set_parameters, v2_response_to_infer
from spillway.contract.v2 import TensorError

__all__ = ["MAX_CONCURRENT_RPCS", "PROTOBUF_OVERHEAD_BYTES", "STREAM_IN_FLIGHT", "GrpcEndpoint"]

log = logging.getLogger("spillway.agent")

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,  # the message names the limit
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# HTTP answer headers passed on as trailing metadata.
_TRAILING = (names.H_OUTCOME, names.H_REASON, names.H_RETRY_AFTER, names.H_VARIANT, names.H_BACKEND, names.H_JOB_ID)
# Request metadata passed to the app as headers (the deadline is the RPC's own, below).
_FORWARDED = (b"authorization", b"spillway-priority", names.H_TIMEOUT_US.encode())
STREAM_IN_FLIGHT = 64  # requests of one ModelStreamInfer being answered at once
MAX_CONCURRENT_RPCS = 4096  # as many as the scheduler queues by default (max_queued_requests)
PROTOBUF_OVERHEAD_BYTES = 64 << 10  # a request's protobuf framing beyond its V2 body, received before the app's 413
SHUTTING_DOWN = "the agent is shutting down"
_SEND_UNLIMITED = (1 << 31) - 1
_SHM = "the system shared memory extension: send tensors in the request (raw_input_contents or contents)"
_CUDA_SHM = "the CUDA shared memory extension: send tensors in the request (raw_input_contents or contents)"
# On a stream's queue, beside its responses: a request has had its last response (`_DONE`); the reading ended or
# the agent drains (`_WAKE`).
_DONE = object()
_WAKE = object()

# ---- one HTTP request to the app, in-process -------------------------------------------------------------------------


class _Exchange:
    """One request to the ASGI app: its answer's messages arrive on `messages`; `leave()` tells the app the client is
    gone (its `receive` says `http.disconnect`), as when an HTTP client disconnects. The app's task is not cancelled
    when its RPC ends: it finishes and records its outcome (only a stopping endpoint cancels what is left)."""

    _END: dict[str, Any] = {"type": "spillway.end"}

    def __init__(self, app: InferenceApp, running: set[asyncio.Task[None]], method: str, path: str,
                 headers: list[tuple[bytes, bytes]], body: bytes, peer: str) -> None:  # fmt: skip
        """`running`: the endpoint's app calls, which it ends when it stops (a call outliving its RPC is answered to
        nobody, as an HTTP request whose client left)."""
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.gone = asyncio.Event()
        self.body = body
        self.read = False
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "2",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [*headers, (b"content-length", str(len(body)).encode())],
            "client": _client(peer), "server": None,
        }  # fmt: skip
        task = asyncio.ensure_future(self._run(app, scope))
        running.add(task)
        task.add_done_callback(running.discard)

    async def _run(self, app: InferenceApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._send)
        except Exception:  # the app answers its own errors; one escaping is ours: INTERNAL, logged
            log.exception("the gRPC call of %s %s failed", scope["method"], scope["path"])
            error = json.dumps({"error": "internal error; see the agent log", "outcome": names.ERROR}).encode()
            self.messages.put_nowait({"type": "http.response.start", "status": 500, "headers": []})
            self.messages.put_nowait({"type": "http.response.body", "body": error})
        finally:
            self.messages.put_nowait(self._END)

    async def _receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if not self.gone.is_set():
            self.messages.put_nowait(message)

    def leave(self) -> None:
        self.gone.set()

    async def head(self) -> tuple[int, dict[str, str]]:
        """The answer's status and headers (lower-case names)."""
        message = await self.messages.get()
        if message["type"] != "http.response.start":  # the app ended without answering: never expected
            return 500, {}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", ())}
        return int(message["status"]), headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The answer's body, as the app sends it."""
        while True:
            message = await self.messages.get()
            if message["type"] != "http.response.body":
                return
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    async def body_whole(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


def _client(peer: str) -> tuple[str, int] | None:
    """`ipv4:127.0.0.1:5555` / `ipv6:[::1]:5555` -> (host, port)."""
    _, _, address = peer.partition(":")
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


class _Answer:
    """A whole HTTP answer of the app."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> str:
        """The error's text, as the HTTP body says it."""
        try:
            document = json.loads(self.body)
        except ValueError:
            return self.body.decode("utf-8", "replace")[:1000] or f"HTTP {self.status}"
        if isinstance(document, dict):
            error = document.get("error")
            if isinstance(error, dict):  # OpenAI's shape
                error = error.get("message")
            if isinstance(error, str):
                return error
        return json.dumps(document)[:1000]

    def trailing(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, self.headers[key]) for key in _TRAILING if key in self.headers)


# ---- the servicer ---------------------------------------------------------------------------------------------------


def _unimplemented(what: str) -> Callable[..., Awaitable[Any]]:
    """An RPC the agent does not implement: UNIMPLEMENTED, saying what instead."""

    async def rpc(self: Any, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the Spillway agent does not implement {what}")

    return rpc


def _model_path(name: str, version: str, *rest: str) -> str:
    path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "")
    return "/".join([path, *rest])


class _Stream:
    """One ModelStreamInfer: its responses in the order they go out, and its requests in flight, at most `limit`
    (the reader waits for room before it takes on another; a request leaves once its last response is sent)."""

    def __init__(self, limit: int) -> None:
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.limit = limit
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.room = asyncio.Event()
        self.reading = True  # the client may still send
        self.closing = False  # the agent drains
        self.waiting: Any = None  # a request read, waiting for room

    async def admit(self, request: Any) -> bool:
        """Wait for room for `request` and count it in flight; False when the agent drains (it is answered so)."""
        self.waiting = request
        while self.in_flight >= self.limit and not self.closing:
            self.room.clear()
            await self.room.wait()
        answered_by_close = self.waiting is not request
        self.waiting = None
        if self.closing:
            if not answered_by_close:
                self.responses.put_nowait(_refusal(request, SHUTTING_DOWN))
            return False
        self.in_flight += 1
        return True

    def answered(self) -> None:
        """A request's last response has been sent: room for another."""
        self.in_flight -= 1
        self.room.set()

    def close(self) -> None:
        """The agent drains: what is in flight goes on; a request waiting for room, and each read from now on, is
        answered "the agent is shutting down"."""
        self.closing = True
        if self.waiting is not None:
            self.responses.put_nowait(_refusal(self.waiting, SHUTTING_DOWN))
            self.waiting = None
        self.room.set()
        self.responses.put_nowait(_WAKE)

    @property
    def over(self) -> bool:
        """Nothing in flight, and nothing more will be taken on: the client closed its side, or the agent drains."""
        return self.in_flight == 0 and (not self.reading or self.closing)


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app: InferenceApp, *, stream_limit: int = STREAM_IN_FLIGHT) -> None:
        self.app = app
        self.stream_limit = stream_limit
        self.closing = False
        self.streams: set[_Stream] = set()  # each open ModelStreamInfer
        self.running: set[asyncio.Task[None]] = set()  # the app calls under way

    # ---- calling the app ----

    def _headers(self, context: Any, extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
        headers = list(extra or ())
        budget_us = None
        for key, value in context.invocation_metadata() or ():
            raw_key = key.encode("latin-1").lower()
            if raw_key in _FORWARDED and isinstance(value, str):
                if raw_key == b"spillway-timeout-us":
                    budget_us = value.strip()
                else:
                    headers.append((raw_key, value.encode("latin-1")))
        remaining = context.time_remaining()
        if remaining is not None:  # the RPC's deadline, as the budget the HTTP path reads
            left_us = max(1, int(remaining * 1e6))
            budget_us = str(min(left_us, int(budget_us)) if budget_us and budget_us.isdigit() else left_us)
        if budget_us is not None:
            headers.append((names.H_TIMEOUT_US.encode(), budget_us.encode("latin-1")))
        return headers

    def _exchange(self, context: Any, method: str, path: str, body: bytes = b"",
                  headers: list[tuple[bytes, bytes]] | None = None) -> _Exchange:  # fmt: skip
        return _Exchange(self.app, self.running, method, path, self._headers(context, headers), body,
                         context.peer() or "")  # fmt: skip

    async def _call(self, context: Any, method: str, path: str, body: bytes = b"",
                    headers: list[tuple[bytes, bytes]] | None = None) -> _Answer:  # fmt: skip
        exchange = self._exchange(context, method, path, body, headers)
        try:
            status, answer_headers = await exchange.head()
            return _Answer(status, answer_headers, await exchange.body_whole())
        finally:
            exchange.leave()

    async def _ok(self, context: Any, method: str, path: str, body: bytes = b"", *, also: tuple[int, ...] = ()
                  ) -> _Answer:  # fmt: skip
        """The app's answer when it is a 200 (or one of `also`); else the RPC ends with the status it maps to."""
        answer = await self._call(context, method, path, body)
        if answer.status != 200 and answer.status not in also:
            await _abort(context, answer)
        return answer

    # ---- health and metadata ----

    async def ServerLive(self, request: Any, context: Any) -> Any:
        answer = await self._ok(context, "GET", "/v2/health/live")
        return service_pb2.ServerLiveResponse(live=bool(answer.json().get("live")))

    async def ServerReady(self, request: Any, context: Any) -> Any:
        answer = await self._ok(context, "GET", "/v2/health/ready", also=(503,))
        return service_pb2.ServerReadyResponse(ready=answer.status == 200)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        # Unknown (404) or not ready (503): not ready, as tritonclient.http's is_model_ready says for either.
        answer = await self._ok(context, "GET", _model_path(request.name, request.version, "ready"), also=(404, 503))
        return service_pb2.ModelReadyResponse(ready=answer.status == 200)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        answer = await self._ok(context, "GET", "/v2")
        return json_format.ParseDict(answer.json(), service_pb2.ServerMetadataResponse(), ignore_unknown_fields=True)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        answer = await self._ok(context, "GET", _model_path(request.name, request.version))
        return json_format.ParseDict(answer.json(), service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        answer = await self._ok(context, "GET", _model_path(request.name, request.version, "config"))
        response = service_pb2.ModelConfigResponse()
        json_format.ParseDict(answer.json(), response.config, ignore_unknown_fields=True)
        return response

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        path = _model_path(request.name, request.version, "stats") if request.name else "/v2/models/stats"
        answer = await self._ok(context, "GET", path)
        return json_format.ParseDict(answer.json(), service_pb2.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)  # fmt: skip

    # ---- the repository extension ----

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        body = json.dumps({"ready": request.ready}).encode()
        answer = await self._ok(context, "POST", "/v2/repository/index", body)
        return json_format.ParseDict({"models": answer.json()}, service_pb2.RepositoryIndexResponse(),
                                     ignore_unknown_fields=True)  # fmt: skip

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._ok(context, "POST", f"/v2/repository/models/{request.model_name}/load", _repository_body(request))
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._ok(context, "POST", f"/v2/repository/models/{request.model_name}/unload",
                       _repository_body(request))  # fmt: skip
        return service_pb2.RepositoryModelUnloadResponse()

    # ---- inference ----

    def _generative(self, name: str) -> bool:
        return self.app.openai is not None and name in self.app.openai.engines

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self._generative(request.model_name):  # decoupled, in Triton's words: ModelInfer cannot answer it
            message = f"model {request.model_name!r} is generative: send it on ModelStreamInfer, as Triton's clients do"
            return await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        answer = await self._infer(request, context)
        context.set_trailing_metadata(answer.trailing())
        if answer.status not in (200, 202):
            await _abort(context, answer)
        try:
            return _infer_response(request, answer)
        except Exception:  # a V2 answer we cannot read back is ours to fix
            log.exception("the answer to a gRPC ModelInfer of %s could not be converted", request.model_name)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the agent log")

    async def _infer(self, request: Any, context: Any) -> _Answer:
        path = _model_path(request.model_name, request.model_version, "infer")
        try:
            body, header_length = infer_request_to_v2(request)
        except TensorError as exc:  # what the messages cannot say in V2 (grpc_codec.py)
            return await self._refused_by_app(context, path, str(exc))
        headers = [(b"content-type", b"application/octet-stream"),
                   (names.H_HEADER_LENGTH.encode(), str(header_length).encode())]  # fmt: skip
        return await self._call(context, "POST", path, body, headers)

    async def _refused_by_app(self, context: Any, path: str, message: str) -> _Answer:
        """A request the codec refused, answered by the app as it answers any bad request: sent on with an empty
        body, which it refuses after checking the token and the model (400 `invalid_request`, counted on the model,
        as over HTTP); the answer says the codec's `message` rather than the decoder's words on the empty body."""
        answer = await self._call(context, "POST", path, b"", [(b"content-type", b"application/json")])
        if answer.status != 400:  # refused before the body was read (401, 404...): that refusal stands
            return answer
        return _Answer(400, answer.headers, json.dumps({"error": message}).encode())

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Each request is answered as it comes, concurrently with the others on the stream (at most
        `stream_limit` at once); each response carries its request's id. See the module docstring for the drain."""
        stream = _Stream(self.stream_limit)

        def finished(task: asyncio.Task[None]) -> None:
            stream.tasks.discard(task)
            stream.responses.put_nowait(_DONE)  # after the task's own responses: it put them before it ended

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if await stream.admit(request):
                        task = asyncio.ensure_future(self._stream_one(request, context, stream.responses.put_nowait))
                        stream.tasks.add(task)
                        task.add_done_callback(finished)
            except Exception as exc:  # the client's side of the stream broke: the RPC ends with it
                log.debug("a gRPC stream's requests ended: %r", exc)
            finally:
                stream.reading = False
                stream.responses.put_nowait(_WAKE)

        reader = asyncio.ensure_future(read())
        self.streams.add(stream)
        if self.closing:
            stream.close()
        try:
            while True:
                item = await stream.responses.get()
                if item is _DONE:
                    stream.answered()
                elif item is not _WAKE:
                    yield item
                    continue
                if stream.over:
                    break
            client_open = stream.reading
            reader.cancel()
            await asyncio.wait([reader])
            while not stream.responses.empty():  # what the reader answered as it stopped
                item = stream.responses.get_nowait()
                if item is not _DONE and item is not _WAKE:
                    yield item
            if client_open:  # the agent drains: what the client sends from now on would never be read
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"{SHUTTING_DOWN}: this stream takes no more requests")  # fmt: skip
        finally:
            self.streams.discard(stream)
            reader.cancel()
            for task in list(stream.tasks):  # the client left: what it asked for is cancelled, as HTTP's would be
                task.cancel()

    def close_streams(self) -> None:
        """The agent drains: each stream ends once what it has in flight is answered."""
        self.closing = True
        for stream in self.streams:
            stream.close()

    async def settle(self, timeout_s: float = 1.0) -> None:
        """After the server stopped: the app calls still under way (their RPCs are over, so they answer nobody) are
        cancelled, and awaited for up to `timeout_s` (a cancelled call ends at its next await)."""
        running = list(self.running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout_s)

    async def _stream_one(self, request: Any, context: Any, send: Callable[[Any], None]) -> None:
        """Answer one request of a stream: its responses, or one `error_message` (with the request's id in its
        `infer_response`, as Triton says it); never raises."""
        try:
            if self._generative(request.model_name):
                await self._generate(request, context, send)
                return
            answer = await self._infer(request, context)
            if answer.status not in (200, 202):
                send(_stream_error(request, answer))
                return
            response = service_pb2.ModelStreamInferResponse()
            infer = response.infer_response
            infer.CopyFrom(_infer_response(request, answer))
            infer.id = infer.id or request.id  # on a stream, the id is how the client tells its answers apart
            infer.parameters["triton_final_response"].bool_param = True
            send(response)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a gRPC stream request for %s failed", request.model_name)
            send(_refusal(request, "internal error; see the agent log"))

    async def _generate(self, request: Any, context: Any, send: Callable[[Any], None]) -> None:
        """Triton's decoupled generate stream: the generate extension's events, each as one response
        (grpc_generate.py)."""
        try:
            body, stream = generate_body(request)
        except TensorError as exc:
            path = _model_path(request.model_name, request.model_version, "generate")
            send(_stream_error(request, await self._refused_by_app(context, path, str(exc))))
            return
        path = _model_path(request.model_name, request.model_version, "generate_stream" if stream else "generate")
        exchange = self._exchange(context, "POST", path, json.dumps(body).encode(),
                                  [(b"content-type", b"application/json")])  # fmt: skip
        try:
            status, headers = await exchange.head()
            if status != 200:
                send(_stream_error(request, _Answer(status, headers, await exchange.body_whole())))
                return
            outcome = headers.get(names.H_OUTCOME)
            final = False
            if not headers.get("content-type", "").startswith("text/event-stream"):
                event = json.loads(await exchange.body_whole())
                send(generated(request, event, outcome, last=True))
                return
            async for event in sse_events(exchange.chunks()):
                failed = event_error(event)
                if failed is not None:
                    send(_refusal(request, failed))
                    return
                final = event.get("finish_reason") is not None
                send(generated(request, event, outcome, last=final))
            if not final:  # a stream that ended without its last event: an empty final response says so
                send(generated(request, {}, outcome, last=True))
        finally:
            exchange.leave()

    # ---- what the agent does not implement ----

    SystemSharedMemoryStatus = _unimplemented(_SHM)
    SystemSharedMemoryRegister = _unimplemented(_SHM)
    SystemSharedMemoryUnregister = _unimplemented(_SHM)
    CudaSharedMemoryStatus = _unimplemented(_CUDA_SHM)
    CudaSharedMemoryRegister = _unimplemented(_CUDA_SHM)
    CudaSharedMemoryUnregister = _unimplemented(_CUDA_SHM)
    TraceSetting = _unimplemented("Triton's trace extension")
    LogSettings = _unimplemented("Triton's log settings: the agent logs as its `--log-level` says")


async def _abort(context: Any, answer: _Answer) -> None:
    code = _STATUS_CODES.get(answer.status, grpc.StatusCode.UNKNOWN)
    await context.abort(code, answer.error(), trailing_metadata=answer.trailing())


def _repository_body(request: Any) -> bytes:
    """A load/unload request's parameters as the HTTP body (file contents base64, as Triton's HTTP API takes them)."""
    import base64

    parameters = {
        key: base64.b64encode(value).decode() if isinstance(value, bytes) else value
        for key, value in parameters_to_dict(request.parameters).items()
    }
    return json.dumps({"parameters": parameters} if parameters else {}).encode()


def _infer_response(request: Any, answer: _Answer) -> Any:
    """The app's 200 (V2 body) or 202 (a job accepted) as a ModelInferResponse."""
    if answer.status == 202:
        job = answer.json()
        response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                                  id=request.id)  # fmt: skip
        set_parameters(response.parameters, {**job.get("parameters", {}), "spillway_outcome": names.QUEUED_ASYNC,
                                             "spillway_job_id": job.get("id"),
                                             "spillway_job_location": job.get("location")})  # fmt: skip
        return response
    length = answer.headers.get(names.H_HEADER_LENGTH)
    return v2_response_to_infer(answer.body, int(length) if length and length.isdigit() else None)


def _stream_error(request: Any, answer: _Answer) -> Any:
    """An HTTP refusal as a stream's `error_message`: the error's text, then why and when to come back."""
    said = [f"{key} {answer.headers[key]}" for key in (names.H_OUTCOME, names.H_REASON, names.H_RETRY_AFTER)
            if key in answer.headers]  # fmt: skip
    return _refusal(request, answer.error() + (f" ({'; '.join(said)})" if said else ""))


def _refusal(request: Any, message: str) -> Any:
    """A stream's `error_message` for `request`, its model, version and id in `infer_response` (as Triton says it)."""
    response = service_pb2.ModelStreamInferResponse(error_message=message)
    infer = response.infer_response
    infer.model_name, infer.model_version, infer.id = request.model_name, request.model_version, request.id
    return response


# ---- the server -----------------------------------------------------------------------------------------------------


class GrpcEndpoint:
    """The gRPC server of one agent: bound (`bind`, before the app starts, so that a busy port is a start error),
    started once the app is (`start`), stopped with the HTTP drain (`stop`)."""

    def __init__(self, app: InferenceApp, *, max_body_bytes: int, max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                 stream_limit: int = STREAM_IN_FLIGHT) -> None:  # fmt: skip
        """`max_body_bytes`: the app's limit on a request body; gRPC receives a message `PROTOBUF_OVERHEAD_BYTES`
        bigger, so that the app's 413 is what a request just over the limit meets."""
        self.app = app
        self.max_receive_bytes = max_body_bytes + PROTOBUF_OVERHEAD_BYTES
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.stream_limit = stream_limit
        self.server: Any = None
        self.servicer: _Servicer | None = None
        self.port: int | None = None

    def bind(self, host: str, port: int) -> int:
        """Bind `host:port` (0: a free port) and return the port; PortBusy when another process holds it."""
        check_free(host, port)
        self.server = grpc.aio.server(maximum_concurrent_rpcs=self.max_concurrent_rpcs, options=[
            ("grpc.so_reuseport", 0),  # a second agent on the same port must fail, not share it
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", _SEND_UNLIMITED),
        ])  # fmt: skip
        self.servicer = _Servicer(self.app, stream_limit=self.stream_limit)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # taken between the check and the bind
            raise PortBusy(f"cannot bind {address}: {exc}") from None
        if not bound:
            raise PortBusy(f"cannot bind {address}")
        self.port = int(bound)
        return self.port

    async def start(self) -> None:
        assert self.server is not None, "bind first"
        await self.server.start()

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new RPCs at once; let those in flight end within `grace_s` (None: cancel them now), an open stream
        as soon as it has nothing in flight; then end the app calls left (their RPCs are over). Idempotent."""
        if self.servicer is not None:
            self.servicer.close_streams()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.servicer is not None:
            await self.servicer.settle()
