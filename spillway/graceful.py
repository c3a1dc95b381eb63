"""A uvicorn server that stops without cutting a request: it closes its listener first (serving what the kernel had
already queued on it), then each connection only between two requests.

uvicorn's own shutdown closes every idle keep-alive connection at once and a connection whose next request is half
read (its headers not complete) with it, so a client that sent a request at that moment gets no answer at all. Here:

1. `close_listeners`: new connections are refused from now on; the connections the kernel had completed but nobody had
   accepted yet (the backlog) are accepted and served instead of being reset when the socket closes.
2. `quiesce`: a request in flight is answered with `Connection: close`; a request that arrives on a kept-alive
   connection is answered the same way; an idle connection is closed only when it has been quiet (nothing received
   since its last answer) for `quiet_s`, which is the keep-alive timeout every HTTP/1.1 client must already expect.
3. uvicorn's shutdown then finds nothing left to cut, waits for the tasks and runs the lifespan shutdown.

A second signal skips the wait (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("uvicorn.error")  # the server's own log, configured wherever uvicorn runs

QUIET_S = 2.0  # an idle keep-alive connection is closed after this long without a byte from its client
POLL_S = 0.02


class GracefulHttpProtocol(HttpToolsProtocol):
    """httptools' HTTP/1.1 protocol that knows whether it is between two requests, and closes only then."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closing = False
        # A request has begun (its first byte parsed) whose headers are not complete: not between requests.
        self._partial = False
        self.quiet_since = time.monotonic()  # since the last answer: any byte after it begins a request

    def on_message_begin(self) -> None:
        self._partial = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._partial = False
        super().on_headers_complete()
        if self.closing and self.cycle is not None:
            self.cycle.keep_alive = False  # answered with `Connection: close`, then closed

    def on_response_complete(self) -> None:
        self.quiet_since = time.monotonic()
        super().on_response_complete()

    @property
    def between_requests(self) -> bool:
        return not self._partial and not self.pipeline and (self.cycle is None or self.cycle.response_complete)

    def close_when_quiet(self, quiet_s: float, now: float) -> bool:
        """Ask this connection to close; True once it is closed or closing."""
        self.closing = True
        if self.transport.is_closing():
            return True
        if not self.between_requests:
            # A response whose headers went out without `Connection: close` is finished first; its client may then
            # send again, which the next call answers with `Connection: close`.
            if self.cycle is not None and not self.cycle.response_started:
                self.cycle.keep_alive = False
            return False
        if now - self.quiet_since < quiet_s:
            return False
        self.transport.close()
        return True

    def shutdown(self) -> None:
        """uvicorn's shutdown: after `quiesce`, or at once on a forced exit."""
        self.closing = True
        if self.between_requests:
            self.transport.close()
        elif self.cycle is not None and not self.cycle.response_started:
            self.cycle.keep_alive = False


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a shutdown that answers every request it read (see the module docstring).

    Subclasses override `before_close` for what must happen while the listener still accepts (the agent answers
    503 `draining` and empties its queues there)."""

    def __init__(self, config: uvicorn.Config, *, quiet_s: float = QUIET_S, close_timeout_s: float = 30.0) -> None:
        config.http = GracefulHttpProtocol
        super().__init__(config)
        self.quiet_s = quiet_s
        self.close_timeout_s = close_timeout_s
        self._closing: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._closing is not None or not self.started:  # a second signal, or one before start: uvicorn's way
            super().handle_exit(sig, frame)
            return
        self._closing = asyncio.get_event_loop().create_task(self._close())

    async def before_close(self) -> None:
        """What to do while new connections are still accepted; nothing by default."""

    async def _close(self) -> None:
        try:
            await self.before_close()
            await self.close_listeners()
            await self.quiesce(time.monotonic() + self.close_timeout_s)
        except Exception:  # never keep the process from exiting
            log.exception("graceful close failed; closing now")
        self.should_exit = True

    async def close_listeners(self) -> None:
        """Refuse new connections from now on; serve the ones the kernel had already queued."""
        loop = asyncio.get_running_loop()
        held: list[socket.socket] = []
        for server in self.servers:
            for listener in server.sockets or ():
                # A duplicate keeps the socket listening while the loop lets go of it, so nothing queued is reset.
                held.append(socket.socket(fileno=os.dup(listener.fileno())))
            server.close()
        protocol: Any = self.config.http_protocol_class  # uvicorn's protocols take these keywords
        factory = functools.partial(protocol, config=self.config, server_state=self.server_state,
                                    app_state=self.lifespan.state)  # fmt: skip
        accepted = 0
        for sock in held:
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:  # BlockingIOError: nothing (more) is queued
                    break
                conn.setblocking(False)
                with contextlib.suppress(OSError):
                    await loop.connect_accepted_socket(factory, conn, ssl=self.config.ssl)
                    accepted += 1
            sock.close()
        log.info("listener closed%s", f"; {accepted} queued connection(s) accepted" if accepted else "")

    async def quiesce(self, deadline: float) -> None:
        """Close every connection between two requests, each once its client has been quiet for `quiet_s`."""
        while True:
            now = time.monotonic()
            open_ = [
                c
                for c in list(self.server_state.connections)
                if not (isinstance(c, GracefulHttpProtocol) and c.close_when_quiet(self.quiet_s, now))
            ]
            if not open_:
                return
            if now >= deadline:
                log.warning("closing %d connection(s) still open after %.0f s", len(open_), self.close_timeout_s)
                return
            await asyncio.sleep(POLL_S)
