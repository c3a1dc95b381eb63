"""The Open Inference Protocol (KServe V2) over HTTP, as a plain ASGI app: lean enough to add well under
a millisecond to a request, with Triton's status codes and error shape."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edge_agent import __version__
from edge_agent.overflow.fallback import ResponseCache, default_answer, inputs_key
from edge_agent.overflow.forward import Forwarded, Forwarder
from edge_agent.overflow.jobs import QueueFull, StoreUnavailable
from edge_agent.runtime.repository import UnknownModelError
from edge_agent.scheduling.worker import ExecutionFailed, Refused
from edge_agent.serving.models import LoadedModel, ModelRegistry
from spillway.contract.spec import ModelConfig
from spillway.contract.v2 import (
    DecodedRequest,
    RequestedOutput,
    TensorError,
    decode_request,
    encode_error,
    encode_response,
    validate_inputs,
    with_parameters,
)

if TYPE_CHECKING:
    from edge_agent.overflow.queue import AsyncQueue
    from edge_agent.policy.plan import ModelPlan

log = logging.getLogger("spillway.agent")
Scope = dict[str, Any]
Receive = Any
Send = Any

_UNAUTHENTICATED = {"/v2/health/live"}
_INLINE_BYTES = 256 << 10  # bodies up to this size are decoded on the event loop (tens of microseconds)
_INLINE_ELEMENTS = 64 << 10  # outputs up to this many elements are encoded on the event loop


# A request refused because its fallback found no cached answer is told to come back after this long.
FALLBACK_MISS_RETRY_AFTER_S = 5
# A job's status that the job store cannot read now (an I/O error) is asked for again after this long.
STORE_UNAVAILABLE_RETRY_AFTER_S = 5
# Admission refusals that overflow turns into a trip to the cloud (the device cannot serve them in time).
OVERFLOWING = frozenset({"deadline_unmeetable", "queue_full"})
JOBS_PREFIX = "/spillway/v1/jobs/"


class PolicyGate(Protocol):
    """What admission asks the active policy (the agent's PolicyApplier)."""

    def plan_for(self, name: str) -> ModelPlan | None: ...


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class InferenceApp:
    """Routes `/v2/...`; inference goes to each model's worker."""

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        token: str | None = None,
        max_body_bytes: int = 64 << 20,
        allow_non_finite: bool = True,
        policy: PolicyGate | None = None,
        responses: ResponseCache | None = None,
        status: Callable[[], dict[str, Any]] | None = None,
        forwarder: Forwarder | None = None,
        default_outputs: dict[str, dict[str, np.ndarray]] | None = None,
        jobs: AsyncQueue | None = None,
    ) -> None:
        """Args beyond the obvious:
        policy: overflow, shed, fallback and variant decisions per model (None: serve everything as configured).
        responses: recent successful answers, filled on every success and read by `cache` fallbacks.
        status: the body of `GET /v2/spillway/status`.
        forwarder: overflow to the control plane's gateway (None: nowhere to overflow to).
        default_outputs: per model, the outputs (one row each) answered as `fallback_default` when overflow fails.
        jobs: the async queue, the last fallback when overflow fails, for the models it accepts.
        """
        self.registry = registry
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.allow_non_finite = allow_non_finite
        self.policy = policy
        self.responses = responses if responses is not None and responses.enabled else None
        self.status = status
        self.forwarder = forwarder
        self.default_outputs = default_outputs or {}
        self.jobs = jobs
        self._draw = random.Random().random  # noqa: S311 (overflow fractions, not secrets)
        self.ready = True
        self.unrouted: Counter[str] = Counter()  # infer requests for models that do not exist
        # Run at lifespan startup (before the first request: the cached policy, the poller) and shutdown.
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        send = self._closing_when_draining(send)
        path: str = scope["path"]
        headers = dict(scope["headers"])
        if self.token is not None and path not in _UNAUTHENTICATED and not self._authorised(headers):
            await _respond(send, 401, encode_error("missing or invalid bearer token"),
                           extra=[(b"www-authenticate", b"Bearer")])  # fmt: skip
            return
        method: str = scope["method"]
        try:
            if method == "POST" and path.endswith("/infer"):
                await self._infer(path, headers, receive, send)
            elif method in ("GET", "HEAD") and path.startswith(JOBS_PREFIX):
                await self._job(path[len(JOBS_PREFIX) :], send)
            elif method in ("GET", "HEAD"):
                await self._get(path, send)
            else:
                await _respond(send, 405, encode_error(f"method {method} not allowed on {path}"))
        except UnknownModelError as exc:
            await _respond(send, 404, encode_error(str(exc)))
        except StoreUnavailable as exc:  # reading a job (or the status's job counts) from a store that refuses
            body = json.dumps({"error": str(exc), "reason": exc.reason}).encode()
            await _respond(send, 503, body, extra=[(b"retry-after", str(STORE_UNAVAILABLE_RETRY_AFTER_S).encode())])

    def _closing_when_draining(self, send: Send) -> Send:
        """Once draining, every answer closes its connection, so no client reuses one the agent will close."""

        async def closing_send(message: dict[str, Any]) -> None:
            if not self.ready and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        return closing_send

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        assert self.token is not None
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    for hook in self.on_startup:
                        await hook()
                except Exception as exc:
                    log.exception("agent startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for hook in self.on_shutdown:
                    try:
                        await hook()
                    except Exception:  # one failing hook must not keep the others from running
                        log.exception("agent shutdown step failed")
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- metadata, health, statistics ------------------------------------------------------------

    async def _get(self, path: str, send: Send) -> None:
        parts = path.strip("/").split("/")
        if parts == ["v2"]:
            body = {"name": "spillway-edge-agent", "version": __version__,
                    "extensions": ["binary_tensor_data", "statistics", "parameters"]}  # fmt: skip
            await _respond_json(send, 200, body)
        elif parts == ["v2", "health", "live"]:
            await _respond_json(send, 200, {"live": True})
        elif parts == ["v2", "health", "ready"]:
            await _respond_json(send, 200 if self.ready else 503, {"ready": self.ready})
        elif parts == ["v2", "spillway", "status"] and self.status is not None:
            await _respond_json(send, 200, self.status())
        elif parts == ["v2", "models", "stats"]:
            stats = [m.worker.stats.json(m.config.name, str(m.version)) for m in self.registry.all()]
            await _respond_json(send, 200, {"model_stats": stats})
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            name, version, rest = _model_path(parts[2:])
            model = self.registry.get(name, version)
            if rest == []:
                await _respond_json(send, 200, self._metadata(model.config.name, version))
            elif rest == ["ready"]:
                ready = self.ready and not model.worker.scheduler.draining
                await _respond_json(send, 200 if ready else 503, {"name": name, "ready": ready})
            elif rest == ["stats"]:
                if version:  # the statistics of that very version, wherever its traffic goes now
                    found = self.registry.loaded(name, _version_number(name, version))
                    if found is None:
                        raise UnknownModelError(f"unknown version '{version}' of model '{name}'")
                    model = found
                models = [model] if version else [m for m in self.registry.all() if m.config.name == name]
                stats = [m.worker.stats.json(m.config.name, str(m.version)) for m in models]
                await _respond_json(send, 200, {"model_stats": stats})
            else:
                await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
        else:
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))

    def _metadata(self, name: str, version: str | None) -> dict[str, Any]:
        model = self.registry.get(name, version)
        config = model.config
        batch = [-1] if config.max_batch_size > 0 else []

        def tensors(specs: Any) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": batch + list(t.shape)} for t in specs]

        return {
            "name": config.name,
            "versions": [str(v) for v in self.registry.versions(config.name)],
            "platform": config.platform,
            "inputs": tensors(config.inputs),
            "outputs": tensors(config.outputs),
        }

    async def _job(self, job_id: str, send: Send) -> None:
        """`GET /spillway/v1/jobs/{id}`: an async job's status, and its answer once done."""
        if self.jobs is None:
            await _respond(send, 404, encode_error("this agent has no async queue (agent config async_jobs.models)"))
            return
        job = await self.jobs.get(job_id) if 0 < len(job_id) <= 128 and "/" not in job_id else None
        if job is None:
            await _respond(send, 404, encode_error(f"no job {job_id!r} (unknown, or expired and removed)"))
            return
        body = job.json()
        extra = [(b"spillway-job-status", job.status.encode())]
        if job.status in ("queued", "running"):
            extra.append((b"retry-after", b"1"))
        await _respond(send, 200, json.dumps(body).encode(), extra=extra)

    # ---- inference -------------------------------------------------------------------------------

    async def _infer(self, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        parts = path.strip("/").split("/")
        name, version, rest = (
            _model_path(parts[2:]) if len(parts) >= 4 and parts[:2] == ["v2", "models"] else ("", None, [])
        )
        if rest != ["infer"]:
            await _respond(send, 404, encode_error(f"no such endpoint: {path}"))
            return
        try:
            model = self.registry.get(name, version)
        except UnknownModelError as exc:
            self.unrouted["unknown_model"] += 1
            await _reject(send, 404, str(exc), "unknown_model")
            return
        stats = model.worker.stats
        try:
            body = await self._read_body(headers, receive)
        except BodyTooLarge:
            stats.outcome(0, "rejected")
            await _reject(send, 413, f"request body exceeds {self.max_body_bytes} bytes", "payload_too_large")
            return
        except ClientGone:
            return  # nobody is left to answer
        config = model.config
        try:
            header_length = _header_length(headers)
            if len(body) > _INLINE_BYTES:  # a big body is decoded off the event loop, so it delays nobody
                request = await asyncio.to_thread(decode_request, body, header_length)
            else:
                request = decode_request(body, header_length)
            rows = validate_inputs(request.inputs, config.inputs, config.max_batch_size,
                                   allow_non_finite=self.allow_non_finite)  # fmt: skip
            _check_requested_outputs(request.outputs, config)
            priority, timeout_s = _scheduling_parameters(request.parameters)
            timeout_s = _within_budget(timeout_s, headers.get(b"spillway-timeout-us"))
        except (TensorError, ValueError) as exc:
            stats.outcome(0, "rejected")
            await _reject(send, 400, str(exc), "invalid_request")
            return
        # From here to the worker's admission nothing awaits: the route, the policy's verdict and the admission are
        # one step on the event loop, so a variant switch never admits a request to a version on its way out.
        try:
            model, redirected = self.registry.route(name, version)
        except UnknownModelError as exc:  # the version was unloaded while the body arrived
            stats.outcome(0, "rejected")
            await _reject(send, 404, str(exc), "unknown_model")
            return
        stats = model.worker.stats
        extra = [(b"spillway-variant", str(model.version).encode())] if redirected else []
        inputs = {i.name: i.array for i in request.inputs}
        plan = self.policy.plan_for(config.name) if self.policy is not None else None
        overflowing = plan is not None and plan.overflow is not None
        level = 0
        if plan is not None:
            level = model.worker.scheduler.resolve_level(priority)
            draw = self._draw() if plan.overflow is not None and plan.overflow.fraction else 1.0
            verdict = plan.admission(level, draw)
            if verdict == "overflow":
                context = _Context(path, body, headers, request, inputs, rows, model, level, extra, time.monotonic())
                deadline = model.worker.scheduler.deadline_for(level, context.arrived, timeout_s)
                await self._overflow(send, context, deadline, "the policy overflows this request")
                return
            if verdict == "shed":
                assert plan.shed is not None
                stats.outcome(level, "rejected")
                retry = str(plan.shed.retry_after_s).encode()
                message = f"priority {level} is shed for now (levels {plan.shed.at_or_below} and below)"
                await _reject(send, 503, message, "shed", extra=[(b"retry-after", retry), *extra])
                return
            if verdict == "fallback":
                await self._fallback(send, request, inputs, rows, model, level, plan, extra)
                return
        try:
            future = model.worker.admit(inputs, rows, priority, timeout_s, count_refused=not overflowing)
        except ValueError as exc:  # a priority the model cannot take
            stats.outcome(0, "rejected")
            await _reject(send, 400, str(exc), "invalid_request")
            return
        except Refused as exc:  # at admission: the device cannot take it in time
            if overflowing and exc.rejection.reason in OVERFLOWING:
                level = level or model.worker.scheduler.resolve_level(priority)
                context = _Context(path, body, headers, request, inputs, rows, model, level, extra, time.monotonic())
                deadline = model.worker.scheduler.deadline_for(level, context.arrived, timeout_s)
                await self._overflow(send, context, deadline, str(exc))
                return
            if overflowing:
                stats.outcome(model.worker.scheduler.resolve_level(priority), "rejected")
            retry = str(max(1, round(exc.rejection.retry_after_s))).encode()
            await _reject(send, 503, str(exc), exc.rejection.reason, extra=[(b"retry-after", retry), *extra])
            return
        try:
            served = await future
        except Refused as exc:  # timed out in the queue
            retry = str(max(1, round(exc.rejection.retry_after_s))).encode()
            await _reject(send, 503, str(exc), exc.rejection.reason, extra=[(b"retry-after", retry), *extra])
            return
        except ExecutionFailed as exc:
            await _respond(send, 500, _error_body(str(exc), "error"), extra=[(b"spillway-outcome", b"error"), *extra])
            return
        if self.responses is not None and sum(a.nbytes for a in inputs.values()) <= self.responses.capacity_bytes:
            self.responses.put(inputs_key(config.name, model.version, inputs), served.outputs)
        big = sum(a.size for a in served.outputs.values()) > _INLINE_ELEMENTS
        await self._answer(send, path, request, model, served.outputs, [(b"spillway-outcome", b"local"), *extra],
                           parameters=_LOCAL, offload=big)  # fmt: skip

    async def _overflow(self, send: Send, context: _Context, deadline: float | None, why: str) -> None:
        """Overflow and, when it fails, the fallback chain; an error of ours on the way is an `error` answer (500,
        JSON, counted), never a bare 500 from the server without an outcome."""
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._overflow_or_fall_back(tracking_send, context, deadline, why)
        except Exception:
            log.exception("overflow or the fallback chain of a request for %s failed", context.model.config.name)
            if started:  # the client has its status line already: nothing more can be said to it
                return
            context.model.worker.stats.outcome(context.level, "error")
            await _respond(send, 500, _error_body("internal error; see the agent log", "error"),
                           extra=[(b"spillway-outcome", b"error"), *context.extra])  # fmt: skip

    async def _overflow_or_fall_back(self, send: Send, context: _Context, deadline: float | None, why: str) -> None:
        """Send the request to the gateway with what is left of its deadline; on failure, the fallback chain."""
        stats = context.model.worker.stats
        if self.forwarder is None:
            message = f"{why}; and this agent has no gateway to overflow to"
            await self._fallback_chain(send, context, "no_gateway", message, 1.0)
            return
        remaining = None if deadline is None else deadline - time.monotonic()
        content_type = context.headers.get(b"content-type", b"application/json").decode("latin-1")
        forwarded_headers = {"content-type": content_type}
        length = context.headers.get(b"inference-header-content-length")
        if length is not None:
            forwarded_headers["inference-header-content-length"] = length.decode("latin-1")
        result = await self.forwarder.forward(context.path, context.body, forwarded_headers, remaining)
        if isinstance(result, Forwarded):
            body, header_length = result.body, _int_or_none(result.headers.get("inference-header-content-length"))
            try:
                body, header_length = with_parameters(body, header_length, {"spillway_outcome": "overflow"})
            except ValueError:
                log.warning("an overflow answer's JSON could not be read; passed on as it came")
            headers = [(b"spillway-outcome", b"overflow"), *context.extra]
            backend = result.headers.get("spillway-backend")
            if backend is not None:
                headers.append((b"spillway-backend", backend.encode("latin-1")))
            kind = b"application/json"
            if header_length is not None:
                headers.append((b"inference-header-content-length", str(header_length).encode()))
                kind = b"application/octet-stream"
            await _respond(send, 200, body, content_type=kind, extra=headers)
            stats.answered(context.level, "overflow", time.monotonic() - context.arrived)
            return
        await self._fallback_chain(send, context, result.reason, f"{why}; overflow failed: {result.message}",
                                   result.retry_after_s)  # fmt: skip

    async def _fallback_chain(self, send: Send, context: _Context, reason: str, message: str, retry_s: float) -> None:
        """When the cloud cannot answer: the cached answer to these inputs, the model's default outputs, the async
        queue (models that accept it), else 503 with the reason (the last step's own, when it had one: the async
        queue's disk refusing the job is `async_storage_full`)."""
        model, config = context.model, context.model.config
        stats = model.worker.stats
        if self.responses is not None:
            found = self.responses.get(inputs_key(config.name, model.version, context.inputs))
            if found is not None:
                await self._send_fallback(send, context, found, "fallback_cache", reason)
                return
        defaults = self.default_outputs.get(config.name)
        if defaults is not None:
            outputs = default_answer(defaults, context.rows, config.max_batch_size > 0)
            await self._send_fallback(send, context, outputs, "fallback_default", reason)
            return
        if self.jobs is not None and self.jobs.accepts(config.name):
            version = _version_in(context.path)
            length = _int_or_none(context.headers.get(b"inference-header-content-length"))
            try:
                job = await self.jobs.submit(config.name, version, context.body, length)
            except QueueFull:
                message += "; and the async queue is full"
            except StoreUnavailable as exc:  # logged by the queue once per streak, not here per request
                reason = exc.reason
                message += f"; and the async queue cannot store it now: {exc}"
            else:
                body = {"id": job.id, "status": job.status, "model_name": config.name, "outcome": "queued_async",
                        "parameters": {"spillway_outcome": "queued_async", "spillway_reason": reason},
                        "location": JOBS_PREFIX + job.id}  # fmt: skip
                headers = [(b"spillway-outcome", b"queued_async"), (b"spillway-reason", reason.encode()),
                           (b"spillway-job-id", job.id.encode()), (b"location", (JOBS_PREFIX + job.id).encode()),
                           *context.extra]  # fmt: skip
                await _respond(send, 202, json.dumps(body).encode(), extra=headers)
                stats.answered(context.level, "queued_async", time.monotonic() - context.arrived)
                return
        stats.outcome(context.level, "rejected")
        retry = str(max(1, round(retry_s))).encode()
        await _reject(send, 503, message, reason, extra=[(b"retry-after", retry), *context.extra])

    async def _send_fallback(
        self, send: Send, context: _Context, outputs: dict[str, np.ndarray], outcome: str, reason: str
    ) -> None:
        headers = [(b"spillway-outcome", outcome.encode()), (b"spillway-reason", reason.encode()), *context.extra]
        parameters = {"spillway_outcome": outcome, "spillway_reason": reason}
        if await self._answer(send, "fallback", context.request, context.model, outputs, headers,
                              parameters=parameters):  # fmt: skip
            context.model.worker.stats.answered(context.level, outcome, time.monotonic() - context.arrived)

    async def _fallback(
        self,
        send: Send,
        request: DecodedRequest,
        inputs: dict[str, np.ndarray],
        rows: int,
        model: LoadedModel,
        level: int,
        plan: ModelPlan,
        extra: list[tuple[bytes, bytes]],
    ) -> None:
        """Answer without running the model, saying so: the cached answer to these inputs, or the default outputs."""
        assert plan.fallback is not None
        stats = model.worker.stats
        config = model.config
        if plan.fallback.mode == "cache":
            key = inputs_key(config.name, model.version, inputs)
            found = self.responses.get(key) if self.responses is not None else None
            if found is None:
                stats.outcome(level, "rejected")
                retry = str(FALLBACK_MISS_RETRY_AFTER_S).encode()
                message = f"priority {level} is answered from the cache for now, and it holds no answer to these inputs"
                await _reject(send, 503, message, "fallback_miss", extra=[(b"retry-after", retry), *extra])
                return
            outputs = found
        else:
            assert plan.default_outputs is not None
            outputs = default_answer(plan.default_outputs, rows, config.max_batch_size > 0)
        outcome = f"fallback_{plan.fallback.mode}"
        headers = [(b"spillway-outcome", outcome.encode()), *extra]
        parameters = {"spillway_outcome": outcome, "spillway_fallback": plan.fallback.mode}
        if await self._answer(send, "fallback", request, model, outputs, headers, parameters=parameters):
            stats.outcome(level, outcome)

    async def _answer(
        self,
        send: Send,
        what: str,
        request: DecodedRequest,
        model: LoadedModel,
        outputs: dict[str, np.ndarray],
        extra: list[tuple[bytes, bytes]],
        *,
        parameters: dict[str, Any] | None = None,
        offload: bool = False,
    ) -> bool:
        """Encode and send a 200 with `outputs`; a failure to encode is a 500 (our bug), never a trace. True if sent."""
        config = model.config

        def encode() -> tuple[bytes, int | None]:
            return encode_response(
                model_name=config.name, model_version=str(model.version), request_id=request.id,
                outputs=outputs, specs=config.outputs, requested=request.outputs,
                binary_default=request.binary_output_default, parameters=parameters,
            )  # fmt: skip

        try:
            payload, json_length = await asyncio.to_thread(encode) if offload else encode()
        except Exception:  # a bug of ours (e.g. a runner output the config does not declare): never a trace
            log.exception("encoding the response of %s failed", what)
            await _respond(send, 500, _error_body("internal error; see the agent log", "error"),
                           extra=[(b"spillway-outcome", b"error")])  # fmt: skip
            return False
        if json_length is None:
            await _respond(send, 200, payload, extra=extra)
        else:
            extra = [*extra, (b"inference-header-content-length", str(json_length).encode())]
            await _respond(send, 200, payload, content_type=b"application/octet-stream", extra=extra)
        return True

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_requested_outputs(requested: list[RequestedOutput] | None, config: ModelConfig) -> None:
    """Refuse an unknown output before the request is queued, not after it has been computed."""
    known = {spec.name for spec in config.outputs}
    for output in requested or ():
        if output.name not in known:
            raise TensorError(f"requested output {output.name!r}: the model has no such output ({sorted(known)})")


async def _reject(
    send: Send, status: int, message: str, reason: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An answer that is not a result: the outcome `rejected` and its reason, in the body and the headers."""
    body = json.dumps({"error": message, "reason": reason, "outcome": "rejected"}).encode()
    headers = [(b"spillway-outcome", b"rejected"), (b"spillway-reason", reason.encode()), *(extra or [])]
    await _respond(send, status, body, extra=headers)


_LOCAL = {"spillway_outcome": "local"}


@dataclass(frozen=True)
class _Context:
    """A request on its way to an answer other than a local run: what overflow and the fallbacks need."""

    path: str
    body: bytes
    headers: dict[bytes, bytes]
    request: DecodedRequest
    inputs: dict[str, np.ndarray]
    rows: int
    model: LoadedModel
    level: int
    extra: list[tuple[bytes, bytes]]
    arrived: float


def _error_body(message: str, outcome: str) -> bytes:
    return json.dumps({"error": message, "outcome": outcome}).encode()


def _int_or_none(raw: bytes | str | None) -> int | None:
    if raw is None:
        return None
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    return int(text) if text.isdigit() else None


def _version_in(path: str) -> str | None:
    parts = path.strip("/").split("/")
    return parts[4] if len(parts) >= 6 and parts[3] == "versions" else None


def _model_path(parts: list[str]) -> tuple[str, str | None, list[str]]:
    """`m[/versions/v][/rest...]` -> (m, v, rest)."""
    name = parts[0]
    if len(parts) >= 3 and parts[1] == "versions":
        return name, parts[2], parts[3:]
    return name, None, parts[1:]


def _version_number(name: str, version: str) -> int:
    try:
        return int(version)
    except ValueError:
        raise UnknownModelError(f"unknown version '{version}' of model '{name}'") from None


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"inference-header-content-length")
    if raw is None:
        return None
    if not raw.isdigit():
        raise TensorError("Inference-Header-Content-Length must be a non-negative integer")
    return int(raw)


def _within_budget(timeout_s: float | None, budget: bytes | None) -> float | None:
    """The request's timeout, shortened to `Spillway-Timeout-Us`: what is left of the deadline of a request that an
    edge agent overflowed (the gateway passes it on), so that a cloud agent refuses at once what it cannot answer
    in time instead of answering after the edge gave up."""
    if budget is None:
        return timeout_s
    if not budget.isdigit():
        raise ValueError("header Spillway-Timeout-Us must be a whole number of microseconds")
    left = max(int(budget), 1) / 1e6
    return left if timeout_s is None else min(timeout_s, left)


def _scheduling_parameters(parameters: dict[str, Any]) -> tuple[int, float | None]:
    """Triton's request parameters: `priority` (0 = the model's default level) and `timeout` in microseconds."""
    priority = parameters.get("priority", 0)
    timeout = parameters.get("timeout")
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise ValueError(f"parameter 'priority' must be a non-negative integer, got {priority!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0):
        raise ValueError(f"parameter 'timeout' must be a non-negative integer of microseconds, got {timeout!r}")
    return priority, (timeout / 1e6 if timeout else None)


async def _respond_json(send: Send, status: int, body: dict[str, Any]) -> None:
    await _respond(send, status, json.dumps(body).encode())


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
