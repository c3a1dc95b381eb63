"""The V2 path's HTTP/1.1 client to its backends: keep-alive connections on asyncio protocols with httptools' parser,
one write per request, no per-request objects beyond the answer.

aiohttp's `ClientSession.post` cost the gateway about as much CPU per request as everything else on its path
together (request and response objects, a stream reader, timer handles, its tracing and cookie hooks), which on a
2-core machine shared with the backend is what the gateway added to a request's latency at concurrency 8. The
gateway only ever POSTs a body it holds whole and passes the answer on, so this client does only that: the request
head and body leave in one write, the answer's status and headers come from httptools' C parser, its body is
handed over as it arrives (reading pauses while more than `_HIGH_WATER` bytes wait to be taken).

The readiness checks and the OpenAI-compatible relay keep aiohttp: they are not per overflowed request, or a
stream's cost is its tokens.

Errors (one tree, the kinds the gateway counts):

    UpstreamError
    ├── UpstreamConnect   could not connect (refused, unreachable, DNS, TLS handshake)
    ├── UpstreamReset     the connection failed or closed before the answer was complete, or the answer was not HTTP
    └── UpstreamTimeout   the attempt's time ran out (connecting, waiting, or reading the body)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httptools

_HIGH_WATER = 256 << 10  # body bytes received but not yet taken: reading pauses above this
_SWEEP_S = 5.0  # how often idle connections past the keep-alive time are closed
# An idle connection is not used again after this long: below uvicorn's 5 s keep-alive (Spillway agents, MLServer),
# so that a request is never written into a connection its backend is closing at that moment.
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """A failed attempt at a backend."""


class UpstreamConnect(UpstreamError):
    """No connection could be made."""


class UpstreamReset(UpstreamError):
    """The connection failed or closed before the answer was complete, or the answer was not HTTP/1.x."""


class UpstreamTimeout(UpstreamError):
    """The attempt's time ran out."""


