"""An overflowed answer that arrives as a stream: the gateway's response once its first body bytes are in, then the
rest as it comes (`Forwarder.open_stream` opens one), and the server-sent events split out of it.

The first bytes are read before the stream is handed over, so that everything up to them (no answer, a refusal, a
connection that drops before a byte) is still a failure before the client has been told anything: the fallback chain
can answer instead. After them, the client has its status line: a failure can only end its stream with an error.

Every stream is ended exactly once with `finish`, which gives the breaker its one verdict: a clean end is a success
timed by the first byte (a long answer is not a slow gateway), a break or an error event from the gateway is a
failure, and a stream cut short by the client (cancelled) is no verdict at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

    from edge_agent.overflow.breaker import CircuitBreaker

__all__ = ["MAX_EVENT_BYTES", "ForwardedStream", "SseEvents", "StreamBroken"]

MAX_EVENT_BYTES = 1 << 20  # one server-sent event held back while it completes; a stream with a longer one is broken


class StreamBroken(Exception):
    """The gateway's stream ended before its end: the connection broke, or no bytes came within the idle limit."""


@dataclass(eq=False)
class ForwardedStream:
    """The gateway's 200, with its first body bytes in hand; `rest()` yields what follows as it arrives."""

    status: int
    headers: dict[str, str]  # the ones worth passing on (content-type, spillway-backend)
    first: bytes
    first_byte_s: float  # from sending the request to the first body bytes
    _response: aiohttp.ClientResponse
    _breaker: CircuitBreaker
    _done: Callable[[], None]  # the forwarder's own bookkeeping (its in-flight count)
    finished: bool = field(default=False)

    @property
    def backend(self) -> str | None:
        return self.headers.get("spillway-backend")

    @property
    def event_stream(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    async def rest(self) -> AsyncIterator[bytes]:
        """The body after the first bytes, chunk by chunk as the network hands it over; StreamBroken when the
        connection breaks or stays silent past the idle limit (the session's `sock_read` timeout)."""
        import aiohttp

        try:
            async for data in self._response.content.iter_any():
                yield data
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # ClientPayloadError: closed mid-body
            raise StreamBroken(f"the gateway's stream broke: {type(exc).__name__}: {exc}") from None

    async def read_all(self, limit: int) -> bytes:
        """The whole body (for a whole answer); StreamBroken as `rest`, or when it is over `limit` bytes."""
        parts, size = [self.first], len(self.first)
        async for data in self.rest():
            size += len(data)
            if size > limit:
                raise StreamBroken(f"the gateway's answer is over {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    def finish(self, ok: bool | None) -> None:
        """End it: True a clean end, False a failure the breaker counts, None no verdict (the client left). Only the
        first call counts."""
        if self.finished:
            return
        self.finished = True
        if ok is None:
            self._breaker.release()
        else:
            self._breaker.record(ok, self.first_byte_s)
        if ok:
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()
        self._done()


@dataclass
class SseEvents:
    """Splits a byte stream into server-sent events as they complete (a blank line ends one); each is handed back
    whole, with its `data` joined, so that a relay can look at it and pass its bytes on unchanged."""

    _buffer: bytes = b""

    def feed(self, data: bytes) -> list[tuple[bytes, str | None]]:
        """The events `data` completes: (the event's bytes with its blank line, its data or None without one).
        StreamBroken when what is left of an event is over MAX_EVENT_BYTES (no event boundary in sight: the memory
        it would take is unbounded)."""
        self._buffer += data
        if b"\r" in self._buffer:  # CRLF (or CR) line ends, as the SSE standard allows: one kind from here on
            self._buffer = self._buffer.replace(b"\r\n", b"\n")
            if not self._buffer.endswith(b"\r"):  # a trailing CR may be half of a CRLF still on its way
                self._buffer = self._buffer.replace(b"\r", b"\n")
        events = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            raw, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            events.append((raw, _data(raw)))
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise StreamBroken(f"the gateway's stream has an event over {MAX_EVENT_BYTES >> 20} MiB")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event not complete yet (at the end of the stream: a cut)."""
        return self._buffer


def _data(raw: bytes) -> str | None:
    lines = [line[5:] for line in raw.decode("utf-8", "replace").split("\n") if line.startswith("data:")]
    if not lines:
        return None
    return "\n".join(line[1:] if line.startswith(" ") else line for line in lines)


def event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event of `payload` (JSON, or a literal such as `[DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True)
class Relayed:
    """How a relayed stream ended: `done` (its `[DONE]`), `error` (the gateway's error event), `broken` (cut: an
    error event of ours ended it); what the client saw of it, for the telemetry."""

    end: str
    first_token_at: float | None  # when the first event with content went out (the clock's seconds)
    content_events: int  # events that carried text: about one per token
    usage: dict[str, Any] | None  # the stream's usage chunk, when the client asked for one


async def relay(forwarded: ForwardedStream, write: Callable[[bytes], Awaitable[None]], spillway: dict[str, Any], *,
                kind: str, model: str, clock: Callable[[], float]) -> Relayed:  # fmt: skip
    """Pass the gateway's events on to `write` as they complete, unchanged, but for one chunk before `data: [DONE]`
    that says where the answer came from (`choices: []` and the `spillway` field). A stream that breaks, or ends
    without `[DONE]`, is ended with an error event in OpenAI's shape, never `[DONE]`: it must not look complete.
    Ends `forwarded` (the breaker's verdict) in every case; the caller ends the HTTP body."""
    events = SseEvents()
    end: str | None = None
    first_at: float | None = None
    content = 0
    usage: dict[str, Any] | None = None
    head: dict[str, Any] = {}

    def look(data: str | None) -> bytes:
        """What to send before this event (the spillway chunk before [DONE]), noting what the event says."""
        nonlocal end, first_at, content, usage
        if data is None:
            return b""
        if data.strip() == "[DONE]":
            end = "done"
            chunk = {"id": head.get("id") or f"spillway-{int(time.time() * 1e3)}", "object": head.get("object", kind),
                     "created": head.get("created", int(time.time())), "model": head.get("model", model),
                     "choices": [], "spillway": spillway}  # fmt: skip
            return event(chunk)
        try:
            payload = json.loads(data)
        except ValueError:
            return b""
        if not isinstance(payload, dict):
            return b""
        if "error" in payload:
            end = "error"
            return b""
        for name in ("id", "object", "created", "model"):
            if name in payload and name not in head:
                head[name] = payload[name]
        if isinstance(payload.get("usage"), dict):
            usage = payload["usage"]
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and _has_text(choice):
                content += 1
                if first_at is None:
                    first_at = clock()
                break
        return b""

    async def take(data: bytes) -> None:
        out = []
        for raw, text in events.feed(data):
            if end is not None:
                break  # nothing after the end: [DONE] or an error event closes the stream for the client
            out.append(look(text))
            out.append(raw)
        if out:
            await write(b"".join(out))

    try:
        try:
            await take(forwarded.first)
            if end is None:
                async for data in forwarded.rest():
                    await take(data)
                    if end is not None:
                        break
        except StreamBroken as exc:
            broken_because = str(exc)
        else:
            broken_because = "the gateway's stream ended without [DONE]"
        if end is None:
            error = {"error": {"message": f"the overflowed stream broke: {broken_because}", "type": "server_error",
                               "param": None, "code": "overflow_failed"}}  # fmt: skip
            await write(event(error))
        forwarded.finish(end == "done")
    finally:
        forwarded.finish(None)  # the client left (cancelled, or its connection refused a write): no verdict
    return Relayed(end or "broken", first_at, content, usage)


def _has_text(choice: dict[str, Any]) -> bool:
    text = choice.get("text")
    if isinstance(text, str) and text:
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and isinstance(delta.get("content"), str) and bool(delta["content"])
