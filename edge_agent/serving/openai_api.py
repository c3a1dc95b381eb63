"""The OpenAI-compatible API of the agent's generative models: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, non-streaming and `stream: true` (server-sent events `data: {chunk}` ending with
`data: [DONE]`, `stream_options.include_usage` for a last chunk with the usage), as the `openai` package expects.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a request that is wrong (the
field named in `param`), 404 for a model that is not served, 413 for a body over the limit, 429 when the queue is
full and 503 when the device cannot give the first token in time, sheds the priority or drains, with Retry-After and
the reason in `spillway-reason`. Spillway's outcome is in the `spillway-outcome` header and in the answer's `spillway`
field. A client that disconnects mid-stream cancels its sequence: its KV blocks are free at the next step.

Admission, before any token (the policy's `plan_for` and the first-token prediction; `admission.py`'s verdicts, as
for V2): serve here; overflow (the policy says so for the level or fraction, or, with overflow on, the predicted
first token misses the request's deadline or the scheduler refuses it for time or room): the same body goes to the
gateway and its answer is relayed as it comes (`overflow/stream.py`), with `spillway-outcome: overflow`,
`spillway-backend` and one chunk `{"choices": [], "spillway": {"outcome": "overflow", "backend"}}` before
`data: [DONE]`; a break mid-stream ends it with an error event, never `[DONE]`. When the gateway fails before its
first byte, the fallback chain: the cached completion of this very greedy request, the default text, the async
queue (202 and a job whose answer is the completion), else 503. The policy's fallback answers from the cache or the
default text; its shed is a 503. Its `max_tokens_cap` lowers a request's max_tokens (header
`spillway-max-tokens-cap`: the answer may end with `finish_reason: length` there). Every answer is counted once, with
its outcome, in the model's telemetry.

Tenants (the app resolves each request's bearer token to one, `TenantRegistry`): a level above the tenant's priority
ceiling is served at the ceiling; once valid, before any token or overflow, the request takes its tenant's quotas
(in flight, requests/s, streams, and tokens/s: its prompt's tokens then, the generated ones as they come) and holds
them until its answer is over, however it ends; over one: 429 in OpenAI's shape (`code: rate_limit_exceeded`),
Retry-After and `spillway-reason: tenant_quota`, counted once as rejected. The engine shares each level fairly among
the tenants (`GenerationRequest.tenant`), telemetry names the tenant (`spillway.tenant`, bounded), and an overflowed
request carries it to the gateway (`spillway-tenant`), which may cap a tenant's share of a backend.

Fields the agent does not implement (tools, JSON mode, logprobs, penalties, logit_bias, n or best_of above 1, echo,
suffix, vLLM's guided decoding...) are refused with a value that would use them: 400, `code: unsupported_parameter`,
the field in `param`, as OpenAI refuses a parameter a model lacks. vLLM's extra `ignore_eos` is honoured (benchmarks
need exact output lengths; the `openai` package sends it through `extra_body`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from edge_agent.generation.engine import Chunk, FinishReason, GenerationRequest, Stream
from edge_agent.generation.pool import EnginePool
from edge_agent.generation.sampling import SamplingParams
from edge_agent.overflow.fallback import Completion, CompletionCache, completion_key
from edge_agent.overflow.forward import NotForwarded
from edge_agent.overflow.jobs import Job, QueueFull, StoreUnavailable
from edge_agent.overflow.queue import Unservable
from edge_agent.overflow.stream import ForwardedStream, StreamBroken, relay
from edge_agent.overflow.stream import event as sse
from edge_agent.scheduling.worker import ExecutionFailed, Refused
from edge_agent.serving import admission
from edge_agent.serving.admission import Verdict
from edge_agent.serving.pipeline import FALLBACK_MISS_RETRY_AFTER_S, JOBS_PREFIX, PolicyGate
from edge_agent.serving.pipeline import respond as _respond
from edge_agent.tenants import Lease, QuotaExceeded
from spillway.contract import names
from spillway.contract.tenants import DEFAULT_TENANT
from spillway.contract.v2 import BodyTooLarge, ClientGone, parse_timeout_budget_us, read_body

if TYPE_CHECKING:
    from edge_agent.overflow.forward import Forwarder
    from edge_agent.overflow.queue import AsyncQueue
    from edge_agent.policy.plan import ModelPlan
    from edge_agent.tenants import TenantRegistry

__all__ = ["OpenAIApi"]

log = logging.getLogger("spillway.agent")
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Headers = list[tuple[bytes, bytes]]
_OUTCOME = names.H_OUTCOME.encode()
_REASON = names.H_REASON.encode()
_BACKEND = names.H_BACKEND.encode()
_JOB_ID = names.H_JOB_ID.encode()
_CAP = names.H_MAX_TOKENS_CAP.encode()
_TIMEOUT_US = names.H_TIMEOUT_US.encode()
_QUOTA = "tenant_quota"
_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
MAX_STOPS = 4

# Fields the agent does not implement, each with the values that leave it unused (what clients send by default);
# any other value is refused, never ignored: an answer without the tool call, JSON or logprobs asked for would
# mislead the client. vLLM implements most of them; OpenAI refuses one a model lacks in the same shape.
_UNUSED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_tokens": (None, 0), "min_p": (None, 0), "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1), "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False), "logits_processors": (None, []), "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}  # fmt: skip
_UNUSED_COMPLETION: dict[str, tuple[Any, ...]] = {**_UNUSED, "suffix": (None, ""), "logprobs": (None,)}
_UNUSED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNUSED, "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
    "web_search_options": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True),
}  # fmt: skip
_WHY = {"logprobs": "log probabilities are not computed", "top_logprobs": "log probabilities are not computed",
        "prompt_logprobs": "log probabilities are not computed", "tools": "tool calling is not supported",
        "functions": "tool calling is not supported", "tool_choice": "tool calling is not supported",
        "function_call": "tool calling is not supported",
        "response_format": "structured output (JSON mode) is not supported"}  # fmt: skip
# Read here, or accepted with no effect on the output (tags, caching hints, tool options without tools).
_KNOWN = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stream", "stream_options", "priority", "timeout", "ignore_eos", "user", "metadata", "store",
    "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
})  # fmt: skip
_WARNED_AT_MOST = 256  # distinct unknown field names logged, so a client cannot fill the log with made-up ones


class ApiError(Exception):
    """An answer that is not a completion: its status, OpenAI's error fields, and for a refusal of the device its
    Retry-After and `spillway-reason`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: float | None = None, reason: str | None = None,
                 extra: Headers | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.extra = extra or []

    def headers(self) -> Headers:
        found: Headers = []
        if self.retry_after_s:
            found.append((names.H_RETRY_AFTER.encode(), str(max(1, round(self.retry_after_s))).encode()))
        if self.reason is not None:
            found.append((_REASON, self.reason.encode()))
        return found + self.extra

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        ).encode()


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number from {low} to {high}, got {value!r}", name)
    return float(value)


