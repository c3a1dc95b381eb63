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

An HTTP error is the RPC's status (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND,
405 UNIMPLEMENTED, 409 FAILED_PRECONDITION, 413 INVALID_ARGUMENT, 429 and 507 RESOURCE_EXHAUSTED, 500 INTERNAL, 503
UNAVAILABLE, 504 DEADLINE_EXCEEDED) with the error's text as its message; on a stream it is that request's
`error_message`, and the stream goes on. `spillway-outcome`, `spillway-reason`, `retry-after`, `spillway-variant`,
`spillway-backend` and `spillway-job-id` are the trailing metadata of a ModelInfer, answered or not; a successful
answer also says `spillway_outcome` in its parameters, as the HTTP body does. A request the async queue accepted (HTTP
202) is a ModelInferResponse without outputs whose parameters say `spillway_outcome: queued_async`,
`spillway_job_id` and `spillway_job_location` (its answer: `GET /spillway/v1/jobs/{id}` on the HTTP port).

The shared memory, trace and log RPCs answer UNIMPLEMENTED. Needs grpcio (`pip install 'spillway[grpc]'`); this
module is imported only when gRPC serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_agent.serving.app import InferenceApp
from spillway.contract import names
from spillway.contract.grpc_codec import infer_request_to_v2, parameters_to_dict, set_parameters, v2_response_to_infer
from spillway.contract.v2 import TensorError, decode_request

__all__ = ["GrpcEndpoint", "PortBusy"]

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
# Request parameters of Triton's own that mean nothing to the generate extension.
_TRITON_ONLY = frozenset({"sequence_id", "sequence_start", "sequence_end", "headers", "binary_data_output"})
# Inputs of Triton's LLM backends (vLLM, TensorRT-LLM) under the generate extension's names.
_GENERATE_ALIASES = {"random_seed": "seed", "stop_words": "stop"}
_GENERATE_DROPPED = frozenset({"exclude_input_in_output", "stream"})
_SEND_UNLIMITED = (1 << 31) - 1
_SHM = "the system shared memory extension: send tensors in the request (raw_input_contents or contents)"
_CUDA_SHM = "the CUDA shared memory extension: send tensors in the request (raw_input_contents or contents)"
_WAKE = object()  # on a stream's queue: a request was answered, the reading ended, or the agent drains
_RUNNING: set[asyncio.Task[None]] = set()  # app calls outliving their RPC (answered to nobody, as HTTP's would be)


class PortBusy(OSError):
    """The gRPC port cannot be bound (another process holds it)."""


# ---- one HTTP request to the app, in-process -------------------------------------------------------------------------


