"""Keep-alive clients that record the fate of every request they send, for the shutdown tests: each client keeps one
connection while the server allows it, opens a new one when the server closes it, and stops when a connection is
refused (the listener is closed). A request that was sent and got no answer is a `lost` one."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Fates:
    answers: Counter[tuple[int, str]] = field(default_factory=Counter)  # (status, reason or "") -> count
    lost: list[str] = field(default_factory=list)  # sent, no answer: what the client saw
    refused: int = 0  # clients that stopped on a refused connection
    closing: Counter[str] = field(default_factory=Counter)  # the Connection header of the 503 `draining` answers

    @property
    def answered(self) -> int:
        return sum(self.answers.values())

    def count(self, status: int) -> int:
        return sum(n for (code, _), n in self.answers.items() if code == status)


class KeepAliveLoad:
    """`clients` concurrent keep-alive clients POSTing `body` to `url` in a thread of their own, until each is refused
    a connection or `max_s` passes; `wait_answers(n)` blocks until n answers came back."""

    def __init__(self, url: str, body: bytes, *, clients: int = 16, headers: dict[str, str] | None = None,
                 max_s: float = 90.0) -> None:  # fmt: skip
        self.url, self.body, self.clients, self.max_s = url, body, clients, max_s
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.fates = Fates()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> KeepAliveLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()

    def join(self, timeout: float | None = None) -> Fates:
        self._thread.join(self.max_s + 30 if timeout is None else timeout)
        assert not self._thread.is_alive(), "the clients did not stop"
        return self.fates

    def wait_answers(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.fates.answered < n:
            assert time.monotonic() < deadline, f"only {self.fates.answered} answers in {timeout:.0f} s"
            assert self._thread.is_alive(), f"the clients stopped early: {self.fates}"
            time.sleep(0.02)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.clients)))

    async def _client(self) -> None:
        end = time.monotonic() + self.max_s
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=1, force_close=False)  # one keep-alive connection at a time
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while time.monotonic() < end:
                try:
                    async with session.post(self.url, data=self.body, headers=self.headers) as response:
                        body = await response.read()
                        status, connection = response.status, response.headers.get("connection", "")
                except aiohttp.ClientConnectorError:  # refused: the listener is closed, nothing was sent
                    with self._lock:
                        self.fates.refused += 1
                    return
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    with self._lock:
                        self.fates.lost.append(repr(exc))
                    return
                reason = ""
                if status == 503:
                    try:
                        reason = str(json.loads(body).get("reason", ""))
                    except (ValueError, AttributeError):
                        reason = "(not JSON)"
                with self._lock:
                    self.fates.answers[(status, reason)] += 1
                    if reason == "draining":
                        self.fates.closing[connection.lower()] += 1