@dataclass(frozen=True)
class Origin:
    """Where a backend's URL points: scheme, host and port, and the path its requests are prefixed with."""

    host: str
    port: int
    tls: bool
    prefix: str  # the URL's own path without its trailing '/', prefixed to every request's path
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        default = (tls and port == 443) or (not tls and port == 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        text = host if default else f"{host}:{port}"
        host_header = text.encode() if text.isascii() else text.encode("idna")
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"), host_header)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a backend: one exchange at a time."""

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.origin = origin
        self.loop = loop  # kept: asyncio.get_running_loop() costs a getpid() system call per call
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self._answer: Answer | None = None

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None or answer.complete:  # bytes nobody asked for: the connection cannot be trusted any more
            if answer is not None:
                answer.keep_alive = False
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            answer.fail(UpstreamReset("the backend switched protocols"))
            self.close()
        except httptools.HttpParserError as exc:
            answer.fail(UpstreamReset(f"not an HTTP/1.1 answer: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self._answer
        if answer is not None and not answer.complete:
            if answer.status and answer.until_close:  # a body delimited by the connection's end is now complete
                answer.finish(keep_alive=False)
            else:
                reason = f"{type(exc).__name__}: {exc}" if exc else "the backend closed the connection"
                answer.fail(UpstreamReset(reason))

    def pause_writing(self) -> None:  # the body is already whole in the transport's buffer: nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._answer is not None
        self._answer.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        answer = self._answer
        assert answer is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            answer.headers.clear()
            return
        answer.status = status
        answer.until_close = not any(name in (b"content-length", b"transfer-encoding") for name, _ in answer.headers)
        answer.wake()

    def on_body(self, body: bytes) -> None:
        answer = self._answer
        assert answer is not None
        answer.chunks.append(body)
        answer.buffered += len(body)
        if answer.buffered > _HIGH_WATER and self.transport is not None and not answer.paused:
            answer.paused = True
            self.transport.pause_reading()
        answer.wake()

    def on_message_complete(self) -> None:
        answer = self._answer
        if answer is None or not answer.status:
            return
        answer.finish(keep_alive=self.parser.should_keep_alive())

    # ---- ours ----

    def begin(self, answer: Answer) -> None:
        self._answer = answer

    def end(self) -> None:
        self._answer = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Answer:
    """A backend's answer: `status` and `headers` (names lower-case) once `Upstreams.post` returns, the body through
    `read` or `chunks`. `release` (always, e.g. in a `finally`) hands the connection back, or closes it when the
    answer was not read to its end."""

    __slots__ = ("_connection", "_pool", "_timer", "_waiter", "buffered", "chunks", "complete", "error", "headers",
                 "keep_alive", "paused", "status", "until_close")  # fmt: skip

    def __init__(self, connection: _Connection, pool: Upstreams) -> None:
        self._connection = connection
        self._pool = pool
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.until_close = False
        self.keep_alive = False
        self.error: UpstreamError | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # ---- driven by the connection ----

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self, *, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.wake()

    def fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.wake()

    def _expire(self) -> None:
        self._timer = None
        self.fail(UpstreamTimeout("the attempt's time ran out"))
        self._connection.close()

    # ---- for the caller ----

    async def _wait(self) -> None:
        """Until the connection has news (headers, a chunk, the end, a failure)."""
        self._waiter = self._connection.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _take(self) -> list[bytes]:
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused:
            self.paused = False
            transport = self._connection.transport
            if transport is not None and not self._connection.closed:
                transport.resume_reading()
        return chunks

    async def read(self, limit: int | None = None) -> bytes:
        """The body whole, or its first `limit` bytes (the rest is not read: the connection is then not reused)."""
        while not self.complete and (limit is None or self.buffered < limit):
            self._raise()
            await self._wait()
        if not self.complete:
            self._raise()
        body = b"".join(self._take())
        return body if limit is None else body[:limit]

    async def chunks_as_they_come(self) -> AsyncIterator[bytes]:
        """The body in the pieces it arrives in (each at least one byte)."""
        while True:
            if self.chunks:
                yield b"".join(self._take())
                continue
            if self.complete:
                return
            self._raise()
            await self._wait()

    def release(self) -> None:
        """Hand the connection back for the next request when this answer was read to its end and the backend
        keeps it alive; else close it. Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connection = self._connection
        connection.end()
        reusable = self.complete and self.keep_alive and not self.chunks and not connection.closed
        self._pool._give_back(connection, reusable)


class Upstreams:
    """Keep-alive connections to every backend, at most `max_connections` open together (a request waits for one
    beyond that); an idle connection is closed after `keepalive_s`, or when its backend closes it."""

    def __init__(self, max_connections: int = 1024, keepalive_s: float = KEEPALIVE_S, *,
                 ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open = 0
        self._waiting: list[asyncio.Future[None]] = []
        self._origins: dict[str, Origin] = {}
        self._starts: dict[tuple[Origin, str], bytes] = {}  # the request line and Host, per backend and path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_sweep = 0.0
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 4096:
                self._origins.clear()
            origin = self._origins[url] = Origin.parse(url)
        return origin

    async def post(self, url: str, path: str, headers: dict[str, str], body: bytes, timeout_s: float) -> Answer:
        """POST `body` to `url` + `path` with `headers` (Host and Content-Length are added); the answer once its
        status and headers are in. Everything, the body's reading included, must end within `timeout_s` from now,
        else the connection is closed and UpstreamTimeout raised (by `post`, `read` or `chunks_as_they_come`)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        origin = self.origin(url)
        start = self._starts.get((origin, path))
        if start is None:
            if len(self._starts) > 4096:
                self._starts.clear()
            target = origin.prefix + path
            if not _safe_path(target):
                target = quote(target, safe="/%:@!$&'()*+,;=-._~")
            start = self._starts[(origin, path)] = (f"POST {target} HTTP/1.1\r\nHost: ".encode() + origin.host_header
                                                    + b"\r\nContent-Length: ")  # fmt: skip
        lines = [start, str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value:
                raise ValueError(f"header {name!r}: a line break in its value")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        if len(body) <= 65536:
            lines.append(body)
            payload = [b"".join(lines)]
        else:  # no copy of a large body
            payload = [b"".join(lines), body]
        connection = await self._acquire(origin, deadline)
        answer = Answer(connection, self)
        connection.begin(answer)
        answer._timer = loop.call_at(deadline, answer._expire)
        try:
            assert connection.transport is not None
            connection.transport.writelines(payload) if len(payload) > 1 else connection.transport.write(payload[0])
            while not answer.status:
                answer._raise()
                await answer._wait()
        except BaseException:
            answer.release()
            raise
        return answer

    async def _acquire(self, origin: Origin, deadline: float) -> _Connection:
        if self._closed:
            raise UpstreamConnect("the gateway is closing")
        loop = self._loop
        assert loop is not None
        now = loop.time()
        if now >= self._next_sweep:
            self._sweep(now)
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_s:
                return connection
            self._drop(connection)
        while self._open >= self.max_connections:
            waiter = loop.create_future()
            self._waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise UpstreamTimeout("no connection to the backends was free in time") from None
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
            idle = self._idle.get(origin)
            while idle:
                connection = idle.pop()
                if not connection.closed:
                    return connection
                self._drop(connection)
        self._open += 1
        try:
            tls: dict[str, Any] = {}
            if origin.tls:
                tls = {"ssl": self._ssl or ssl.create_default_context(), "server_hostname": origin.host}
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin, loop), origin.host, origin.port, **tls),
                max(0.0, deadline - loop.time()),
            )
        except asyncio.TimeoutError:
            self._lost()
            raise UpstreamTimeout(f"could not connect to {origin.host}:{origin.port} in time") from None
        except (OSError, ssl.SSLError) as exc:
            self._lost()
            raise UpstreamConnect(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            self._lost()
            raise
        return connection

    def _give_back(self, connection: _Connection, reusable: bool) -> None:
        if reusable and not self._closed:
            connection.idle_since = connection.loop.time()
            self._idle.setdefault(connection.origin, []).append(connection)
            self._wake_one()
        else:
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._lost()

    def _lost(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + _SWEEP_S
        for origin, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since < self.keepalive_s]
            for connection in idle:
                if connection not in keep:
                    self._drop(connection)
            if keep:
                self._idle[origin] = keep
            else:
                del self._idle[origin]

    async def close(self) -> None:
        """Close every idle connection; those in use close when their answers are released."""
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                self._drop(connection)
        self._idle.clear()


def _safe_path(path: str) -> bool:
    return path.isascii() and all(c not in path for c in ' "<>\\^`{|}#?\x7f') and path.isprintable()


__all__ = [
    "KEEPALIVE_S",
    "Answer",
    "Origin",
    "UpstreamConnect",
    "UpstreamError",
    "UpstreamReset",
    "UpstreamTimeout",
    "Upstreams",
]
