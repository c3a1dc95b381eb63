"""The agent's listeners beside uvicorn's HTTP one: Triton's gRPC port, and the pre-0.2 HTTP port kept for a release.

Ports: HTTP 8000, gRPC 8001 (Triton's). gRPC serves when grpcio is installed and `grpc_port` is not null; without
grpcio, a `grpc_port` left at its default is one log line, a `grpc_port` the config sets is a start error. A default
gRPC port that is busy is one warning and the agent serves HTTP; a busy port the config names is a start error.

Until 0.2 the agent served HTTP on 8001, Triton's gRPC port. For one release an agent whose config does not set
`port` still answers HTTP/1.1 there: the listener on 8001 (`LegacyPort`) reads each connection's first bytes; the
HTTP/2 preface (`PRI * HTTP/2.0`) is gRPC, spliced to the gRPC server (then bound on an internal loopback port);
anything else is HTTP/1.1, spliced to the HTTP port, and the agent says once that HTTP there is deprecated.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_agent.runtime.config import ModelConfigError

if TYPE_CHECKING:
    from edge_agent.config import AgentConfig
    from edge_agent.serving.app import InferenceApp
    from edge_agent.serving.grpc_server import GrpcEndpoint

__all__ = ["LEGACY_HTTP_PORT", "LegacyPort", "PortUnavailable", "Ports", "SidePorts", "grpc_installed", "plan_ports"]

log = logging.getLogger("spillway.agent")

LEGACY_HTTP_PORT = 8001  # the HTTP default before 0.2
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n"
SNIFF_TIMEOUT_S = 10.0  # a connection that says nothing for this long is closed (HTTP and gRPC clients speak first)
_CHUNK = 1 << 16


class PortUnavailable(ModelConfigError):
    """A port the agent config names that the agent cannot serve (grpcio missing, or another process holds it): a
    start error, exit 2."""


@dataclass(frozen=True)
class Ports:
    """What to serve beside HTTP, decided from the config (`plan_ports`)."""

    host: str
    grpc: int | None  # the gRPC port clients use (0: a free one); None: no gRPC
    grpc_explicit: bool  # the config names it: busy is a start error, not a warning
    legacy: int | None  # the pre-0.2 HTTP port, sniffed; None: none


def grpc_installed() -> bool:
    """grpcio and tritonclient's gRPC messages are importable (`pip install 'spillway[grpc]'`)."""
    return importlib.util.find_spec("grpc") is not None and importlib.util.find_spec("tritonclient") is not None


def plan_ports(config: AgentConfig) -> Ports:
    """The gRPC and legacy ports of `config` (PortUnavailable: a `grpc_port` set explicitly without grpcio)."""
    explicit = "grpc_port" in config.model_fields_set
    grpc = config.grpc_port
    if grpc is not None and not grpc_installed():
        if explicit:
            raise PortUnavailable(f"agent config grpc_port: {grpc} needs gRPC support: pip install 'spillway[grpc]' "
                                  "(or set grpc_port: null)")  # fmt: skip
        log.info("gRPC off: pip install 'spillway[grpc]'")
        grpc = None
    legacy = None if "port" in config.model_fields_set else LEGACY_HTTP_PORT
    return Ports(config.host, grpc, explicit, legacy)


def connect_host(host: str) -> str:
    """Where a listener bound on `host` is reached from this machine (a wildcard address: loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 (reading, not binding)


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


# ---- the listeners beside uvicorn's --------------------------------------------------------------------------------


class SidePorts:
    """The gRPC server and the legacy listener of one agent: bound before the app starts (so that a busy port the
    config names is a start error, before anything is served), started once it has, drained with the HTTP side."""

    def __init__(self, ports: Ports, app: InferenceApp, *, max_receive_bytes: int) -> None:
        self.ports = ports
        self.app = app
        self.max_receive_bytes = max_receive_bytes
        self.grpc: GrpcEndpoint | None = None
        self.legacy: LegacyPort | None = None
        self.grpc_port: int | None = None  # where the gRPC server itself listens

    async def bind(self, http_port: int) -> None:
        """Bind the gRPC port and the legacy port (PortUnavailable for a busy port the config names); `http_port`:
        the configured HTTP port, for the log lines."""
        ports = self.ports
        sniffed = ports.grpc is not None and ports.grpc == ports.legacy  # gRPC clients reach it through the sniffer
        if ports.legacy is not None:
            legacy = LegacyPort()
            try:
                await legacy.bind(ports.host, ports.legacy)
                self.legacy = legacy
            except OSError as exc:
                if sniffed and ports.grpc_explicit:
                    raise PortUnavailable(f"agent config grpc_port: port {ports.grpc} on {ports.host} is busy "
                                          f"({exc.strerror or exc}); free it or choose another") from None  # fmt: skip
                if sniffed:
                    log.warning("port %s is busy (%s): serving HTTP on %s without gRPC", ports.legacy,
                                exc.strerror or exc, http_port)  # fmt: skip
                    return
                log.warning("port %s is busy (%s): HTTP is served on %s only", ports.legacy, exc.strerror or exc,
                            http_port)  # fmt: skip
        if ports.grpc is None:
            return
        from edge_agent.serving.grpc_server import GrpcEndpoint, PortBusy

        endpoint = GrpcEndpoint(self.app, max_receive_bytes=self.max_receive_bytes)
        try:
            self.grpc_port = endpoint.bind("127.0.0.1", 0) if sniffed else endpoint.bind(ports.host, ports.grpc)
        except PortBusy as exc:
            if ports.grpc_explicit:
                raise PortUnavailable(f"agent config grpc_port: {exc}; free it or choose another") from None
            log.warning("gRPC off: %s (set grpc_port to serve it elsewhere)", exc)
            return
        self.grpc = endpoint

    async def start(self, http_port: int) -> None:
        """Serve, once the app has started; `http_port`: where uvicorn listens."""
        sniffed = self._sniffed()
        if self.grpc is not None:
            await self.grpc.start()
            log.info("V2 gRPC on %s:%s", self.ports.host, self.ports.legacy if sniffed else self.grpc_port)
        if self.legacy is not None:
            grpc = None
            if self.grpc is not None and self.grpc_port is not None:
                grpc = ("127.0.0.1" if sniffed else connect_host(self.ports.host), self.grpc_port)
            await self.legacy.start((connect_host(self.ports.host), http_port), grpc)
            log.info("port %s answers HTTP/1.1 too (deprecated since 0.2: use %s)", self.ports.legacy, http_port)

    def _sniffed(self) -> bool:
        return self.ports.grpc is not None and self.ports.grpc == self.ports.legacy

    def close_listeners(self) -> None:
        if self.legacy is not None:
            self.legacy.close_listener()

    async def drain(self, grace_s: float) -> None:
        """Refuse new RPCs; let those in flight end within `grace_s`."""
        if self.grpc is not None:
            await self.grpc.stop(grace_s)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Stop everything: what is still in flight after `timeout_s` is cut."""
        if self.grpc is not None:
            await self.grpc.stop(timeout_s)
        if self.legacy is not None:
            await self.legacy.close(timeout_s)