def _refuse_unused(body: dict[str, Any], chat: bool) -> list[str]:
    """Refuse a field the agent does not implement given a value that uses it; return the unknown field names."""
    unused = _UNUSED_CHAT if chat else _UNUSED_COMPLETION
    for name, value in body.items():
        if name in unused and value not in unused[name]:  # by ==: 0.0, 0 and False all leave a penalty unused
            why = _WHY.get(name, "this server does not implement it")
            raise ApiError(400, f"Unsupported parameter: '{name}' ({why}); got {json.dumps(value)[:60]}", name,
                           "unsupported_parameter")  # fmt: skip
    return sorted(name for name in body if name not in unused and name not in _KNOWN)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a whole number from {low} to {high}, got {value!r}", name)
    return value


@dataclass(eq=False)
class _Ask:
    """One generative request after decoding, on its way to its one answer."""

    chat: bool
    body: dict[str, Any]
    raw: bytes  # as the client sent it: what an overflow forwards
    engine: EnginePool
    request: GenerationRequest
    level: int
    arrived: float  # time.monotonic()
    stream: bool
    usage: bool  # stream_options.include_usage
    capped: int | None  # the policy's max_tokens cap, where it lowered this request's max_tokens
    plan: ModelPlan | None
    key: bytes | None = None  # in the completion cache: greedy requests only
    ident: str = ""
    priority_header: bytes | None = None  # `spillway-priority`, as the client sent it
    tenant: str = DEFAULT_TENANT  # whose request it is (the app resolved its bearer token)
    label: str = DEFAULT_TENANT  # the tenant's name in telemetry (bounded: `other` for one the agent no longer knows)
    lease: Lease | None = None  # the tenant's quotas it holds from admission to its answer (None: no quotas)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def headers(self) -> Headers:
        """What every answer to it carries beyond its outcome: the cap, when it applied."""
        return [] if self.capped is None else [(_CAP, str(self.capped).encode())]

    def count(self, outcome: str) -> None:
        _tell(self.engine, self.level, outcome, self.label)

    def refused(self) -> None:
        """Count it refused before any token (rejected), once."""
        self.engine.refused(self.level, self.label)

    def generated(self, chunks: AsyncIterable[Chunk]) -> AsyncIterator[Chunk]:
        """`chunks` as they come, each one's new tokens debited from the tenant's tokens/s as it passes."""
        return _debited(chunks, self.lease)

    def add_tokens(self, tokens: int) -> None:
        """Debit tokens generated for it (elsewhere: the cloud's, counted when the overflowed answer ends)."""
        if self.lease is not None and tokens > 0:
            self.lease.add_tokens(tokens)

    def release(self) -> None:
        """Its answer is over (sent, cut short, failed): the tenant's in-flight and stream slots back (idempotent)."""
        if self.lease is not None:
            self.lease.release()