class _Exchange:
    """One request to the ASGI app: its answer's messages arrive on `messages`; `leave()` tells the app the client is
    gone (its `receive` says `http.disconnect`), as when an HTTP client disconnects. The app's task is never
    cancelled from here: it finishes and records its outcome whatever becomes of the RPC."""

    _END: dict[str, Any] = {"type": "spillway.end"}

    def __init__(self, app: InferenceApp, method: str, path: str, headers: list[tuple[bytes, bytes]],
                 body: bytes, peer: str) -> None:  # fmt: skip
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
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)

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


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app: InferenceApp) -> None:
        self.app = app
        self.closing = False
        self.streams: set[asyncio.Queue[Any]] = set()  # each open ModelStreamInfer's responses

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
        return _Exchange(self.app, method, path, self._headers(context, headers), body, context.peer() or "")

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
        try:
            answer = await self._infer(request, context)
        except TensorError as exc:  # what the messages cannot say in V2 (grpc_codec.py); answered, never counted
            return await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), trailing_metadata=_INVALID)
        context.set_trailing_metadata(answer.trailing())
        if answer.status not in (200, 202):
            await _abort(context, answer)
        try:
            return _infer_response(request, answer)
        except Exception:  # a V2 answer we cannot read back is ours to fix
            log.exception("the answer to a gRPC ModelInfer of %s could not be converted", request.model_name)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the agent log")

    async def _infer(self, request: Any, context: Any) -> _Answer:
        body, header_length = infer_request_to_v2(request)
        headers = [(b"content-type", b"application/octet-stream"),
                   (names.H_HEADER_LENGTH.encode(), str(header_length).encode())]  # fmt: skip
        path = _model_path(request.model_name, request.model_version, "infer")
        return await self._call(context, "POST", path, body, headers)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Each request is answered as it comes, concurrently with the others on the stream; each response carries
        its request's id. Once the agent drains, the stream ends as soon as it has nothing in flight."""
        responses: asyncio.Queue[Any] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        reading = True

        def finished(task: asyncio.Task[None]) -> None:
            running.discard(task)
            responses.put_nowait(_WAKE)  # after the task's own responses: it put them before it ended

        async def read() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._stream_one(request, context, responses.put_nowait))
                    running.add(task)
                    task.add_done_callback(finished)
            except Exception as exc:  # the client's side of the stream broke: the RPC ends with it
                log.debug("a gRPC stream's requests ended: %r", exc)
            finally:
                reading = False
                responses.put_nowait(_WAKE)

        reader = asyncio.ensure_future(read())
        self.streams.add(responses)
        try:
            while True:
                item = await responses.get()
                if item is not _WAKE:
                    yield item
                elif not running and (not reading or self.closing):
                    return
        finally:
            self.streams.discard(responses)
            reader.cancel()
            for task in list(running):  # the client left: what it asked for is cancelled, as HTTP's would be
                task.cancel()

    def close_streams(self) -> None:
        """The agent drains: each stream ends once what it has in flight is answered."""
        self.closing = True
        for responses in self.streams:
            responses.put_nowait(_WAKE)

    async def _stream_one(self, request: Any, context: Any, send: Callable[[Any], None]) -> None:
        """Answer one request of a stream: its responses, or one `error_message` (with the request's id in its
        `infer_response`, as Triton says it); never raises."""

        def put(response: Any) -> None:
            if response.error_message:
                infer = response.infer_response
                infer.model_name, infer.model_version, infer.id = request.model_name, request.model_version, request.id
            send(response)

        try:
            if self._generative(request.model_name):
                await self._generate(request, context, put)
                return
            answer = await self._infer(request, context)
            if answer.status not in (200, 202):
                put(_stream_error(answer))
                return
            response = service_pb2.ModelStreamInferResponse()
            response.infer_response.CopyFrom(_infer_response(request, answer))
            response.infer_response.parameters["triton_final_response"].bool_param = True
            put(response)
        except TensorError as exc:
            put(service_pb2.ModelStreamInferResponse(error_message=str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("a gRPC stream request for %s failed", request.model_name)
            put(service_pb2.ModelStreamInferResponse(error_message="internal error; see the agent log"))

    async def _generate(self, request: Any, context: Any, put: Callable[[Any], None]) -> None:
        """Triton's decoupled generate stream: the generate extension's events, each as one response."""
        body, stream = _generate_body(request)
        path = _model_path(request.model_name, request.model_version, "generate_stream" if stream else "generate")
        exchange = self._exchange(context, "POST", path, json.dumps(body).encode(),
                                  [(b"content-type", b"application/json")])  # fmt: skip
        try:
            status, headers = await exchange.head()
            if status != 200:
                put(_stream_error(_Answer(status, headers, await exchange.body_whole())))
                return
            outcome = headers.get(names.H_OUTCOME)
            final = False
            if not headers.get("content-type", "").startswith("text/event-stream"):
                event = json.loads(await exchange.body_whole())
                put(_generated(request, event, outcome, last=True))
                return
            async for event in _events(exchange.chunks()):
                failed = _failed(event)
                if failed is not None:
                    put(service_pb2.ModelStreamInferResponse(error_message=failed))
                    return
                final = event.get("finish_reason") is not None
                put(_generated(request, event, outcome, last=final))
            if not final:  # a stream that ended without its last event: an empty final response says so
                put(_generated(request, {}, outcome, last=True))
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


_INVALID = ((names.H_OUTCOME, names.REJECTED), (names.H_REASON, "invalid_request"))


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


def _stream_error(answer: _Answer) -> Any:
    """An HTTP refusal as a stream's `error_message`: the error's text, then why and when to come back."""
    said = [f"{key} {answer.headers[key]}" for key in (names.H_OUTCOME, names.H_REASON, names.H_RETRY_AFTER)
            if key in answer.headers]  # fmt: skip
    message = answer.error() + (f" ({'; '.join(said)})" if said else "")
    return service_pb2.ModelStreamInferResponse(error_message=message)


# ---- the generate extension over a stream ----------------------------------------------------------------------------


def _generate_body(request: Any) -> tuple[dict[str, Any], bool]:
    """A ModelInferRequest for a generative model as the generate extension's body (`text_input` and `parameters`),
    and whether it streams (its `stream` input or parameter; true unless set false). The other inputs (one element
    each) and the request parameters become parameters: `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`
    (`random_seed`), `stop` (`stop_words`), `ignore_eos`, `priority`, `timeout`...; `sampling_parameters` (vLLM's
    backend: a JSON object) is read as more of them."""
    payload, header_length = infer_request_to_v2(request)
    decoded = decode_request(payload, header_length)
    parameters = {k: v for k, v in decoded.parameters.items() if k not in _TRITON_ONLY and not k.startswith("triton_")}
    text: Any = None
    stream = parameters.pop("stream", True)
    for tensor in decoded.inputs:
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in tensor.array.ravel().tolist()]
        value: Any = values[0] if len(values) == 1 else values
        if tensor.name == "text_input":
            text = value
        elif tensor.name == "stream":
            stream = value
        elif tensor.name == "sampling_parameters":
            try:
                more = json.loads(value) if isinstance(value, str) else None
            except ValueError:
                more = None
            if not isinstance(more, dict):
                raise TensorError("input 'sampling_parameters': must be one BYTES element holding a JSON object")
            parameters.update(more)
        elif tensor.name not in _GENERATE_DROPPED and not tensor.name.startswith("return_"):
            parameters[_GENERATE_ALIASES.get(tensor.name, tensor.name)] = value
    if not isinstance(text, str):
        raise TensorError("input 'text_input': a generative model needs one BYTES element with the prompt")
    return {"text_input": text, "parameters": parameters}, stream is not False


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events (`data: {json}` blocks) as JSON objects."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data and data != b"[DONE]":
                        event = json.loads(data)
                        if isinstance(event, dict):
                            yield event


def _failed(event: dict[str, Any]) -> str | None:
    """The error an event reports: an error event, or a generation that ended by failing."""
    if "error" in event:
        error = event["error"]
        return str(error.get("message") if isinstance(error, dict) else error)
    if event.get("finish_reason") == "error":
        return "the model run failed; see the agent log"
    if event.get("finish_reason") == "cancelled":
        return "the model's engine closed before the generation ended"
    return None


def _generated(request: Any, event: dict[str, Any], outcome: str | None, *, last: bool) -> Any:
    """One generate event as a stream response: `text_output` (BYTES [1]) and, on the last, `triton_final_response`,
    `finish_reason` and `spillway_outcome`."""
    response = service_pb2.ModelStreamInferResponse()
    infer = response.infer_response
    infer.model_name = str(event.get("model_name", request.model_name))
    infer.model_version = str(event.get("model_version", request.model_version))
    infer.id = request.id
    if "text_output" in event:
        text = str(event["text_output"]).encode()
        output = infer.outputs.add()
        output.name, output.datatype = "text_output", "BYTES"
        output.shape.append(1)
        infer.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    parameters: dict[str, Any] = {"triton_final_response": last}
    if last:
        spillway = event.get(names.OPENAI_FIELD)
        said = spillway.get("outcome") if isinstance(spillway, dict) else None
        parameters.update(finish_reason=event.get("finish_reason"), spillway_outcome=said or outcome)
    set_parameters(infer.parameters, parameters)
    return response


# ---- the server -----------------------------------------------------------------------------------------------------


class GrpcEndpoint:
    """The gRPC server of one agent: bound (`bind`, before the app starts, so that a busy port is a start error),
    started once the app is (`start`), stopped with the HTTP drain (`stop`)."""

    def __init__(self, app: InferenceApp, *, max_receive_bytes: int) -> None:
        self.app = app
        self.max_receive_bytes = max_receive_bytes
        self.server: Any = None
        self.servicer: _Servicer | None = None
        self.port: int | None = None

    def bind(self, host: str, port: int) -> int:
        """Bind `host:port` (0: a free port) and return the port; PortBusy when another process holds it."""
        _check_free(host, port)
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a second agent on the same port must fail, not share it
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", _SEND_UNLIMITED),
        ])  # fmt: skip
        self.servicer = _Servicer(self.app)
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
        as soon as it has nothing in flight. Idempotent."""
        if self.servicer is not None:
            self.servicer.close_streams()
        if self.server is not None:
            await self.server.stop(grace_s)


def _check_free(host: str, port: int) -> None:
    """PortBusy when something listens on `host:port` (checked with a plain socket, so that gRPC's own failure, which
    it logs at length, is not the first word on it)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortBusy(f"cannot resolve {host}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise PortBusy(f"port {port} on {host} is busy ({exc.strerror})") from None
