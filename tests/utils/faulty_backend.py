"""A V2 inference server that fails on command, for the gateway's tests: `python -m tests.utils.faulty_backend
--port N [--name NAME]`.

It answers `POST /v2/models/{m}/infer` with a small, correctly shaped JSON response, and the readiness endpoints,
until told otherwise through `POST /control` with a JSON object:
  {"mode": "ok"}                          answer normally
  {"mode": "status", "status": 503}       answer that status (a JSON error body)
  {"mode": "hang"}                        read the request and never answer
  {"mode": "reset"}                       read the request and close the connection without a word
  {"mode": "slow", "delay_ms": 300}       answer normally after a delay
  {"mode": "trickle", "delay_ms": 300}    send the status line and half the body, the rest after the delay
  {"mode": "cut"}                         send the status line and half the body, then close the connection
  {"mode": "garbage"}                     answer 200 with a body that is not a V2 response
  {"ready": false}                        readiness endpoints answer 503 (independent of the mode)
`GET /stats` counts what came: infer requests, readiness checks, and the last infer request's headers.
It is plain asyncio on purpose: a `reset` needs the socket itself, which no ASGI server hands over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any


class FaultyBackend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.status = 503
        self.delay_ms = 0.0
        self.ready = True
        self.infer = 0
        self.checks = 0
        self.last_headers: dict[str, str] = {}
        self.last_body = b""

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self.answer(method, path, headers, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Write the answer; False: the connection is to be closed (or was)."""
        if method == "POST" and path == "/control":
            change = json.loads(body or b"{}")
            self.mode = change.get("mode", self.mode)
            self.status = int(change.get("status", self.status))
            self.delay_ms = float(change.get("delay_ms", self.delay_ms))
            self.ready = bool(change.get("ready", self.ready))
            return await self.send(writer, 200, {"mode": self.mode, "ready": self.ready})
        if method == "GET" and path == "/stats":
            stats = {"infer": self.infer, "checks": self.checks, "last_headers": self.last_headers,
                     "last_body_bytes": len(self.last_body)}  # fmt: skip
            return await self.send(writer, 200, stats)
        readiness = path == "/v2/health/ready" or (path.startswith("/v2/models/") and path.endswith("/ready"))
        if method == "GET" and readiness:
            self.checks += 1
            return await self.send(writer, 200 if self.ready else 503, {"ready": self.ready})
        if method == "POST" and path.startswith("/v2/models/") and path.endswith("/infer"):
            self.infer += 1
            self.last_headers, self.last_body = headers, body
            model = path.split("/")[3]
            if self.mode == "hang":
                await asyncio.Event().wait()
            if self.mode == "reset":
                writer.transport.abort()
                return False
            if self.mode == "status":
                return await self.send(writer, self.status, {"error": f"injected {self.status} by {self.name}"})
            if self.mode == "slow":
                await asyncio.sleep(self.delay_ms / 1000)
            if self.mode == "garbage":
                return await self.send(writer, 200, {"model_name": model, "outputs": "none today"})
            output = {"name": "output", "datatype": "FP32", "shape": [1, 4], "data": [0.0, 1.0, 2.0, 3.0]}
            answer = {"model_name": model, "model_version": "1", "id": self.name, "outputs": [output]}
            if self.mode in ("trickle", "cut"):
                answer["padding"] = "x" * 200_000  # big enough to be more than one chunk
                payload = json.dumps(answer).encode()
                half = len(payload) // 2
                writer.write(self.head(200, len(payload)) + payload[:half])
                await writer.drain()
                if self.mode == "cut":
                    writer.transport.abort()
                    return False
                await asyncio.sleep(self.delay_ms / 1000)
                writer.write(payload[half:])
                await writer.drain()
                return True
            return await self.send(writer, 200, answer)
        return await self.send(writer, 404, {"error": f"no such endpoint: {method} {path}"})

    @staticmethod
    def head(status: int, length: int) -> bytes:
        return f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n".encode()

    async def send(self, writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> bool:
        payload = json.dumps(body).encode()
        writer.write(self.head(status, len(payload)) + payload)
        await writer.drain()
        return True


async def main(port: int, name: str) -> None:
    backend = FaultyBackend(name)
    server = await asyncio.start_server(backend.connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="faulty")
    args = parser.parse_args()
    asyncio.run(main(args.port, args.name))
