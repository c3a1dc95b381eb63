"""The pre-0.2 HTTP port (legacy_port.py) and the ports beside HTTP (ports.py), on ephemeral loopback ports: a
connection is spliced by its first bytes to the HTTP server or the gRPC server; busy, missing and clashing ports follow
the decision (a default one is a warning, one the config names a start error)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from edge_agent.config import AgentConfig
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.legacy_port import LEGACY_HTTP_PORT, LegacyPort
from edge_agent.serving.models import ModelRegistry
from edge_agent.serving.ports import Ports, PortUnavailable, SidePorts, check_ports, plan_ports
from tests.utils.server import free_port, serving

WAIT_S = 30


@pytest.fixture(scope="module")
def app() -> InferenceApp:
    return InferenceApp(ModelRegistry([]))


@pytest.fixture(scope="module")
def http_port(app: InferenceApp) -> Iterator[int]:
    """The agent's app on a real uvicorn server (its own thread and loop), as the HTTP port."""
    with serving(app) as url:  # type: ignore[arg-type]
        yield int(url.rsplit(":", 1)[1])


def _run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


def test_the_legacy_port_splices_http_to_the_http_port_and_grpc_to_the_grpc_server(
    app: InferenceApp, http_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    from edge_agent.serving.grpc_server import GrpcEndpoint

    async def scenario() -> tuple[int, list[int], bool, bool]:
        endpoint = GrpcEndpoint(app, max_body_bytes=1 << 20)
        grpc_port = endpoint.bind("127.0.0.1", 0)
        await endpoint.start()
        legacy = LegacyPort()
        port = await legacy.bind("127.0.0.1", 0)
        await legacy.start(("127.0.0.1", http_port), ("127.0.0.1", grpc_port))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client:
                answers = [(await client.get("/v2/health/live")).status_code for _ in range(2)]  # one connection
                answers.append((await client.post("/v2/models/nope/infer", json={})).status_code)
            grpc = triton.InferenceServerClient(f"127.0.0.1:{port}")
            live = await asyncio.to_thread(grpc.is_server_live, client_timeout=WAIT_S)
            ready = await asyncio.to_thread(grpc.is_model_ready, "nope", client_timeout=WAIT_S)
            return port, answers, live, ready
        finally:
            await legacy.close(1.0)
            await endpoint.stop(None)

    with caplog.at_level(logging.WARNING, logger="spillway.agent"):
        port, answers, live, ready = _run(scenario)
    assert answers == [200, 200, 404]
    assert live and not ready
    deprecated = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert deprecated == [f"HTTP on port {port} is deprecated since 0.2: use {http_port}"]  # once


def test_without_grpc_a_grpc_client_is_refused_and_a_silent_connection_is_closed(http_port: int) -> None:
    async def scenario() -> tuple[str, bytes]:
        legacy = LegacyPort(sniff_timeout_s=0.2)
        port = await legacy.bind("127.0.0.1", 0)
        await legacy.start(("127.0.0.1", http_port), None)
        try:
            grpc = triton.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                await asyncio.to_thread(grpc.is_server_live, client_timeout=WAIT_S)
                refused = "served"
            except InferenceServerException as exc:
                refused = str(exc.status())
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            closed = await reader.read()  # it says nothing: closed once the sniffing times out
            writer.close()
            return refused, closed
        finally:
            await legacy.close(1.0)

    refused, closed = _run(scenario)
    assert refused == "StatusCode.UNAVAILABLE" and closed == b""


def test_a_half_closed_client_still_gets_its_answer(http_port: int) -> None:
    async def scenario() -> bytes:
        legacy = LegacyPort()
        port = await legacy.bind("127.0.0.1", 0)
        await legacy.start(("127.0.0.1", http_port), None)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.write_eof()
            answer = await reader.read()
            writer.close()
            return answer
        finally:
            await legacy.close(1.0)

    answer = _run(scenario)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"live": true}')


# ---- which ports -----------------------------------------------------------------------------------------------------


def test_plan_ports_keeps_the_old_http_port_only_for_configs_that_set_no_port(tmp_path: Path) -> None:
    default = plan_ports(AgentConfig(model_repository=tmp_path))
    assert default == Ports("127.0.0.1", 8001, False, LEGACY_HTTP_PORT)
    named = plan_ports(AgentConfig(model_repository=tmp_path, port=9000, grpc_port=9001))
    assert named == Ports("127.0.0.1", 9001, True, None)
    assert plan_ports(AgentConfig(model_repository=tmp_path, port=9000, grpc_port=None)).grpc is None


