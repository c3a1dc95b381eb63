"""The pre-0.2 HTTP port, kept for a release (which ports are served, and when this one is: ports.py).

Until 0.2 the agent served HTTP on 8001, Triton's gRPC port. For one release an agent whose config does not set
`port` still answers HTTP/1.1 there: the listener on 8001 (`LegacyPort`) reads each connection's first bytes; the
HTTP/2 preface (`PRI * HTTP/2.0`) is gRPC, spliced to the gRPC server (then bound on an internal loopback port);
anything else is HTTP/1.1, spliced to the HTTP port, and the agent says once that HTTP there is deprecated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

__all__ = ["LEGACY_HTTP_PORT", "LegacyPort", "splice"]

log = logging.getLogger("spillway.agent")

LEGACY_HTTP_PORT = 8001  # the HTTP default before 0.2
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n"
SNIFF_TIMEOUT_S = 10.0  # a connection that says nothing for this long is closed (HTTP and gRPC clients speak first)
_CHUNK = 1 << 16


class LegacyPort:
    """The pre-0.2 HTTP port: each connection goes, by its first bytes, to the gRPC server or the HTTP port."""

    def __init__(self, *, sniff_timeout_s: float = SNIFF_TIMEOUT_S) -> None:
        self.sniff_timeout_s = sniff_timeout_s
        self.http: tuple[str, int] | None = None
        self.grpc: tuple[str, int] | None = None
        self.server: asyncio.Server | None = None
        self.port: int | None = None
        self.warned = False
        self._connections: set[asyncio.Task[None]] = set()

    async def bind(self, host: str, port: int) -> int:
        """Listen on `host:port` (accepting nothing until `start`); OSError when it is busy."""
        self.server = await asyncio.start_server(self._connection, host, port, start_serving=False)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def start(self, http: tuple[str, int], grpc: tuple[str, int] | None) -> None:
        """Accept, splicing HTTP/1.1 to `http` and gRPC to `grpc` (None: gRPC connections are closed)."""
        assert self.server is not None, "bind first"
        self.http, self.grpc = http, grpc
        await self.server.start_serving()

    def close_listener(self) -> None:
        """Accept no more connections; those spliced go on until either end closes them."""
        if self.server is not None:
            self.server.close()

    async def close(self, timeout_s: float) -> None:
        """Close the listener, give the spliced connections `timeout_s` to end, then cut them."""
        self.close_listener()
        running = list(self._connections)
        if running:
            _, pending = await asyncio.wait(running, timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        upstream: asyncio.StreamWriter | None = None
        try:
            first = await asyncio.wait_for(_first_bytes(reader), self.sniff_timeout_s)
            if not first:
                return
            if first.startswith(HTTP2_PREFACE):
                target = self.grpc
                if target is None:
                    log.info("a gRPC client on port %s: this agent serves no gRPC", self.port)
                    return
            else:
                target = self.http
                if not self.warned and target is not None:
                    self.warned = True
                    log.warning("HTTP on port %s is deprecated since 0.2: use %s", self.port, target[1])
            assert target is not None
            up_reader, upstream = await asyncio.open_connection(*target)
            upstream.write(first)
            await splice(reader, writer, up_reader, upstream)
        except (asyncio.TimeoutError, OSError):
            return  # a client that said nothing, or left; or the target is gone (shutting down)
        finally:
            for end in (upstream, writer):
                if end is not None:
                    end.close()


async def _first_bytes(reader: asyncio.StreamReader) -> bytes:
    """Enough of the connection's first bytes to tell the HTTP/2 preface from anything else (b"" at EOF)."""
    data = b""
    while len(data) < len(HTTP2_PREFACE) and HTTP2_PREFACE.startswith(data):
        more = await reader.read(_CHUNK)
        if not more:  # closed before saying which protocol it speaks
            return b""
        data += more
    return data


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up_reader: asyncio.StreamReader,
                 up_writer: asyncio.StreamWriter) -> None:  # fmt: skip
    """Copy both ways until the upstream side ends (a client that half-closes still gets the rest of its answer)."""
    down = asyncio.ensure_future(_pipe(reader, up_writer))
    try:
        await _pipe(up_reader, writer)
    finally:
        down.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await down


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close `sink`; on an error, close it."""
    try:
        while True:
            data = await source.read(_CHUNK)
            if not data:
                break
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except OSError:
        sink.close()