class OpenAIApi:
    def __init__(self, engines: dict[str, EnginePool], *, max_body_bytes: int, default_max_tokens: int,
                 policy: PolicyGate | None = None, forwarder: Forwarder | None = None, cache_bytes: int = 0,
                 cache_ttl_s: float | None = None, jobs: AsyncQueue | None = None,
                 tenants: TenantRegistry | None = None) -> None:  # fmt: skip
        """Args:
        engines: the generative models by name (the same dict a policy changes in place on a variant switch).
        max_body_bytes: the bound on a request's body.
        default_max_tokens: a chat request's max_tokens where it sets none and its model says nothing.
        policy: the active policy (`plan_for`): overflow, shed, fallback and the max_tokens cap. None: serve all.
        forwarder: the gateway; None: nothing is overflowed (the fallback chain answers what would be).
        cache_bytes: the bound on the greedy completions kept for the cache fallback (0: none are kept).
        cache_ttl_s: how long after it was stored a completion may answer (None: until it is evicted).
        jobs: the async queue, the last fallback for the models it accepts (their jobs run here, `_GenerativeJobs`).
        tenants: the tenants' priority ceilings, quotas and telemetry names (None: no ceilings or quotas; each
            request still carries its tenant to the engine's fair share).
        """
        self.engines = engines
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.policy = policy
        self.forwarder = forwarder
        self.completions = CompletionCache(cache_bytes, cache_ttl_s) if cache_bytes > 0 else None
        self.jobs = jobs
        self.tenants = tenants
        self.created = int(time.time())
        self.warned: set[str] = set()  # unknown field names already logged
        self._draw = random.Random().random  # noqa: S311 (overflow fractions, not secrets)
        if jobs is not None:
            for name in engines:
                if jobs.accepts(name):
                    jobs.runners[name] = _GenerativeJobs(self, name, jobs.drain_below)

    async def handle(self, method: str, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send, *,
                     tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        """Answer one request of `tenant` (the app resolved it from the request's bearer token)."""
        try:
            if path == "/v1/models" and method in ("GET", "HEAD"):
                data = [{"id": name, "object": "model", "created": self.created, "owned_by": "spillway"}
                        for name in sorted(self.engines)]  # fmt: skip
                await _respond(send, 200, json.dumps({"object": "list", "data": data}).encode())
            elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                await self._generate(path.endswith("chat/completions"), headers, receive, send, tenant)
            elif path.startswith("/v1/models/") and method in ("GET", "HEAD"):
                name = path[len("/v1/models/") :]
                self._engine(name)
                model = {"id": name, "object": "model", "created": self.created, "owned_by": "spillway"}
                await _respond(send, 200, json.dumps(model).encode())
            else:
                raise ApiError(404, f"no such endpoint: {method} {path}", code="not_found")
        except ApiError as exc:
            await _respond(send, exc.status, exc.body(), extra=[(_OUTCOME, b"rejected"), *exc.headers()])
        except ClientGone:
            return

    async def triton_generate(self, name: str, version: str | None, stream: bool, headers: dict[bytes, bytes],
                              receive: Receive, send: Send, *, tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        """Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate[_stream]` with `text_input` and
        `parameters` (the same fields as a completion: max_tokens, temperature, top_p, top_k, seed, stop, priority,
        timeout); answers `{model_name, model_version, text_output}`, streamed as SSE events of new text. Errors are
        V2's, `{"error": "..."}`. The policy's cap, shed and fallbacks apply as on the OpenAI routes; a request the
        policy overflows is served here when the device takes it (the gateway speaks OpenAI's protocol, not this
        one), else answered by the fallback chain."""
        held: list[_Ask] = []
        try:
            await self._triton_generate(name, version, stream, headers, receive, send, tenant, held)
        finally:
            for ask in held:  # the tenant's quotas it held: back however it ended
                ask.release()

    async def _triton_generate(self, name: str, version: str | None, stream: bool, headers: dict[bytes, bytes],
                               receive: Receive, send: Send, tenant: str, held: list[_Ask]) -> None:  # fmt: skip
        """`triton_generate`'s work; the request, once within its tenant's quotas, in `held` (its lease)."""
        cap_headers: Headers = []
        try:
            self._engine(name)  # an unknown model is refused before its body is read
            raw = await read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
            # Looked up after the body is read, with no await until it is admitted: a variant switch meanwhile has
            # swapped the pool, and the old one drains (it would refuse the request).
            engine = self._engine(name)
            if version and version != engine.version:
                raise ApiError(404, f"model {name!r} serves version {engine.version}, not {version}", "model",
                               "model_not_found")  # fmt: skip
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            parameters = body.get("parameters", {})
            if not isinstance(parameters, dict):
                raise ApiError(400, "'parameters' must be an object", "parameters")
            text = body.get("text_input")
            if not isinstance(text, str) or not text:
                raise ApiError(400, "'text_input' must be a non-empty string", "text_input")
            fields = {**parameters, "model": name, "prompt": text}
            plan = self.policy.plan_for(name) if self.policy is not None else None
            try:
                self._check_fields(fields, False)
                ask = self._ask(engine, plan, fields, raw, False, headers, tenant)
            except ApiError:
                engine.refused(0, self._label(tenant))
                raise
            cap_headers = ask.headers()
            self._admit(ask)
            held.append(ask)
            verdict = self._verdict(ask)
            generated = None
            if verdict.action in ("serve", "overflow"):
                try:
                    generated = engine.submit(ask.request, count_refusal=False)
                except Refused as exc:
                    if verdict.action == "serve" and not verdict.overflow_if_refused:
                        ask.refused()
                        raise ApiError(503, str(exc), code=exc.rejection.reason, reason=exc.rejection.reason,
                                       retry_after_s=exc.rejection.retry_after_s) from None  # fmt: skip
                    verdict = Verdict("overflow", message=exc.rejection.message)
                except ValueError as exc:  # the prompt and max_tokens beyond the context, or the KV budget (counted)
                    raise ApiError(400, str(exc), "max_tokens") from None
            if generated is None:
                found = await self._without_model(ask, verdict)
                if isinstance(found, ApiError):
                    raise found
                completion, outcome, reason = found
                ask.count(outcome)  # a fallback's answer: counted once, as `_answer` counts it on the OpenAI routes
                answer: dict[str, Any] = {"model_name": name, "model_version": engine.version,
                                          "text_output": completion.text, "finish_reason": completion.finish_reason,
                                          "usage": _usage_of(completion)}  # fmt: skip
                extra = [(_OUTCOME, outcome.encode()), *([(_REASON, reason.encode())] if reason else []), *cap_headers]
                if stream:
                    await _sse_once(send, {**answer, "spillway": {"outcome": outcome}}, extra)
                else:
                    await _respond(send, 200, json.dumps(answer).encode(), extra=extra)
                return
        except BodyTooLarge as exc:
            await _respond(send, 413, json.dumps({"error": str(exc)}).encode(), extra=[(_OUTCOME, b"rejected")])
            return
        except (ValueError, UnicodeDecodeError) as exc:  # not JSON
            await _respond(send, 400, json.dumps({"error": f"the body is not valid JSON: {exc}"}).encode(),
                           extra=[(_OUTCOME, b"rejected")])  # fmt: skip
            return
        except ApiError as exc:
            message = exc.message if exc.param is None else f"{exc.message} (field {exc.param})"
            await _respond(send, exc.status, json.dumps({"error": message}).encode(),
                           extra=[(_OUTCOME, b"rejected"), *exc.headers(), *cap_headers])  # fmt: skip
            return
        except ClientGone:
            return
        head = {"model_name": name, "model_version": engine.version}
        watcher = asyncio.ensure_future(_watch_disconnect(receive, generated))
        try:
            if not stream:
                chunks = [chunk async for chunk in ask.generated(generated)]
                output = "".join(c.text for c in chunks)
                answer = {**head, "text_output": output, "finish_reason": chunks[-1].finish_reason,
                          "usage": _usage(chunks[-1])}  # fmt: skip
                self._remember(ask, output, chunks[-1])
                status = {"error": 500, "cancelled": 503}.get(chunks[-1].finish_reason or "", 200)
                await _respond(send, status, json.dumps(answer).encode(),
                               extra=[(_OUTCOME, _outcome(chunks[-1]).encode()), *cap_headers])  # fmt: skip
                return
            start = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                     (_OUTCOME, b"local"), *cap_headers]  # fmt: skip
            await send({"type": "http.response.start", "status": 200, "headers": start})
            said: list[str] = []
            async for chunk in ask.generated(generated):
                said.append(chunk.text)
                if not chunk.text and chunk.finish_reason is None:
                    continue
                event: dict[str, Any] = {**head, "text_output": chunk.text}
                if chunk.finish_reason is not None:
                    event["finish_reason"] = chunk.finish_reason
                    self._remember(ask, "".join(said), chunk)
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            generated.cancel()

    def json(self) -> dict[str, Any]:
        """For the agent's status: the completion cache of the fallbacks (None: none is kept)."""
        return {"fallback_cache": None if self.completions is None else self.completions.json()}

    def _engine(self, name: Any) -> EnginePool:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' must name a served model", "model")
        engine = self.engines.get(name)
        if engine is None:
            raise ApiError(404, f"the model '{name[:100]}' does not exist (served: {sorted(self.engines)})", "model",
                           "model_not_found")  # fmt: skip
        return engine

    # ---- admission -------------------------------------------------------------------------------------------------

    async def _generate(self, chat: bool, headers: dict[bytes, bytes], receive: Receive, send: Send,
                        tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        try:
            raw = await read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
        except BodyTooLarge as exc:
            raise ApiError(413, str(exc), code="payload_too_large") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        engine = self._engine(body.get("model"))
        plan = self.policy.plan_for(engine.name) if self.policy is not None else None
        try:
            self._check_fields(body, chat)
            if body.get("stream") is not None and not isinstance(body["stream"], bool):
                raise ApiError(400, f"'stream' must be true or false, got {str(body['stream'])[:60]!r}", "stream")
            ask = self._ask(engine, plan, body, raw, chat, headers, tenant)
        except ApiError:
            engine.refused(0, self._label(tenant))  # counted: rejected, before its priority is known
            raise
        self._admit(ask)
        try:
            await self._admitted(ask, receive, send)
        finally:
            ask.release()  # however it was answered, or ended (its client gone, an error)

    async def _admitted(self, ask: _Ask, receive: Receive, send: Send) -> None:
        """A request within its tenant's quotas: served here, overflowed, or answered by a fallback."""
        engine = ask.engine
        verdict = self._verdict(ask)
        if verdict.action == "serve":
            try:
                stream = engine.submit(ask.request, count_refusal=False)
            except Refused as exc:
                verdict = admission.on_refusal(verdict, exc.rejection)
                if verdict.action == "refuse":
                    ask.refused()
                    refusal = exc.rejection.reason
                    status = 429 if refusal == "queue_full" else 503
                    raise ApiError(status, str(exc), code=refusal, kind="server_error" if status == 503 else
                                   "rate_limit", retry_after_s=exc.rejection.retry_after_s, reason=refusal,
                                   extra=ask.headers()) from None  # fmt: skip
            except ValueError as exc:  # the prompt and max_tokens beyond the context, or the KV budget (counted)
                raise ApiError(400, str(exc), "max_tokens", extra=ask.headers()) from None
            else:
                await self._serve(ask, stream, receive, send)
                return
        if verdict.action == "overflow":
            await self._overflow(ask, verdict.message, receive, send)
            return
        found = await self._without_model(ask, verdict)
        if isinstance(found, ApiError):
            raise found
        completion, outcome, reason = found
        await self._answer(send, ask, completion, outcome, reason)

    def _ask(self, engine: EnginePool, plan: ModelPlan | None, body: dict[str, Any], raw: bytes, chat: bool,
             headers: dict[bytes, bytes], tenant: str = DEFAULT_TENANT) -> _Ask:  # fmt: skip
        prompt = self._prompt(engine, body, chat)
        cap = None if plan is None else plan.max_tokens_cap
        request, capped = self._request(engine, body, prompt, chat, headers, cap)
        scheduler = engine.instances[0].scheduler
        level = scheduler.resolve_level(request.priority)
        priority_header = headers.get(b"spillway-priority")
        priority = request.priority
        if self.tenants is not None:
            # The tenant's priority ceiling: a level above it is served at it (clamped, not refused), here and in
            # the cloud (the header overrides the body's priority there); a ceiling below the model's lowest level
            # is served at that level.
            clamped = min(self.tenants.ceiling(tenant, level), scheduler.config.levels)
            if clamped > level:
                level = priority = clamped
                priority_header = str(level).encode()
                if "priority" in body:  # overflowed, the body goes as it came: it must not ask above the ceiling
                    raw = json.dumps({**body, "priority": level}).encode()
        request = replace(request, priority=priority, tenant=tenant)  # the engine keeps the tenant's fair share
        options = body.get("stream_options")
        ask = _Ask(chat, body, raw, engine, request, level, time.monotonic(), body.get("stream") is True,
                   isinstance(options, dict) and options.get("include_usage") is True, capped, plan)  # fmt: skip
        ask.ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ask.priority_header = priority_header
        ask.tenant = tenant
        ask.label = self._label(tenant)
        sampling = request.sampling
        if self.completions is not None and (sampling.temperature == 0 or sampling.top_k == 1):
            ask.key = completion_key(engine.name, engine.version, request.operation, request.prompt,
                                     request.max_tokens, request.stop, request.ignore_eos)  # fmt: skip
        return ask

    def _label(self, tenant: str) -> str:
        return tenant if self.tenants is None else self.tenants.label(tenant)

    def _admit(self, ask: _Ask) -> None:
        """Take the tenant's quotas for `ask` (its prompt's tokens from tokens/s), before any token or overflow;
        over one: 429 with Retry-After and `spillway-reason: tenant_quota`, counted once (rejected). OpenAI's shape
        of a rate limit: `code: rate_limit_exceeded`, `type` the tokens or the requests."""
        if self.tenants is None:
            return
        try:
            ask.lease = self.tenants.admit(ask.tenant, generative=True, tokens=len(ask.request.prompt))
        except QuotaExceeded as exc:
            ask.refused()
            raise ApiError(429, exc.message, code="rate_limit_exceeded",
                           kind="tokens" if exc.quota == "tokens_per_s" else "requests",
                           retry_after_s=exc.retry_after_s, reason=_QUOTA, extra=ask.headers()) from None  # fmt: skip

    def _verdict(self, ask: _Ask) -> Verdict:
        """The policy's verdict; a `serve` with overflow on overflows at once when the device's predicted first token
        misses the request's deadline (the scheduler refuses only where its level says REJECT)."""
        plan = ask.plan
        draw = self._draw() if plan is not None and plan.overflow is not None and plan.overflow.fraction else 1.0
        verdict = admission.on_arrival(plan, ask.level, draw)
        if verdict.action != "serve" or not verdict.overflow_if_refused:
            return verdict
        deadline = self._deadline(ask)
        if deadline is None:
            return verdict
        instances = ask.engine.instances
        predicted = min(engine.predict_first_token_s(ask.request) for engine in instances)
        if ask.arrived + predicted > deadline:
            return Verdict("overflow", message=f"the predicted first token in {predicted * 1e3:.1f} ms misses the "
                           f"{(deadline - ask.arrived) * 1e3:.1f} ms deadline")  # fmt: skip
        return verdict

    def _deadline(self, ask: _Ask) -> float | None:
        scheduler = ask.engine.instances[0].scheduler
        return scheduler.deadline_for(ask.level, ask.arrived, ask.request.timeout_s)

    # ---- served here -----------------------------------------------------------------------------------------------

    async def _serve(self, ask: _Ask, stream: Stream, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stream))
        try:
            if ask.stream:
                await self._stream(send, ask, ask.generated(stream), None, {})
            else:
                await self._whole(send, ask, ask.generated(stream), None, {})
        finally:
            watcher.cancel()
            stream.cancel()  # a handler that ends early (its send failed) frees the sequence; no-op once it ended

    def _remember(self, ask: _Ask, text: str, last: Chunk) -> None:
        """Keep a greedy completion that ended well for the cache fallback."""
        if ask.key is None or self.completions is None or last.finish_reason not in ("stop", "length"):
            return
        self.completions.put(ask.key, Completion(text, last.finish_reason, last.prompt_tokens, last.completion_tokens))

    # ---- overflow --------------------------------------------------------------------------------------------------

    async def _overflow(self, ask: _Ask, why: str, receive: Receive, send: Send) -> None:
        """Through the gateway, relayed as it comes; when that fails before the first byte, the fallback chain. An
        error of ours on the way is an `error` answer (500, counted), never a bare 500 without an outcome."""
        started = False

        async def tracking(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._overflow_or_fall_back(ask, why, receive, tracking)
        except ApiError:
            raise
        except ClientGone:
            return
        except Exception:
            log.exception("the overflow or fallback chain of a request for %s failed", ask.engine.name)
            if started:
                return
            ask.count(names.ERROR)
            error = ApiError(500, "internal error; see the agent log", code="internal_error", kind="server_error")
            await _respond(send, 500, error.body(), extra=[(_OUTCOME, b"error"), *ask.headers()])

    async def _overflow_or_fall_back(self, ask: _Ask, why: str, receive: Receive, send: Send) -> None:
        if self.forwarder is None:
            await self._fall_back(ask, "no_gateway", f"{why}; and this agent has no gateway to overflow to", 1.0,
                                  send)  # fmt: skip
            return
        deadline = self._deadline(ask)
        # The deadline is the first token's: for a whole answer the first byte is the whole completion, so it goes
        # with the forwarder's default timeout (a healthy cloud would otherwise time out on every long answer).
        remaining = None if deadline is None or not ask.stream else deadline - time.monotonic()
        forwarded = {"content-type": "application/json"}
        if ask.priority_header is not None:  # the body goes unchanged: the priority the client gave beside it too
            forwarded["spillway-priority"] = ask.priority_header.decode("latin-1")  # or the tenant's ceiling
        # With the tenant (`spillway-tenant`): the gateway may cap a tenant's share of a backend.
        opened = await self.forwarder.open_stream(ask.path, ask.raw, forwarded, remaining, tenant=ask.tenant)
        if isinstance(opened, NotForwarded):
            await self._fall_back(ask, opened.reason, f"{why}; overflow failed: {opened.message}",
                                  opened.retry_after_s, send)  # fmt: skip
            return
        try:
            await self._relay_overflow(ask, opened, why, receive, send)
        finally:  # a cancellation before the relay ran, or a failed send: no verdict, and the in-flight slot back
            opened.finish(None)  # only the first call counts: a no-op after the relay's or `_overflow_whole`'s own

    async def _relay_overflow(self, ask: _Ask, opened: ForwardedStream, why: str, receive: Receive,
                              send: Send) -> None:  # fmt: skip
        """The gateway's answer, opened: relayed as it comes, or read whole (`_overflow_whole`)."""
        capped, ask.capped = ask.capped, None  # the cloud has the body as the client sent it: no cap applies there
        spillway = {"outcome": names.OVERFLOW, "backend": opened.backend}
        backend: Headers = [] if opened.backend is None else [(_BACKEND, opened.backend.encode("latin-1"))]
        headers: Headers = [(_OUTCOME, b"overflow"), *ask.headers(), *backend]
        if not ask.stream or not opened.event_stream:
            await self._overflow_whole(ask, opened, spillway, headers, backend, why, capped, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers],
            }
        )

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        relaying = asyncio.ensure_future(relay(opened, write, spillway, kind=ask.kind, model=ask.engine.name,
                                               clock=time.monotonic))  # fmt: skip
        watcher = asyncio.ensure_future(_watch_disconnect(receive, relaying))
        try:
            relayed = await relaying
        except asyncio.CancelledError:
            # The watcher ends (returns) once it has cancelled the relay for a client that left; pending, it did not.
            left = watcher.done() and not watcher.cancelled() and watcher.exception() is None
            if not relaying.cancelled() or not left:
                raise  # the handler's own cancellation, not its client's leaving
            ask.count(names.OVERFLOW)  # the client left while it was answered from the cloud
            return
        finally:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        outcome = names.OVERFLOW if relayed.end == "done" else names.ERROR
        usage = relayed.usage or {}
        completion_tokens = _int(usage.get("completion_tokens"), relayed.content_events)
        ask.add_tokens(completion_tokens)
        listener = ask.engine.listener
        if listener is not None:
            now = time.monotonic()
            listener.finished(ask.level, outcome, operation=ask.request.operation,
                              prompt_tokens=_int(usage.get("prompt_tokens"), len(ask.request.prompt)),
                              completion_tokens=completion_tokens,
                              ttft_s=None if relayed.first_token_at is None else relayed.first_token_at - ask.arrived,
                              duration_s=now - ask.arrived, tenant=ask.label)  # fmt: skip

    async def _overflow_whole(self, ask: _Ask, opened: ForwardedStream, spillway: dict[str, Any], headers: Headers,
                              backend: Headers, why: str, capped: int | None, send: Send) -> None:  # fmt: skip
        """A whole answer from the cloud: read to its end, then sent with the `spillway` field in it. Nothing has
        been sent before it is in, so a failure on the way still takes the fallback chain."""
        try:
            payload = await opened.read_all(self.max_body_bytes)
            arrived = time.monotonic()  # the client's first token comes with the whole answer
            body = json.loads(payload)
            if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
                raise ValueError("not a completion")
        except (StreamBroken, ValueError, UnicodeDecodeError) as exc:
            opened.finish(False)
            ask.capped = capped  # a fallback answers the capped request
            await self._fall_back(ask, "gateway_bad_answer", f"{why}; the overflowed answer failed: {exc}", 1.0, send)
            return
        opened.finish(True)
        body[names.OPENAI_FIELD] = spillway
        usage: dict[str, Any] = body["usage"] if isinstance(body.get("usage"), dict) else {}
        ask.add_tokens(_int(usage.get("completion_tokens"), 0))
        listener = ask.engine.listener
        if listener is not None:
            listener.finished(ask.level, names.OVERFLOW, operation=ask.request.operation,
                              prompt_tokens=_int(usage.get("prompt_tokens"), len(ask.request.prompt)),
                              completion_tokens=_int(usage.get("completion_tokens"), 0),
                              ttft_s=arrived - ask.arrived,
                              duration_s=time.monotonic() - ask.arrived, tenant=ask.label)  # fmt: skip
        if ask.stream:  # a stream asked for and a whole answer given (a backend that does not stream): as chunks
            choice: dict[str, Any] = (
                body["choices"][0] if body["choices"] and isinstance(body["choices"][0], dict) else {}
            )
            message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
            text = choice.get("text") if not ask.chat else message.get("content")
            completion = Completion(
                text if isinstance(text, str) else "",
                str(choice.get("finish_reason") or "stop"),
                _int(usage.get("prompt_tokens"), 0),
                _int(usage.get("completion_tokens"), 0),
            )
            await self._stream(send, ask, _once(completion), names.OVERFLOW, spillway, backend)
            return
        await _respond(send, 200, json.dumps(body).encode(), extra=headers)

    # ---- fallbacks -------------------------------------------------------------------------------------------------

    async def _fall_back(self, ask: _Ask, reason: str, message: str, retry_s: float, send: Send) -> None:
        """When the cloud cannot answer: the cached completion of this very greedy request, the default text, the
        async queue (for the models it accepts), else 503 with the reason."""
        completion = self._cached(ask)
        if completion is not None:
            await self._answer(send, ask, completion, names.FALLBACK_CACHE, reason)
            return
        default = self._default(ask)
        if default is not None:
            await self._answer(send, ask, default, names.FALLBACK_DEFAULT, reason)
            return
        if self.jobs is not None and self.jobs.accepts(ask.engine.name):
            stored = json.dumps({"path": ask.path, "body": ask.body, "tenant": ask.tenant}).encode()
            try:
                job = await self.jobs.submit(ask.engine.name, None, stored, None)
            except QueueFull:
                message += "; and the async queue is full"
            except StoreUnavailable as exc:
                reason = exc.reason
                message += f"; and the async queue cannot store it now: {exc}"
            else:
                location = JOBS_PREFIX + job.id
                body = {"id": job.id, "object": "spillway.job", "status": job.status, "model": ask.engine.name,
                        "location": location,
                        names.OPENAI_FIELD: {"outcome": names.QUEUED_ASYNC, "reason": reason}}  # fmt: skip
                ask.count(names.QUEUED_ASYNC)
                await _respond(send, 202, json.dumps(body).encode(),
                               extra=[(_OUTCOME, b"queued_async"), (_REASON, reason.encode()),
                                      (_JOB_ID, job.id.encode()), (b"location", location.encode()),
                                      *ask.headers()])  # fmt: skip
                return
        ask.refused()
        raise ApiError(503, message, code=reason, kind="server_error", retry_after_s=retry_s, reason=reason,
                       extra=ask.headers())  # fmt: skip

    async def _without_model(self, ask: _Ask, verdict: Verdict) -> tuple[Completion, str, str | None] | ApiError:
        """A verdict that runs no model here: the policy's fallback (the completion, its outcome and reason), or the
        shed's refusal, counted (an ApiError to raise). Overflow is the caller's (Triton generate: the fallback
        chain without a gateway)."""
        if verdict.action == "fallback":
            completion = self._cached(ask) if verdict.fallback == "cache" else self._default(ask)
            if completion is None:
                ask.refused()
                what = ("holds no completion of this greedy request" if verdict.fallback == "cache"
                        else "has no default text (policy default_text or the model's fallback_text)")  # fmt: skip
                reason = "fallback_miss"
                return ApiError(503, f"priority {ask.level} is answered by a fallback for now, and it {what}",
                                code=reason, kind="server_error", retry_after_s=FALLBACK_MISS_RETRY_AFTER_S,
                                reason=reason, extra=ask.headers())  # fmt: skip
            outcome = names.FALLBACK_CACHE if verdict.fallback == "cache" else names.FALLBACK_DEFAULT
            return completion, outcome, None
        if verdict.action == "overflow":  # Triton generate only: the chain without the gateway
            completion = self._cached(ask)
            if completion is not None:
                return completion, names.FALLBACK_CACHE, "overflow_unsupported"
            completion = self._default(ask)
            if completion is not None:
                return completion, names.FALLBACK_DEFAULT, "overflow_unsupported"
            verdict = Verdict("refuse", "deadline_unmeetable", verdict.message or "the device cannot take it in time")
        ask.refused()
        assert verdict.reason is not None
        return ApiError(503, verdict.message, code=verdict.reason, kind="server_error",
                        retry_after_s=verdict.retry_after_s, reason=verdict.reason, extra=ask.headers())  # fmt: skip

    def _cached(self, ask: _Ask) -> Completion | None:
        if ask.key is None or self.completions is None:
            return None
        return self.completions.get(ask.key)

    def _default(self, ask: _Ask) -> Completion | None:
        """The default text (the policy's, else the model's `fallback_text`) as a completion that stopped."""
        text = ask.plan.default_text if ask.plan is not None else None
        text = text or ask.engine.fallback_text
        if not text:
            return None
        try:
            tokens = len(ask.engine.text.encode(text))
        except ValueError:
            tokens = 0
        return Completion(text, "stop", len(ask.request.prompt), tokens)

    async def _answer(self, send: Send, ask: _Ask, completion: Completion, outcome: str, reason: str | None) -> None:
        """A fallback's answer, whole or as a proper stream, saying what it is; counted."""
        ask.count(outcome)
        spillway: dict[str, Any] = {"outcome": outcome}
        extra: Headers = []
        if reason is not None:
            spillway["reason"] = reason
            extra.append((_REASON, reason.encode()))
        if ask.stream:
            await self._stream(send, ask, _once(completion), outcome, spillway, extra)
        else:
            await self._whole(send, ask, _once(completion), outcome, spillway, extra)

    # ---- request fields --------------------------------------------------------------------------------------------

    def _check_fields(self, body: dict[str, Any], chat: bool) -> None:
        """Refuse the fields the agent does not implement; log the unknown ones and go on."""
        unknown = _refuse_unused(body, chat)
        # Unknown fields are ignored with a warning, as vLLM does (`OpenAIBaseModel.__log_extra_fields__`, extra
        # "allow"): clients add vendor and newer fields freely, and refusing them would break clients that work
        # with vLLM. Each name is logged once, so a client sending one on every request does not flood the log.
        new = list(dict.fromkeys(name[:40] for name in unknown if name[:40] not in self.warned))
        new = new[: max(_WARNED_AT_MOST - len(self.warned), 0)]  # one request with thousands of names included
        if new:
            self.warned.update(new)
            log.warning("OpenAI request fields ignored (not known to this server): %s", ", ".join(map(repr, new)))

    def _prompt(self, engine: EnginePool, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list of {role, content}", "messages")
            clean = []
            for i, message in enumerate(messages):
                if not isinstance(message, dict):
                    raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
                role, content = message.get("role"), message.get("content")
                if role not in _ROLES:
                    raise ApiError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                                   f"messages[{i}].role")  # fmt: skip
                if isinstance(content, list):  # content parts: the text ones
                    parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                    content = "".join(p for p in parts if isinstance(p, str)) if parts else content
                if not isinstance(content, str):
                    raise ApiError(400, f"messages[{i}].content must be a string (or text parts)",
                                   f"messages[{i}].content")  # fmt: skip
                clean.append({"role": role, "content": content})
            if not engine.text.chat:
                raise ApiError(400, f"the model '{engine.name}' has no chat template: use /v1/completions", "model")
            try:
                text = engine.text.chat_prompt(clean)
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages") from None
        else:
            given = body.get("prompt")
            if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str):
                given = given[0]
            if not isinstance(given, str) or not given:
                raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
            text = given
        if len(text) > engine.context * 8:  # far beyond the context whatever the tokenizer: refused before encoding
            raise ApiError(400, f"the prompt is longer than the model's {engine.context}-token context", "prompt",
                           "context_length_exceeded")  # fmt: skip
        try:
            tokens = engine.text.encode(text)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
        if len(tokens) >= engine.context:
            raise ApiError(400, f"the prompt has {len(tokens)} tokens; the model's context is {engine.context}",
                           "messages" if chat else "prompt", "context_length_exceeded")  # fmt: skip
        return tokens

    def _request(self, engine: EnginePool, body: dict[str, Any], prompt: list[int], chat: bool,
                 headers: dict[bytes, bytes], cap: int | None = None
                 ) -> tuple[GenerationRequest, int | None]:  # fmt: skip
        """The request to generate, and the policy's max_tokens `cap` where it lowered the request's max_tokens (one
        above the cap, or none with a default above it)."""
        room = engine.context - len(prompt)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        default = min(engine.default_max_tokens or self.default_max_tokens, room) if chat else min(16, room)
        max_tokens = _integer(body, name, default, 1, 1 << 30)
        assert max_tokens is not None
        capped = None
        if cap is not None and max_tokens > cap:
            max_tokens, capped = cap, cap
        if max_tokens > room:
            raise ApiError(400, f"'{name}' {max_tokens} and the prompt's {len(prompt)} tokens exceed the model's "
                           f"{engine.context}-token context", name, "context_length_exceeded")  # fmt: skip
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise ApiError(400, "'top_p' must be above 0", "top_p")
        top_k = _integer(body, "top_k", 0, -1, 1 << 20)
        seed = _integer(body, "seed", None, -(1 << 63), (1 << 64) - 1)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop")
        priority = body.get("priority", 0)
        header = headers.get(b"spillway-priority")
        if header is not None:
            priority = int(header) if header.isdigit() and len(header) <= 6 else -1
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise ApiError(400, f"'priority' must be a non-negative integer (1 the highest), got {priority!r}",
                           "priority")  # fmt: skip
        timeout = _integer(body, "timeout", None, 0, 1 << 40)  # microseconds to the first token, as on V2
        budget = headers.get(_TIMEOUT_US)  # what is left of an overflowed request's deadline (a cloud-role agent)
        if budget is not None:
            try:
                left = parse_timeout_budget_us(budget)
            except ValueError as exc:
                raise ApiError(400, str(exc), names.H_TIMEOUT_US) from None
            if left is not None:
                timeout = max(1, left) if not timeout else min(timeout, max(1, left))
        ignore_eos = body.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise ApiError(400, f"'ignore_eos' must be true or false, got {str(ignore_eos)[:60]!r}", "ignore_eos")
        return GenerationRequest(
            prompt=prompt, max_tokens=max_tokens, stop=tuple(stops), priority=priority,
            operation="chat" if chat else "text_completion", ignore_eos=ignore_eos is True,
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or 0,
                                    seed=None if seed is None else seed % (1 << 63)),
            timeout_s=None if not timeout else timeout / 1e6,
        ), capped  # fmt: skip

    # ---- answers ---------------------------------------------------------------------------------------------------

    async def _whole(self, send: Send, ask: _Ask, chunks: AsyncIterable[Chunk], outcome: str | None,
                     spillway: dict[str, Any], extra: Headers | None = None) -> None:  # fmt: skip
        """A whole completion of `chunks`: served here (`outcome` None: local, or error) or a fallback's."""
        parts = [chunk async for chunk in chunks]
        last = parts[-1]
        text = "".join(c.text for c in parts)
        error = _failed(last)
        if error is not None:
            await _respond(send, error.status, error.body(), extra=[(_OUTCOME, b"error"), *ask.headers()])
            return
        if outcome is None:
            self._remember(ask, text, last)
        said = outcome or _outcome(last)
        body = _completion_body(ask, text, last, self._spillway(ask, said, last, spillway))
        await _respond(send, 200, json.dumps(body).encode(),
                       extra=[(_OUTCOME, said.encode()), *ask.headers(), *(extra or [])])  # fmt: skip

    async def _stream(self, send: Send, ask: _Ask, chunks: AsyncIterable[Chunk], outcome: str | None,
                      spillway: dict[str, Any], extra: Headers | None = None) -> None:  # fmt: skip
        """Server-sent events of `chunks` ending with `data: [DONE]` (or, for a failed model run or one the engine
        cut short, an error event)."""
        said = outcome or names.LOCAL
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                   (_OUTCOME, said.encode()), *ask.headers(), *(extra or [])]  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        created = int(time.time())
        first = True

        async def event(payload: dict[str, Any] | str) -> None:
            await send({"type": "http.response.body", "body": sse(payload), "more_body": True})

        last: Chunk | None = None
        text: list[str] = []
        async for chunk in chunks:
            last = chunk
            error = _failed(chunk)
            if error is not None:  # the openai package raises this as an APIError; never [DONE] after it
                await event(json.loads(error.body()))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            text.append(chunk.text)
            reason = _finish(chunk) if chunk.finish_reason is not None else None
            if not chunk.text and reason is None and not first:
                continue
            if ask.chat:
                delta: dict[str, Any] = {"content": chunk.text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": reason}
            payload: dict[str, Any] = {"id": ask.ident, "object": ask.kind, "created": created,
                                       "model": ask.engine.name, "choices": [choice]}  # fmt: skip
            if reason is not None:
                payload[names.OPENAI_FIELD] = self._spillway(ask, outcome or _outcome(chunk), chunk, spillway)
                if outcome is None:
                    self._remember(ask, "".join(text), chunk)
            await event(payload)
            first = False
        if ask.usage and last is not None:
            await event({"id": ask.ident, "object": ask.kind, "created": created, "model": ask.engine.name,
                         "choices": [], "usage": _usage(last)})  # fmt: skip
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _spillway(ask: _Ask, outcome: str, last: Chunk, more: dict[str, Any]) -> dict[str, Any]:
        field: dict[str, Any] = {"outcome": outcome, "finish_reason": last.finish_reason, **more}
        if ask.capped is not None:
            field["max_tokens_cap"] = ask.capped
        return field


class _GenerativeJobs:
    """The async queue's runner for one generative model: a job is the stored completion request, run here at the
    lowest priority and without a deadline while the model has room; its answer is the completion's JSON."""

    def __init__(self, api: OpenAIApi, name: str, drain_below: float) -> None:
        self.api, self.name, self.drain_below = api, name, drain_below

    def has_room(self) -> bool:
        engine = self.api.engines.get(self.name)
        if engine is None:
            return False
        seats = sum(e.scheduler.config.max_num_seqs for e in engine.instances)
        return sum(e.load for e in engine.instances) < self.drain_below * seats

    def start(self, job: Job) -> Awaitable[bytes]:
        engine = self.api.engines.get(self.name)
        if engine is None or job.request is None:
            raise Unservable(f"the model {self.name!r} is not served any more")
        try:
            stored = json.loads(job.request)
            chat = stored["path"].endswith("chat/completions")
            body = {**stored["body"], "stream": False, "timeout": None}
            body["priority"] = engine.instances[0].scheduler.config.levels  # the lowest level
            plan = self.api.policy.plan_for(self.name) if self.api.policy is not None else None
            tenant = stored.get("tenant")  # its fair share among the tenants at that level
            tenant = tenant if isinstance(tenant, str) else DEFAULT_TENANT
            ask = self.api._ask(engine, plan, body, b"", chat, {}, tenant)
        except (ApiError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise Unservable(f"the request cannot be served any more: {exc}") from None
        try:
            # Counted once, `queued_async`, when the job was accepted: its run here is not a second answer.
            stream = engine.submit(replace(ask.request, counted=False), count_refusal=False)  # Refused: queued again
        except ValueError as exc:  # it no longer fits the model (a variant with a shorter context)
            raise Unservable(f"the request cannot be served any more: {exc}") from None
        return self._answer(ask, stream, job.id)

    async def _answer(self, ask: _Ask, stream: Stream, job_id: str) -> bytes:
        try:
            chunks = [chunk async for chunk in stream]
        finally:
            stream.cancel()  # the job's task cancelled (the queue stopped): its sequence ends too; no-op once ended
        last = chunks[-1]
        if last.finish_reason in ("error", "cancelled", "draining"):
            raise ExecutionFailed(f"the completion ended with {last.finish_reason}")
        text = "".join(c.text for c in chunks)
        self.api._remember(ask, text, last)
        spillway = {"outcome": names.QUEUED_ASYNC, "job_id": job_id, "finish_reason": last.finish_reason}
        body = _completion_body(ask, text, last, spillway)
        return json.dumps(body).encode()


def _tell(engine: EnginePool, level: int, outcome: str, label: str) -> None:
    """One answer's outcome in the model's telemetry (spillway.requests), with its tenant's telemetry name (the
    default tenant's as listeners written before tenants are called, as `GenerationEngine.refused` does)."""
    listener = engine.listener
    if listener is None:
        return
    if label == DEFAULT_TENANT:
        listener.outcome(level, outcome)
    else:
        listener.outcome(level, outcome, label)


async def _debited(chunks: AsyncIterable[Chunk], lease: Lease | None) -> AsyncIterator[Chunk]:
    async for chunk in chunks:
        if lease is not None and chunk.tokens:
            lease.add_tokens(chunk.tokens)  # generated tokens as they come: tokens/s may go below zero
        yield chunk


async def _once(completion: Completion) -> AsyncIterator[Chunk]:
    """A completion known whole (a fallback's) as the one chunk that ends it."""
    finish: FinishReason = "length" if completion.finish_reason == "length" else "stop"
    yield Chunk(completion.text, completion.completion_tokens, finish, completion.prompt_tokens,
                completion.completion_tokens)  # fmt: skip


async def _sse_once(send: Send, event: dict[str, Any], extra: Headers) -> None:
    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *extra]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": sse(event), "more_body": False})


def _usage_of(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}  # fmt: skip


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _failed(chunk: Chunk) -> ApiError | None:
    """The error a completion that did not end well is answered with: a failed model run (`error`), or a sequence
    the engine cut short (`cancelled`: it closed, after the drain's timeout). A client that left cancels its own
    sequence too, but nothing is sent to it then. None for one that ended well."""
    if chunk.finish_reason == "error":
        return ApiError(500, "the model run failed; see the agent log", code="inference_failed", kind="server_error")
    if chunk.finish_reason == "cancelled":
        return ApiError(503, "the model's engine closed before the completion ended", code="cancelled",
                        kind="server_error")  # fmt: skip
    return None


def _finish(chunk: Chunk) -> str:
    """OpenAI's finish_reason: `stop` or `length`; ours beyond those (draining) read as `stop`, with the real one in
    `spillway.finish_reason` (error and cancelled are answered with an error instead, `_failed`)."""
    return "length" if chunk.finish_reason == "length" else "stop"


def _outcome(chunk: Chunk) -> str:
    return names.ERROR if chunk.finish_reason == "error" else names.LOCAL


def _usage(chunk: Chunk) -> dict[str, int]:
    return {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
            "total_tokens": chunk.prompt_tokens + chunk.completion_tokens}  # fmt: skip


async def _watch_disconnect(receive: Receive, work: Stream | asyncio.Future[Any]) -> None:
    """Cancel `work` when its client leaves: a stream's sequence (its KV blocks free at the next step), or a relay."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            work.cancel()
            return


def _completion_body(ask: _Ask, text: str, last: Chunk, spillway: dict[str, Any]) -> dict[str, Any]:
    """A whole completion in OpenAI's shape (chat or text), with Spillway's field saying how it was answered."""
    reason = _finish(last)
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        if ask.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    )  # fmt: skip
    return {"id": ask.ident, "object": "chat.completion" if ask.chat else "text_completion",
            "created": int(time.time()), "model": ask.engine.name, "choices": [choice], "usage": _usage(last),
            names.OPENAI_FIELD: spillway}  # fmt: skip
