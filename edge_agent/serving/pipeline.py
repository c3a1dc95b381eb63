"""One V2 inference request, top to bottom:

    read and decode  ->  admission verdict  ->  the scheduler (serve here)  |  overflow -> fallback chain
                                                                             |  a policy fallback  |  refuse
                     ->  one answer, one outcome, counted once (`RequestOutcome`)

0. The tenant's quotas take the request in (a `Lease`, released once when it is answered, whichever way) or refuse
   it before its body is read: 429 `tenant_quota` with `Retry-After`.
1. `_decode`: the body (bounded), the tensors checked against the model, the scheduling parameters (the priority
   clamped to the tenant's ceiling) and the deadline budget; anything malformed is a 400 `invalid_request`.
2. `admission.on_arrival`: the policy's verdict, a frozen value; for `serve`, the scheduler admits or refuses at once
   (no await between the route, the verdict and the admission, so a variant switch never admits a request to a
   version on its way out), and `admission.on_refusal` turns its refusal into overflow or a refusal.
3. The verdict is carried out: a local run (`_serve`), the overflow chain (`_overflow`: the gateway, then the
   cached answer, the default outputs, the async queue, else 503), a policy fallback (`_fallback`), or a refusal.
4. Every path ends in `_send` / `_refuse` / `_fail` and records its outcome once on the request's `RequestOutcome`.

The errors a client can be told map to status and body here, in `_refuse` and `_fail`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edge_agent.overflow.fallback import ResponseCache, default_answer, inputs_key
from edge_agent.overflow.forward import Forwarded, Forwarder
from edge_agent.overflow.jobs import QueueFull, StoreUnavailable
from edge_agent.runtime.repository import UnknownModelError
from edge_agent.scheduling.stats import RequestOutcome
from edge_agent.scheduling.worker import ExecutionFailed, ModelWorker, Refused, Served
from edge_agent.serving import admission
from edge_agent.serving.admission import Verdict
from edge_agent.serving.models import LoadedModel, ModelRegistry
from edge_agent.tenants import QuotaExceeded, TenantRegistry
from spillway.contract import names
from spillway.contract.spec import ModelConfig
from spillway.contract.tenants import DEFAULT_TENANT
from spillway.contract.v2 import (
    BodyTooLarge,
    ClientGone,
    DecodedRequest,
    RequestedOutput,
    TensorError,
    decode_request,
    encode_response,
    parse_header_length,
    parse_timeout_budget_us,
    read_body,
    scheduling_parameters,
    validate_inputs,
    with_parameters,
)

if TYPE_CHECKING:
    from edge_agent.overflow.queue import AsyncQueue
    from edge_agent.policy.plan import ModelPlan

log = logging.getLogger("spillway.agent")
# The headers, as ASGI carries them (bytes, lower case).
_H_BACKEND = names.H_BACKEND.encode()
_H_HEADER_LENGTH = names.H_HEADER_LENGTH.encode()
_H_JOB_ID = names.H_JOB_ID.encode()
_H_OUTCOME = names.H_OUTCOME.encode()
_H_REASON = names.H_REASON.encode()
_H_RETRY_AFTER = names.H_RETRY_AFTER.encode()
_H_TIMEOUT_US = names.H_TIMEOUT_US.encode()
_H_VARIANT = names.H_VARIANT.encode()
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Headers = list[tuple[bytes, bytes]]

_INLINE_BYTES = 256 << 10  # bodies up to this size are decoded on the event loop (tens of microseconds)
_INLINE_ELEMENTS = 64 << 10  # outputs up to this many elements are encoded on the event loop
# A request refused because its fallback found no cached answer is told to come back after this long.
FALLBACK_MISS_RETRY_AFTER_S = 5
JOBS_PREFIX = "/spillway/v1/jobs/"
_LOCAL = {"spillway_outcome": names.LOCAL}


class PolicyGate(Protocol):
    """What admission asks the active policy (the agent's PolicyApplier)."""

    def plan_for(self, name: str) -> ModelPlan | None: ...


@dataclass(frozen=True)
class Request:
    """A decoded request on its way to its answer: what every stage after decoding needs."""

    path: str
    body: bytes
    headers: dict[bytes, bytes]
    decoded: DecodedRequest
    inputs: dict[str, np.ndarray]
    rows: int
    priority: int
    timeout_s: float | None
    model: LoadedModel  # the version that serves it (after a variant switch)
    extra: Headers  # headers every answer carries (the variant that served)
    outcome: RequestOutcome
    tenant: str = DEFAULT_TENANT

    @property
    def worker(self) -> ModelWorker:
        return self.model.worker

    def deadline(self) -> float | None:
        return self.worker.scheduler.deadline_for(self.outcome.level, self.outcome.arrived, self.timeout_s)


class InferencePipeline:
    """`POST /v2/models/{m}[/versions/{v}]/infer`, from the bytes received to the answer sent."""

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        max_body_bytes: int = 64 << 20,
        allow_non_finite: bool = True,
        policy: PolicyGate | None = None,
        responses: ResponseCache | None = None,
        forwarder: Forwarder | None = None,
        default_outputs: dict[str, dict[str, np.ndarray]] | None = None,
        jobs: AsyncQueue | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.registry = registry
        self.tenants = tenants if tenants is not None else TenantRegistry([], None)
        self.max_body_bytes = max_body_bytes
        self.allow_non_finite = allow_non_finite
        self.policy = policy
        self.responses = responses if responses is not None and responses.enabled else None
        self.forwarder = forwarder
        self.default_outputs = default_outputs or {}
        self.jobs = jobs
        self._draw = random.Random().random  # noqa: S311 (overflow fractions, not secrets)

    async def handle(self, path: str, requested: LoadedModel, name: str, version: str | None,
                     headers: dict[bytes, bytes], receive: Receive, send: Send,
                     tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        """Answer one inference request of `tenant` for `requested`, the version `name` and `version` name now (the
        route is taken again once the body has arrived: a variant may have switched meanwhile)."""
        try:  # before the body is read: a tenant over its quota costs the agent next to nothing
            lease = self.tenants.admit(tenant)
        except QuotaExceeded as exc:  # counted at level 0, as every refusal before the priority is known
            await self._refuse(send, RequestOutcome(requested.worker.stats, tenant=tenant), 429, exc.message,
                               "tenant_quota", retry_after_s=exc.retry_after_s,
                               details={"tenant": exc.tenant, "quota": exc.quota})  # fmt: skip
            return
        try:
            request = await self._decode(path, name, version, requested, headers, receive, send, tenant)
            if request is not None:
                await self._carry_out(send, request)
        finally:  # answered, whichever way (or the client went away meanwhile): the tenant's slot is free again
            lease.release()

    async def _carry_out(self, send: Send, request: Request) -> None:
        """The admission verdict for a decoded request, and the path it takes to its one answer."""
        plan = self._plan(request)
        draw = self._draw() if plan is not None and plan.overflow is not None and plan.overflow.fraction else 1.0
        verdict = admission.on_arrival(plan, request.outcome.level, draw)
        future = None
        if verdict.action == "serve":
            try:
                future = request.worker.admit(request.inputs, request.rows, request.priority, request.timeout_s,
                                              tenant=request.tenant)  # fmt: skip
            except ValueError as exc:  # a request the model cannot take (more rows than a batch)
                await self._refuse(send, request.outcome, 400, str(exc), "invalid_request", extra=request.extra)
                return
            except Refused as exc:  # at admission: the device cannot take it in time
                verdict = admission.on_refusal(verdict, exc.rejection)
        if future is not None:
            await self._serve(send, request, future)
        elif verdict.action == "overflow":
            await self._overflow(send, request, verdict.message)
        elif verdict.action == "fallback":
            await self._fallback(send, request, verdict)
        else:
            assert verdict.reason is not None
            await self._refuse(send, request.outcome, 503, verdict.message, verdict.reason,
                               retry_after_s=verdict.retry_after_s, extra=request.extra)  # fmt: skip

    # ---- 1. decode ------------------------------------------------------------------------------------------------

    async def _decode(self, path: str, name: str, version: str | None, requested: LoadedModel,
                      headers: dict[bytes, bytes], receive: Receive, send: Send,
                      tenant: str = DEFAULT_TENANT) -> Request | None:  # fmt: skip
        """The request, routed and decoded; None when it has been refused (and counted) already."""
        refused = RequestOutcome(requested.worker.stats, tenant=tenant)  # level 0: its priority is not known yet
        try:
            body = await read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
        except BodyTooLarge as exc:
            await self._refuse(send, refused, 413, str(exc), "payload_too_large")
            return None
        except ClientGone:
            return None  # nobody is left to answer
        config = requested.config
        try:
            header_length = parse_header_length(headers.get(_H_HEADER_LENGTH), len(body))
            if len(body) > _INLINE_BYTES:  # a big body is decoded off the event loop, so it delays nobody
                decoded = await asyncio.to_thread(decode_request, body, header_length)
            else:
                decoded = decode_request(body, header_length)
            rows = validate_inputs(decoded.inputs, config.inputs, config.max_batch_size,
                                   allow_non_finite=self.allow_non_finite)  # fmt: skip
            _check_requested_outputs(decoded.outputs, config)
            priority, timeout_us = scheduling_parameters(decoded.parameters)
            budget_us = parse_timeout_budget_us(headers.get(_H_TIMEOUT_US))
        except ValueError as exc:  # TensorError, or a shape validate_inputs refuses
            await self._refuse(send, refused, 400, str(exc), "invalid_request")
            return None
        timeout_s = None if timeout_us is None else timeout_us / 1e6
        if budget_us is not None:
            timeout_s = budget_us / 1e6 if timeout_s is None else min(timeout_s, budget_us / 1e6)
        try:
            model, redirected = self.registry.route(name, version)
        except UnknownModelError as exc:  # the version was unloaded while the body arrived
            await self._refuse(send, refused, 404, str(exc), "unknown_model")
            return None
        extra = [(_H_VARIANT, str(model.version).encode())] if redirected else []
        scheduler = model.worker.scheduler
        level = scheduler.resolve_level(priority)
        ceiling = min(self.tenants.ceiling(tenant, level), len(scheduler.config.levels))  # (1 is the highest level)
        if ceiling > level:  # above the tenant's ceiling: served at it (or at the model's lowest level), not refused
            level = priority = ceiling
        return Request(path, body, headers, decoded, {i.name: i.array for i in decoded.inputs}, rows, priority,
                       timeout_s, model, extra, RequestOutcome(model.worker.stats, level, tenant=tenant),
                       tenant)  # fmt: skip

    # ---- 2. the verdict's inputs ----------------------------------------------------------------------------------

    def _plan(self, request: Request) -> ModelPlan | None:
        return self.policy.plan_for(request.model.config.name) if self.policy is not None else None

    # ---- 3a. serve here -------------------------------------------------------------------------------------------

    async def _serve(self, send: Send, request: Request, future: asyncio.Future[Served]) -> None:
        outcome = request.outcome
        try:
            served = await ModelWorker.result(future, outcome, record_local=False)
        except Refused as exc:  # timed out in the queue (counted by `result`)
            await self._refuse(send, None, 503, str(exc), exc.rejection.reason,
                               retry_after_s=exc.rejection.retry_after_s, extra=request.extra)  # fmt: skip
            return
        except ExecutionFailed as exc:  # counted by `result`
            await respond(send, 500, _error_body(str(exc), names.ERROR),
                           extra=[(_H_OUTCOME, b"error"), *request.extra])  # fmt: skip
            return
        model, inputs = request.model, request.inputs
        if self.responses is not None and sum(a.nbytes for a in inputs.values()) <= self.responses.capacity_bytes:
            self.responses.put(inputs_key(model.config.name, model.version, inputs), served.outputs)
        big = sum(a.size for a in served.outputs.values()) > _INLINE_ELEMENTS

        def record() -> None:
            outcome.ran(names.LOCAL, served.queue_s, served.compute_s, served.total_s)

        await self._send(send, request, served.outputs, [(_H_OUTCOME, b"local"), *request.extra],
                         parameters=_LOCAL, offload=big, what=request.path, record=record)  # fmt: skip

    # ---- 3b. overflow, then the fallback chain --------------------------------------------------------------------

    async def _overflow(self, send: Send, request: Request, why: str) -> None:
        """Overflow and, when it fails, the fallback chain; an error of ours on the way is an `error` answer (500,
        JSON, counted), never a bare 500 from the server without an outcome."""
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._overflow_or_fall_back(tracking_send, request, why)
        except Exception:
            log.exception("overflow or the fallback chain of a request for %s failed", request.model.config.name)
            if started:  # the client has its status line already: nothing more can be said to it
                return
            await self._fail(send, request)

    async def _overflow_or_fall_back(self, send: Send, request: Request, why: str) -> None:
        """Send the request to the gateway with what is left of its deadline; on failure, the fallback chain."""
        if self.forwarder is None:
            await self._fallback_chain(send, request, "no_gateway", f"{why}; and this agent has no gateway to "
                                       "overflow to", 1.0)  # fmt: skip
            return
        deadline = request.deadline()
        remaining = None if deadline is None else deadline - time.monotonic()
        content_type = request.headers.get(b"content-type", b"application/json").decode("latin-1")
        forwarded_headers = {"content-type": content_type}
        raw_length = request.headers.get(_H_HEADER_LENGTH)
        body, length = request.body, None if raw_length is None else int(raw_length)
        if scheduling_parameters(request.decoded.parameters)[0] != request.priority:
            # Clamped to its tenant's ceiling here: the cloud serves it at that level too, not at the one it asked.
            body, length = with_parameters(body, length, {"priority": request.priority})
        if length is not None:
            forwarded_headers[names.H_HEADER_LENGTH] = str(length)
        result = await self.forwarder.forward(request.path, body, forwarded_headers, remaining,
                                              tenant=request.tenant)  # fmt: skip
        if not isinstance(result, Forwarded):
            await self._fallback_chain(send, request, result.reason, f"{why}; overflow failed: {result.message}",
                                       result.retry_after_s)  # fmt: skip
            return
        body, header_length = result.body, _int_or_none(result.headers.get(names.H_HEADER_LENGTH))
        try:
            body, header_length = with_parameters(body, header_length, {"spillway_outcome": names.OVERFLOW})
        except ValueError:
            log.warning("an overflow answer's JSON could not be read; passed on as it came")
        headers = [(_H_OUTCOME, b"overflow"), *request.extra]
        backend = result.headers.get(names.H_BACKEND)
        if backend is not None:
            headers.append((_H_BACKEND, backend.encode("latin-1")))
        kind = b"application/json"
        if header_length is not None:
            headers.append((_H_HEADER_LENGTH, str(header_length).encode()))
            kind = b"application/octet-stream"
        request.outcome.answered(names.OVERFLOW)
        await respond(send, 200, body, content_type=kind, extra=headers)

    async def _fallback_chain(self, send: Send, request: Request, reason: str, message: str, retry_s: float) -> None:
        """When the cloud cannot answer: the cached answer to these inputs, the model's default outputs, the async
        queue (models that accept it), else 503 with the reason (the last step's own, when it had one: the async
        queue's disk refusing the job is `async_storage_full`)."""
        config = request.model.config
        parameters = {"spillway_reason": reason}
        headers = [(_H_REASON, reason.encode())]
        found = self._cached(request)
        if found is not None:
            await self._send_fallback(send, request, found, names.FALLBACK_CACHE, parameters, headers)
            return
        defaults = self.default_outputs.get(config.name)
        if defaults is not None:
            outputs = default_answer(defaults, request.rows, config.max_batch_size > 0)
            await self._send_fallback(send, request, outputs, names.FALLBACK_DEFAULT, parameters, headers)
            return
        if self.jobs is not None and self.jobs.accepts(config.name):
            length = _int_or_none(request.headers.get(_H_HEADER_LENGTH))
            try:
                job = await self.jobs.submit(config.name, _version_in(request.path), request.body, length)
            except QueueFull:
                message += "; and the async queue is full"
            except StoreUnavailable as exc:  # logged by the queue once per streak, not here per request
                reason = exc.reason
                message += f"; and the async queue cannot store it now: {exc}"
            else:
                location = JOBS_PREFIX + job.id
                body = {"id": job.id, "status": job.status, "model_name": config.name, "outcome": names.QUEUED_ASYNC,
                        "parameters": {"spillway_outcome": names.QUEUED_ASYNC, "spillway_reason": reason},
                        "location": location}  # fmt: skip
                extra = [(_H_OUTCOME, b"queued_async"), (_H_REASON, reason.encode()),
                         (_H_JOB_ID, job.id.encode()), (b"location", location.encode()),
                         *request.extra]  # fmt: skip
                request.outcome.answered(names.QUEUED_ASYNC)
                await respond(send, 202, json.dumps(body).encode(), extra=extra)
                return
        await self._refuse(send, request.outcome, 503, message, reason, retry_after_s=retry_s, extra=request.extra)

    # ---- 3c. a policy fallback ------------------------------------------------------------------------------------

    async def _fallback(self, send: Send, request: Request, verdict: Verdict) -> None:
        """Answer without running the model, saying so: the cached answer to these inputs, or the default outputs."""
        config = request.model.config
        if verdict.fallback == "cache":
            outputs = self._cached(request)
            if outputs is None:
                message = (f"priority {request.outcome.level} is answered from the cache for now, and it holds no "
                           "answer to these inputs")  # fmt: skip
                await self._refuse(send, request.outcome, 503, message, "fallback_miss",
                                   retry_after_s=FALLBACK_MISS_RETRY_AFTER_S, extra=request.extra)  # fmt: skip
                return
        else:
            plan = self._plan(request)
            assert plan is not None and plan.default_outputs is not None
            outputs = default_answer(plan.default_outputs, request.rows, config.max_batch_size > 0)
        outcome = names.FALLBACK_CACHE if verdict.fallback == "cache" else names.FALLBACK_DEFAULT
        await self._send_fallback(send, request, outputs, outcome, {"spillway_fallback": verdict.fallback}, [])

    def _cached(self, request: Request) -> dict[str, np.ndarray] | None:
        if self.responses is None:
            return None
        model = request.model
        return self.responses.get(inputs_key(model.config.name, model.version, request.inputs))

    async def _send_fallback(self, send: Send, request: Request, outputs: dict[str, np.ndarray], outcome: str,
                             parameters: dict[str, Any], headers: Headers) -> None:  # fmt: skip
        extra = [(_H_OUTCOME, outcome.encode()), *headers, *request.extra]
        await self._send(send, request, outputs, extra, parameters={"spillway_outcome": outcome, **parameters},
                         what="fallback", record=lambda: request.outcome.answered(outcome))  # fmt: skip

    # ---- 4. the answer --------------------------------------------------------------------------------------------

    async def _send(self, send: Send, request: Request, outputs: dict[str, np.ndarray], extra: Headers, *,
                    parameters: dict[str, Any], what: str, record: Callable[[], None],
                    offload: bool = False) -> None:  # fmt: skip
        """Encode `outputs`, `record` the outcome, send the 200. A failure to encode is our bug: an `error` answer
        (500, counted instead), never a trace."""
        model, decoded = request.model, request.decoded
        config = model.config

        def encode() -> tuple[bytes, int | None]:
            return encode_response(
                model_name=config.name, model_version=str(model.version), request_id=decoded.id,
                outputs=outputs, specs=config.outputs, requested=decoded.outputs,
                binary_default=decoded.binary_output_default, parameters=parameters,
            )  # fmt: skip

        try:
            payload, json_length = await asyncio.to_thread(encode) if offload else encode()
        except Exception:  # a bug of ours (e.g. a runner output the config does not declare): never a trace
            log.exception("encoding the response of %s failed", what)
            await self._fail(send, request)
            return
        record()
        if json_length is None:
            await respond(send, 200, payload, extra=extra)
        else:
            extra = [*extra, (_H_HEADER_LENGTH, str(json_length).encode())]
            await respond(send, 200, payload, content_type=b"application/octet-stream", extra=extra)

    async def _fail(self, send: Send, request: Request) -> None:
        """An error of ours: 500 with the outcome `error`, counted."""
        request.outcome.refused(names.ERROR)
        await respond(send, 500, _error_body("internal error; see the agent log", names.ERROR),
                       extra=[(_H_OUTCOME, b"error"), *request.extra])  # fmt: skip

    @staticmethod
    async def _refuse(send: Send, outcome: RequestOutcome | None, status: int, message: str, reason: str, *,
                      retry_after_s: float | None = None, extra: Headers | None = None,
                      details: dict[str, Any] | None = None) -> None:  # fmt: skip
        """An answer that is not a result: the outcome `rejected` and its reason, in the body and the headers
        (Retry-After on a 503 or 429); counted in `outcome` unless the caller counts it (None)."""
        headers = list(extra or ())
        if retry_after_s is not None:
            headers.insert(0, (_H_RETRY_AFTER, str(max(1, round(retry_after_s))).encode()))
        if outcome is not None:
            outcome.refused()
        await reject(send, status, message, reason, extra=headers, details=details)


def _check_requested_outputs(requested: list[RequestedOutput] | None, config: ModelConfig) -> None:
    """Refuse an unknown output before the request is queued, not after it has been computed."""
    known = {spec.name for spec in config.outputs}
    for output in requested or ():
        if output.name not in known:
            raise TensorError(f"requested output {output.name!r}: the model has no such output ({sorted(known)})")


async def reject(send: Send, status: int, message: str, reason: str, extra: Headers | None = None,
                 details: dict[str, Any] | None = None) -> None:  # fmt: skip
    """The answer that is not a result: the outcome `rejected` and its reason, in the body and the headers (`details`:
    more fields of the body, such as the tenant and the quota of a `tenant_quota` refusal)."""
    body = json.dumps({"error": message, "reason": reason, "outcome": names.REJECTED, **(details or {})}).encode()
    headers = [(_H_OUTCOME, b"rejected"), (_H_REASON, reason.encode()), *(extra or [])]
    await respond(send, status, body, extra=headers)


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


async def respond(send: Send, status: int, body: bytes, *, content_type: bytes = b"application/json",
                   extra: Headers | None = None) -> None:  # fmt: skip
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
