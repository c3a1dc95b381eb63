"""The V2 path's HTTP/1.1 client (controlplane/gateway/upstream.py) against a scripted asyncio server on loopback:
what it sends, keep-alive reuse, the framings of an answer, back-pressure, the connection cap and its errors. The
gateway's behaviour over it (retries, ejection, cut-off answers) is in test_gateway.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from controlplane.gateway.upstream import (
    Origin,
    UpstreamConnect,
    UpstreamReset,
    Upstreams,
    UpstreamTimeout,
)

Script = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def ok(body: bytes = b'{"outputs":[]}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)  # fmt: skip


@dataclass
class Scripted:
    """A server whose every answer is `script(request head + body, reader, writer)` (False: close)."""

    script: Script
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))  # fmt: skip
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.script(request, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def answering(*answers: bytes, keep: bool = True) -> Script:
    async def script(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        for piece in answers:
            writer.write(piece)
            await writer.drain()
        return keep

    return script


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_sends_one_request_with_host_and_length_and_reuses_the_connection() -> None:
    async def main() -> None:
        async with Scripted(answering(ok())) as server:
            upstreams = Upstreams()
            for _ in range(3):
                answer = await upstreams.post(server.url, "/v2/models/m/infer", {"Authorization": "Bearer s"},
                                              b'{"inputs":[]}', 5.0)  # fmt: skip
                assert answer.status == 200 and answer.header(b"content-type") == b"application/json"
                assert await answer.read() == b'{"outputs":[]}'
                answer.release()
            assert server.connections == 1 and upstreams.open_connections == 1
            port = server.url.rsplit(":", 1)[1]
            assert server.requests[0] == (
                b"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode()
                + b"\r\nContent-Length: 13\r\nAuthorization: Bearer s\r\n\r\n" + b'{"inputs":[]}'
            )  # fmt: skip
            await upstreams.close()
            assert upstreams.open_connections == 0

    run(main())


def test_a_connection_the_backend_closed_while_idle_is_not_used_again() -> None:
    async def main() -> None:
        async with Scripted(answering(ok(), keep=False)) as server:  # closes after each answer
            upstreams = Upstreams()
            for _ in range(3):
                answer = await upstreams.post(server.url, "/x", {}, b"{}", 5.0)
                assert await answer.read() == b'{"outputs":[]}'
                answer.release()
                await asyncio.sleep(0.05)  # the close arrives
            assert server.connections == 3

    run(main())


def test_connection_close_in_the_answer_is_honoured() -> None:
    async def main() -> None:
        async with Scripted(answering(ok(extra=b"connection: close\r\n"))) as server:
            upstreams = Upstreams()
            for _ in range(2):
                answer = await upstreams.post(server.url, "/x", {}, b"{}", 5.0)
                await answer.read()
                answer.release()
            assert server.connections == 2 and upstreams.open_connections == 0

    run(main())


def test_chunked_and_connection_delimited_bodies_arrive_whole() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"

    async def main() -> None:  # fmt: skip
        async with Scripted(answering(chunked, b"6\r\n world\r\n0\r\n\r\n")) as server:
            upstreams = Upstreams()
            answer = await upstreams.post(server.url, "/x", {}, b"{}", 5.0)
            pieces = [piece async for piece in answer.chunks_as_they_come()]
            assert b"".join(pieces) == b"hello world" and answer.complete
            answer.release()
            assert upstreams.open_connections == 1  # a chunked answer keeps the connection
        async with Scripted(answering(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", keep=False)) as server:
            answer = await upstreams.post(server.url, "/x", {}, b"{}", 5.0)
            assert await answer.read() == b"until the end"
            answer.release()

    run(main())


def test_a_large_body_goes_whole_and_a_large_answer_is_read_with_back_pressure() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB

    async def echo(request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        body = request.split(b"\r\n\r\n", 1)[1]
        writer.write(ok(body))
        await writer.drain()
        return True

    async def main() -> None:
        async with Scripted(echo) as server:
            upstreams = Upstreams()
            answer = await upstreams.post(server.url, "/x", {}, big, 5.0)
            received = b""
            async for piece in answer.chunks_as_they_come():
                received += piece
                await asyncio.sleep(0.001)  # a slow client: reading pauses above the high-water mark
            assert received == big
            answer.release()
            assert upstreams.open_connections == 1

    run(main())


def test_errors_are_connect_reset_timeout() -> None:
    async def hang(_request: bytes, _reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    async def main() -> None:
        upstreams = Upstreams()
        async with Scripted(answering(ok())) as server:
            closed = server.url
        with pytest.raises(UpstreamConnect):
            await upstreams.post(closed, "/x", {}, b"{}", 2.0)
        async with Scripted(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", keep=False)) as server:
            answer = await upstreams.post(server.url, "/x", {}, b"{}", 2.0)
            with pytest.raises(UpstreamReset):
                await answer.read()
            answer.release()
        async with Scripted(answering(b"SSH-2.0-not http\r\n\r\n")) as server:
            with pytest.raises(UpstreamReset):
                await upstreams.post(server.url, "/x", {}, b"{}", 2.0)
        async with Scripted(hang) as server:
            began = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout):
                await upstreams.post(server.url, "/x", {}, b"{}", 0.2)
            assert asyncio.get_running_loop().time() - began < 1.0
        assert upstreams.open_connections == 0  # nothing failed is kept
        with pytest.raises(ValueError, match="line break"):
            await upstreams.post(closed, "/x", {"X-Evil": "a\r\nb: c"}, b"{}", 1.0)

    run(main())


def test_beyond_max_connections_a_request_waits_for_one() -> None:
    async def slow(_request: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.1)
        writer.write(ok())
        await writer.drain()
        return True

    async def main() -> None:
        async with Scripted(slow) as server:
            upstreams = Upstreams(max_connections=2)

            async def one() -> bytes:
                answer = await upstreams.post(server.url, "/x", {}, b"{}", 5.0)
                try:
                    return await answer.read()
                finally:
                    answer.release()

            assert await asyncio.gather(*(one() for _ in range(6))) == [b'{"outputs":[]}'] * 6
            assert server.connections == 2
            blocked = Upstreams(max_connections=1)
            held = await blocked.post(server.url, "/x", {}, b"{}", 5.0)
            with pytest.raises(UpstreamTimeout, match="no connection"):
                await blocked.post(server.url, "/x", {}, b"{}", 0.2)
            held.release()

    run(main())


def test_origin_keeps_a_path_prefix_and_names_the_host() -> None:
    origin = Origin.parse("https://cloud.example:8443/triton/")
    assert (origin.host, origin.port, origin.tls, origin.prefix) == ("cloud.example", 8443, True, "/triton")
    assert origin.host_header == b"cloud.example:8443"
    assert Origin.parse("http://[::1]:80").host_header == b"[::1]"
    with pytest.raises(ValueError):
        Origin.parse("grpc://host:1")
