"""Which ports the agent serves beside HTTP, checked before anything loads, and the listeners on them (`SidePorts`).

HTTP 8000, gRPC 8001 (Triton's). gRPC serves when grpcio is installed and `grpc_port` is not null; without grpcio, a
`grpc_port` left at its default is one log line, a `grpc_port` the config sets is a start error. A default gRPC port
that is busy, or that is the HTTP port (`port: 8001`, the pre-0.2 default, written out), is one warning and the agent
serves HTTP only; a busy port the config names, or a `grpc_port` the config sets to the HTTP port, is a start error
(`PortUnavailable`, exit 2). An agent whose config does not set `port` answers HTTP/1.1 on 8001 too, for one release
(legacy_port.py).

`check_ports` runs before the models load (a start error must not wait for minutes of warm-up); `SidePorts.bind`
binds for real once the app is built, so a port taken in between is still a start error, not a crash.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_agent.runtime.config import ModelConfigError
from edge_agent.serving.legacy_port import LEGACY_HTTP_PORT, LegacyPort

if TYPE_CHECKING:
    from edge_agent.config import AgentConfig
    from edge_agent.serving.app import InferenceApp
    from edge_agent.serving.grpc_server import GrpcEndpoint

__all__ = ["PortBusy", "PortUnavailable", "Ports", "SidePorts", "check_free", "check_ports", "grpc_installed",
           "plan_ports"]  # fmt: skip

log = logging.getLogger("spillway.agent")


class PortUnavailable(ModelConfigError):
    """A port the agent config names that the agent cannot serve (grpcio missing, another process holds it, or it
    is the HTTP port): a start error, exit 2."""


class PortBusy(OSError):
    """A port cannot be bound (another process holds it)."""


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
    """The gRPC and legacy ports of `config`. PortUnavailable: a `grpc_port` set explicitly to the HTTP port, or
    without grpcio."""
    explicit = "grpc_port" in config.model_fields_set
    grpc = config.grpc_port
    if grpc is not None and grpc != 0 and grpc == config.port:
        if explicit:
            raise PortUnavailable(f"agent config grpc_port: {grpc} is also the HTTP port (`port`); set another "
                                  "(or grpc_port: null for no gRPC)")  # fmt: skip
        log.warning("gRPC off: port %s is the HTTP port; set grpc_port to serve gRPC", grpc)
        grpc = None
    if grpc is not None and not grpc_installed():
        if explicit:
            raise PortUnavailable(f"agent config grpc_port: {grpc} needs gRPC support: pip install 'spillway[grpc]' "
                                  "(or set grpc_port: null)")  # fmt: skip
        log.info("gRPC off: pip install 'spillway[grpc]'")
        grpc = None
    legacy = None if "port" in config.model_fields_set else LEGACY_HTTP_PORT
    return Ports(config.host, grpc, explicit, legacy)


def check_ports(config: AgentConfig) -> Ports:
    """`plan_ports`, then each port whose being busy would be a start error, probed now, before the models load:
    the HTTP port (nothing serves without it) and a `grpc_port` the config names. PortUnavailable names the key."""
    ports = plan_ports(config)
    try:
        check_free(config.host, config.port)
    except PortBusy as exc:
        raise PortUnavailable(f"agent config port: {exc}; free it or choose another") from None
    if ports.grpc is not None and ports.grpc_explicit:
        try:
            check_free(config.host, ports.grpc)
        except PortBusy as exc:
            raise PortUnavailable(f"agent config grpc_port: {exc}; free it or choose another") from None
    return ports


def check_free(host: str, port: int) -> None:
    """PortBusy when something listens on `host:port` (probed with a plain socket, as the servers bind: so that gRPC's
    own failure, which it logs at length, is not the first word on it). Port 0 (any free one) is always free."""
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


def connect_host(host: str) -> str:
    """Where a listener bound on `host` is reached from this machine (a wildcard address: loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 (reading, not binding)


class SidePorts:
    """The gRPC server and the legacy listener of one agent: bound before the app starts (so that a busy port the
    config names is a start error, before anything is served), started once it has, drained with the HTTP side."""

    def __init__(self, ports: Ports, app: InferenceApp, *, max_body_bytes: int) -> None:
        self.ports = ports
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.grpc: GrpcEndpoint | None = None
        self.legacy: LegacyPort | None = None
        self.grpc_port: int | None = None  # where the gRPC server itself listens

    async def bind(self, http_port: int) -> None:
        """Bind the gRPC port and the legacy port (PortUnavailable for a busy port the config names); `http_port`:
        the configured HTTP port, for the log lines."""
        ports = self.ports
        sniffed = self._sniffed()  # gRPC clients reach it through the legacy port
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
        from edge_agent.serving.grpc_server import GrpcEndpoint

        endpoint = GrpcEndpoint(self.app, max_body_bytes=self.max_body_bytes)
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