def test_a_grpc_port_equal_to_the_http_port_is_off_when_defaulted_and_a_start_error_when_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`port: 8001` (the pre-0.2 default, written out) with grpc_port left at its default (8001): HTTP keeps the port,
    gRPC is off with one warning. Both named and equal, or a grpc_port named equal to the default HTTP port: refused."""
    with caplog.at_level(logging.INFO, logger="spillway.agent"):
        ports = plan_ports(AgentConfig(model_repository=tmp_path, port=8001))
    assert ports == Ports("127.0.0.1", None, False, None)
    assert [r.getMessage() for r in caplog.records] == [
        "gRPC off: port 8001 is the HTTP port; set grpc_port to serve gRPC"
    ]
    for settings in ({"port": 9000, "grpc_port": 9000}, {"grpc_port": 8000}):
        with pytest.raises(PortUnavailable, match=r"grpc_port: \d+ is also the HTTP port"):
            plan_ports(AgentConfig(model_repository=tmp_path, **settings))
    # Both port 0: two free ports, never the same one.
    assert plan_ports(AgentConfig(model_repository=tmp_path, port=0, grpc_port=0)).grpc == 0


def test_check_ports_refuses_a_busy_http_port_or_named_grpc_port_and_lets_a_default_one_be(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"agent config port: port {busy} on 127.0.0.1 is busy"):
            check_ports(AgentConfig(model_repository=tmp_path, port=busy, grpc_port=None))
        with pytest.raises(PortUnavailable, match=f"agent config grpc_port: port {busy} on 127.0.0.1 is busy"):
            check_ports(AgentConfig(model_repository=tmp_path, port=0, grpc_port=busy))
        # The default gRPC port is not probed here: busy, it is a warning when the agent binds (SidePorts).
        assert check_ports(AgentConfig(model_repository=tmp_path, port=free_port())).grpc_explicit is False


def test_without_grpcio_a_default_grpc_port_is_a_log_line_and_a_named_one_a_start_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # as if grpcio were not installed
    with caplog.at_level(logging.INFO, logger="spillway.agent"):
        ports = plan_ports(AgentConfig(model_repository=tmp_path))
    assert ports.grpc is None and ports.legacy == LEGACY_HTTP_PORT  # HTTP on 8000, and on 8001 for old clients
    assert [r.getMessage() for r in caplog.records] == ["gRPC off: pip install 'spillway[grpc]'"]
    with pytest.raises(PortUnavailable, match=r"grpc_port: 9001 needs gRPC support: pip install 'spillway\[grpc\]'"):
        plan_ports(AgentConfig(model_repository=tmp_path, grpc_port=9001))


def _side(app: InferenceApp, grpc: int, explicit: bool, legacy: int | None = None) -> SidePorts:
    return SidePorts(Ports("127.0.0.1", grpc, explicit, legacy), app, max_body_bytes=1 << 20)


def test_a_busy_default_grpc_port_is_a_warning_and_a_named_one_a_start_error(
    app: InferenceApp, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(side: SidePorts) -> SidePorts:
        await side.bind(8000)
        await side.close()
        return side

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="spillway.agent"):
            side = _run(lambda: scenario(_side(app, busy, explicit=False)))
        assert side.grpc is None
        assert [r.getMessage() for r in caplog.records if "gRPC off" in r.getMessage()] != []
        with pytest.raises(PortUnavailable, match=f"grpc_port: port {busy} on 127.0.0.1 is busy"):
            _run(lambda: scenario(_side(app, busy, explicit=True)))
        # gRPC reached through the legacy port, which is busy: the same rules.
        side = _run(lambda: scenario(_side(app, busy, explicit=False, legacy=busy)))
        assert side.grpc is None and side.legacy is None
        with pytest.raises(PortUnavailable, match=f"grpc_port: port {busy}"):
            _run(lambda: scenario(_side(app, busy, explicit=True, legacy=busy)))


def test_grpc_behind_the_legacy_port_listens_on_loopback_only(app: InferenceApp, http_port: int) -> None:
    legacy_port = free_port()

    async def scenario() -> tuple[int | None, bool]:
        side = _side(app, legacy_port, explicit=False, legacy=legacy_port)
        await side.bind(http_port)
        await side.start(http_port)
        try:
            grpc = triton.InferenceServerClient(f"127.0.0.1:{legacy_port}")
            return side.grpc_port, await asyncio.to_thread(grpc.is_server_live, client_timeout=WAIT_S)
        finally:
            await side.close()

    internal, live = _run(scenario)
    assert live and internal not in (None, legacy_port)
