"""The OpenAI-compatible API of the agent's generative models: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, non-streaming and `stream: true` (server-sent events `data: {chunk}` ending with
`data: [DONE]`, `stream_options.include_usage` for a last chunk with the usage), as the `openai` package expects.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a request that is wrong (the
field named in `param`), 404 for a model that is not served, 413 for a body over the limit, 429 when the queue is
full and 503 when the device cannot give the first token in time or drains, with Retry-After. Spillway's outcome is
in the `spillway-outcome` header. A client that disconnects mid-stream cancels its sequence: its KV blocks are free
at the next step.

Fields the agent does not implement (tools, JSON mode, logprobs, penalties, logit_bias, n or best_of above 1, echo,
suffix, vLLM's guided decoding...) are refused with a value that would use them: 400, `code: unsupported_parameter`,
the field in `param`, as OpenAI refuses a parameter a model lacks. vLLM's extra `ignore_eos` is honoured (benchmarks
need exact output lengths; the `openai` package sends it through `extra_body`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from edge_agent.generation.engine import Chunk, GenerationRequest, Stream
from edge_agent.generation.pool import EnginePool
from edge_agent.generation.sampling import SamplingParams
from edge_agent.scheduling.worker import Refused
from edge_agent.serving.pipeline import respond as _respond
from spillway.contract import names
from spillway.contract.v2 import BodyTooLarge, ClientGone, read_body

__all__ = ["OpenAIApi"]

log = logging.getLogger("spillway.agent")
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
_OUTCOME = names.H_OUTCOME.encode()
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
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: float | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

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


class OpenAIApi:
    def __init__(self, engines: dict[str, EnginePool], *, max_body_bytes: int, default_max_tokens: int) -> None:
        self.engines = engines
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.warned: set[str] = set()  # unknown field names already logged

    async def handle(self, method: str, path: str, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        try:
            if path == "/v1/models" and method in ("GET", "HEAD"):
                data = [{"id": name, "object": "model", "created": self.created, "owned_by": "spillway"}
                        for name in sorted(self.engines)]  # fmt: skip
                await _respond(send, 200, json.dumps({"object": "list", "data": data}).encode())
            elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                await self._generate(path.endswith("chat/completions"), headers, receive, send)
            elif path.startswith("/v1/models/") and method in ("GET", "HEAD"):
                name = path[len("/v1/models/") :]
                self._engine(name)
                model = {"id": name, "object": "model", "created": self.created, "owned_by": "spillway"}
                await _respond(send, 200, json.dumps(model).encode())
            else:
                raise ApiError(404, f"no such endpoint: {method} {path}", code="not_found")
        except ApiError as exc:
            extra = [(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())] if exc.retry_after_s else []
            outcome = b"rejected"
            await _respond(send, exc.status, exc.body(), extra=[(_OUTCOME, outcome), *extra])
        except ClientGone:
            return

    async def triton_generate(self, name: str, version: str | None, stream: bool, headers: dict[bytes, bytes],
                              receive: Receive, send: Send) -> None:  # fmt: skip
        """Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate[_stream]` with `text_input` and
        `parameters` (the same fields as a completion: max_tokens, temperature, top_p, top_k, seed, stop, priority,
        timeout); answers `{model_name, model_version, text_output}`, streamed as SSE events of new text. Errors are
        V2's, `{"error": "..."}`."""
        try:
            engine = self._engine(name)
            if version and version != engine.version:
                raise ApiError(404, f"model {name!r} serves version {engine.version}, not {version}", "model",
                               "model_not_found")  # fmt: skip
            raw = await read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
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
            try:
                self._check_fields(fields, False)
                request = self._request(engine, fields, self._prompt(engine, fields, False), False, headers)
            except ApiError:
                engine.refused()
                raise
            try:
                generated = engine.submit(request)
            except Refused as exc:
                retry = exc.rejection.retry_after_s
                raise ApiError(503, str(exc), code=exc.rejection.reason, retry_after_s=retry) from None
            except ValueError as exc:  # the prompt and max_tokens beyond the context, or the KV budget
                raise ApiError(400, str(exc), "max_tokens") from None
        except BodyTooLarge as exc:
            await _respond(send, 413, json.dumps({"error": str(exc)}).encode(), extra=[(_OUTCOME, b"rejected")])
            return
        except (ValueError, UnicodeDecodeError) as exc:  # not JSON
            await _respond(send, 400, json.dumps({"error": f"the body is not valid JSON: {exc}"}).encode(),
                           extra=[(_OUTCOME, b"rejected")])  # fmt: skip
            return
        except ApiError as exc:
            message = exc.message if exc.param is None else f"{exc.message} (field {exc.param})"
            extra = [(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())] if exc.retry_after_s else []
            await _respond(send, exc.status, json.dumps({"error": message}).encode(),
                           extra=[(_OUTCOME, b"rejected"), *extra])  # fmt: skip
            return
        except ClientGone:
            return
        head = {"model_name": name, "model_version": engine.version}
        watcher = asyncio.ensure_future(_watch_disconnect(receive, generated))
        try:
            if not stream:
                chunks = [chunk async for chunk in generated]
                answer = {**head, "text_output": "".join(c.text for c in chunks),
                          "finish_reason": chunks[-1].finish_reason, "usage": _usage(chunks[-1])}  # fmt: skip
                await _respond(send, 500 if chunks[-1].finish_reason == "error" else 200, json.dumps(answer).encode(),
                               extra=[(_OUTCOME, _outcome(chunks[-1]).encode())])  # fmt: skip
                return
            start = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                     (_OUTCOME, b"local")]  # fmt: skip
            await send({"type": "http.response.start", "status": 200, "headers": start})
            async for chunk in generated:
                if not chunk.text and chunk.finish_reason is None:
                    continue
                event: dict[str, Any] = {**head, "text_output": chunk.text}
                if chunk.finish_reason is not None:
                    event["finish_reason"] = chunk.finish_reason
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            generated.cancel()

    def _engine(self, name: Any) -> EnginePool:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' must name a served model", "model")
        engine = self.engines.get(name)
        if engine is None:
            raise ApiError(404, f"the model '{name[:100]}' does not exist (served: {sorted(self.engines)})", "model",
                           "model_not_found")  # fmt: skip
        return engine

    async def _generate(self, chat: bool, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
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
        try:
            self._check_fields(body, chat)
            if body.get("stream") is not None and not isinstance(body["stream"], bool):
                raise ApiError(400, f"'stream' must be true or false, got {str(body['stream'])[:60]!r}", "stream")
            prompt = self._prompt(engine, body, chat)
            request = self._request(engine, body, prompt, chat, headers)
        except ApiError:
            engine.refused()  # counted: rejected, before its priority is known
            raise
        try:
            stream = engine.submit(request)
        except Refused as exc:
            reason = exc.rejection.reason
            status = 429 if reason == "queue_full" else 503
            raise ApiError(status, str(exc), code=reason, kind="server_error" if status == 503 else "rate_limit",
                           retry_after_s=exc.rejection.retry_after_s) from None  # fmt: skip
        except ValueError as exc:  # the prompt and max_tokens beyond the context, or the KV budget
            raise ApiError(400, str(exc), "max_tokens") from None
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stream))
        try:
            if body.get("stream") is True:
                options = body.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                await self._stream(send, stream, ident, engine.name, chat, usage)
            else:
                await self._whole(send, stream, ident, engine.name, chat)
        finally:
            watcher.cancel()
            stream.cancel()  # a handler that ends early (its send failed) frees the sequence; no-op once it ended

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
                 headers: dict[bytes, bytes]) -> GenerationRequest:  # fmt: skip
        room = engine.context - len(prompt)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        default = min(engine.default_max_tokens or self.default_max_tokens, room) if chat else min(16, room)
        max_tokens = _integer(body, name, default, 1, 1 << 30)
        assert max_tokens is not None
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
        ignore_eos = body.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise ApiError(400, f"'ignore_eos' must be true or false, got {str(ignore_eos)[:60]!r}", "ignore_eos")
        return GenerationRequest(
            prompt=prompt, max_tokens=max_tokens, stop=tuple(stops), priority=priority,
            operation="chat" if chat else "text_completion", ignore_eos=ignore_eos is True,
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or 0,
                                    seed=None if seed is None else seed % (1 << 63)),
            timeout_s=None if not timeout else timeout / 1e6,
        )  # fmt: skip

    async def _whole(self, send: Send, stream: Stream, ident: str, model: str, chat: bool) -> None:
        chunks = [chunk async for chunk in stream]
        last = chunks[-1]
        text = "".join(c.text for c in chunks)
        reason = _finish(last)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        )  # fmt: skip
        body = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": [choice], "usage": _usage(last),
                "spillway": {"outcome": _outcome(last), "finish_reason": last.finish_reason}}  # fmt: skip
        if last.finish_reason == "error":
            error = ApiError(
                500, "the model run failed; see the agent log", code="inference_failed", kind="server_error"
            )
            await _respond(send, 500, error.body(), extra=[(_OUTCOME, b"error")])
            return
        await _respond(send, 200, json.dumps(body).encode(), extra=[(_OUTCOME, _outcome(last).encode())])

    async def _stream(self, send: Send, stream: Stream, ident: str, model: str, chat: bool, usage: bool) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (_OUTCOME, b"local")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        first = True

        async def event(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        last: Chunk | None = None
        async for chunk in stream:
            last = chunk
            if chunk.finish_reason == "error":  # the openai package raises this as an APIError
                error = ApiError(500, "the model run failed; see the agent log", code="inference_failed",
                                 kind="server_error")  # fmt: skip
                await event(json.loads(error.body()))
                break
            reason = _finish(chunk) if chunk.finish_reason is not None else None
            if not chunk.text and reason is None and not first:
                continue
            if chat:
                delta: dict[str, Any] = {"content": chunk.text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": reason}
            payload: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": model,
                                       "choices": [choice]}  # fmt: skip
            if reason is not None:
                payload["spillway"] = {"outcome": _outcome(chunk), "finish_reason": chunk.finish_reason}
            await event(payload)
            first = False
        if usage and last is not None:
            await event({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                         "usage": _usage(last)})  # fmt: skip
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _finish(chunk: Chunk) -> str:
    """OpenAI's finish_reason: `stop` or `length`; ours beyond those (cancelled, error) read as `stop`, with the
    real one in `spillway.finish_reason`."""
    return "length" if chunk.finish_reason == "length" else "stop"


def _outcome(chunk: Chunk) -> str:
    return names.ERROR if chunk.finish_reason == "error" else names.LOCAL


def _usage(chunk: Chunk) -> dict[str, int]:
    return {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.completion_tokens,
            "total_tokens": chunk.prompt_tokens + chunk.completion_tokens}  # fmt: skip


async def _watch_disconnect(receive: Receive, stream: Stream) -> None:
    """Cancel the stream's sequence when its client leaves."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return
