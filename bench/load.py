"""Open-loop (fixed-rate) HTTP/1.1 load for the benchmarks, and a no-op server to measure the client's ceiling.

Closed-loop throughput is wrk's job (see `batching.py`); this client sends requests at a fixed rate whatever
the server does, so queueing shows up as latency instead of as a slower client. Latency is measured from the
moment a request was *due* (not when it was sent), so a client or a connection pool that falls behind is
counted against the server rather than hidden (no coordinated omission).

It is a plain asyncio Protocol over keep-alive connections (uvloop when installed), not httpx: httpx spends
about 1 ms of CPU per request, which on a 2-core machine takes a large share of the server's CPU at a few
hundred requests per second; this client spends a few tens of microseconds. `ceiling` measures what it
sustains against `noop`, a server that answers every request at once.

    python bench/load.py open --url http://127.0.0.1:8001/v2/models/mlp/infer --body body.json --rate 300
    python bench/load.py ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `bench` from the repository
from bench.common import free_port, percentile
from spillway.demo.harness import Process


def _event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ---- client ---------------------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    keep_body = False  # a subclass whose `result` reads the body (in `self.body`) says so; the load needs none

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Any] | None = None
        self.closed = False
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is not None:
            self._complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def _complete(self) -> None:
        head = self._take()
        if head is None:
            return
        waiter, self.waiter = self.waiter, None
        assert waiter is not None
        if not waiter.done():
            waiter.set_result(self.result(head))

    def result(self, head: bytes) -> Any:
        """What `send`'s future gives for a whole response, from its lower-cased head: here the status."""
        return int(head[9:12])

    def _take(self) -> bytes | None:
        """The lower-cased head of the first response once it is whole (removed from the buffer), else None."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).lower()
        marker = head.find(b"\r\ncontent-length:")
        if marker >= 0:
            stop = head.find(b"\r\n", marker + 2)
            total = end + 4 + int(head[marker + 17 : stop if stop >= 0 else len(head)])
        elif b"transfer-encoding: chunked" in head:
            terminator = self.buffer.find(b"0\r\n\r\n", end + 4)
            if terminator < 0:
                return None
            total = terminator + 5
        else:
            total = end + 4  # no body (e.g. 204)
        if len(self.buffer) < total:
            return None
        if self.keep_body:
            self.body = bytes(self.buffer[end + 4 : total])
        del self.buffer[:total]
        return head

    def send(self, payload: bytes) -> asyncio.Future[Any]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self.waiter


def build_request(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    merged = {"Content-Type": "application/json", **(headers or {})}
    lines += [f"{k}: {v}" for k, v in merged.items()]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class OpenLoopResult:
    rate: float  # offered requests per second
    duration_s: float  # the measured window (after warm-up)
    sent: int  # requests due within the measured window
    ok: int  # 2xx among them
    non_2xx: int
    conn_errors: int
    unfinished: int  # still unanswered when the drain timeout ended
    throughput_rps: float  # 2xx answers to requests due in the window, per second of window
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    max_send_lag_ms: float  # how late the client sent a request after it was due (its own saturation)
    p99_send_lag_ms: float | None
    max_connections: int
    client_cpu_s: float
    client_cpu_us_per_request: float
    status_counts: dict[str, int] = field(default_factory=dict)


async def open_loop(
    url: str,
    body: bytes,
    rate: float,
    duration_s: float,
    warmup_s: float = 2.0,
    *,
    headers: dict[str, str] | None = None,
    max_connections: int = 256,
    drain_s: float = 10.0,
) -> OpenLoopResult:
    """Send requests due at start + i/rate for warm-up + duration; measure those due after the warm-up."""
    loop = asyncio.get_running_loop()
    clock = time.perf_counter  # uvloop's loop.time() has only millisecond resolution
    host, port, payload = build_request(url, body, headers)
    free: list[_Connection] = []
    waiters: collections.deque[asyncio.Future[_Connection]] = collections.deque()
    opened = 0
    peak = 0
    latencies: list[float] = []
    statuses: collections.Counter[str] = collections.Counter()
    conn_errors = 0
    max_lag = 0.0
    lags: list[float] = []
    cpu_start = time.process_time()
    start = clock() + 0.05
    total = int((warmup_s + duration_s) * rate)
    first_measured = int(warmup_s * rate)

    async def acquire() -> _Connection:
        nonlocal opened, peak
        while free:
            conn = free.pop()
            if not conn.closed:
                return conn
            opened -= 1
        if opened < max_connections:
            opened += 1
            peak = max(peak, opened)
            try:
                _, conn = await loop.create_connection(_Connection, host, port)
            except OSError:
                opened -= 1
                raise
            return conn
        waiter: asyncio.Future[_Connection] = loop.create_future()
        waiters.append(waiter)
        return await waiter

    def release(conn: _Connection) -> None:
        nonlocal opened
        if conn.closed:
            opened -= 1
            return
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        free.append(conn)

    async def one(due: float, measured: bool) -> None:
        nonlocal conn_errors, max_lag, opened
        sent_at = clock()
        lag = sent_at - due
        max_lag = max(max_lag, lag)
        if measured:
            lags.append(lag)
        try:
            conn = await acquire()
        except OSError:
            if measured:
                conn_errors += 1
            return
        try:
            status = await conn.send(payload)
        except (ConnectionError, RuntimeError):
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
            release(conn)
            if measured:
                conn_errors += 1
            return
        release(conn)
        if measured:
            statuses[str(status)] += 1
            if 200 <= status < 300:
                latencies.append(clock() - sent_at)

    tasks: set[asyncio.Task[None]] = set()
    i = 0
    while i < total:
        now = clock()
        due = start + i / rate
        if due > now:
            # Event-loop timers tick in whole milliseconds: a shorter sleep would spin the CPU instead.
            await asyncio.sleep(max(due - now, 0.001))
            continue
        while i < total and start + i / rate <= now:
            task = loop.create_task(one(start + i / rate, i >= first_measured))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
    unfinished = 0
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
        unfinished = len(pending)
        for task in pending:
            task.cancel()
    for conn in free:
        if conn.transport is not None:
            conn.transport.close()
    cpu = time.process_time() - cpu_start
    ok = sum(n for s, n in statuses.items() if s.startswith("2"))

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    return OpenLoopResult(
        rate, duration_s, sent=total - first_measured, ok=ok, non_2xx=sum(statuses.values()) - ok,
        conn_errors=conn_errors, unfinished=unfinished, throughput_rps=round(ok / duration_s, 1),
        p50_ms=ms(percentile(latencies, 50)), p90_ms=ms(percentile(latencies, 90)),
        p99_ms=ms(percentile(latencies, 99)), max_ms=ms(max(latencies, default=None)),
        max_send_lag_ms=round(max_lag * 1e3, 3), p99_send_lag_ms=ms(percentile(lags, 99)), max_connections=peak,
        client_cpu_s=round(cpu, 3), client_cpu_us_per_request=round(cpu / max(1, total) * 1e6, 1),
        status_counts=dict(statuses),
    )  # fmt: skip


# ---- no-op server ---------------------------------------------------------------------------------

_NOOP_BODY = b'{"outputs":[]}'
_NOOP_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_NOOP_BODY)).encode()
    + b"\r\n\r\n"
    + _NOOP_BODY
)


class _NoopProtocol(asyncio.Protocol):
    """Answers every request (Content-Length bodies only) with a fixed 200 at once."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            marker = head.find(b"\r\ncontent-length:")
            length = 0
            if marker >= 0:
                stop = head.find(b"\r\n", marker + 2)
                length = int(head[marker + 17 : stop if stop >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            del self.buffer[:total]
            assert self.transport is not None
            self.transport.write(_NOOP_RESPONSE)


async def serve_noop(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_NoopProtocol, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def start_noop_server(port: int) -> Process:
    """The no-op server in its own process (so that it does not share the client's GIL), listening; stop it
    (`with start_noop_server(port):`, or `.stop()`)."""
    command = [sys.executable, str(Path(__file__).resolve()), "noop", "--port", str(port)]
    server = Process.start(command, name="the no-op server", log=subprocess.DEVNULL, grace_s=10)
    try:
        server.wait_listening(port, timeout_s=10)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


# ---- command line ---------------------------------------------------------------------------------


def _run_open(args: argparse.Namespace) -> None:
    body = Path(args.body).read_bytes()
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    _event_loop_policy()
    run = open_loop(
        args.url, body, args.rate, args.duration, args.warmup,
        headers=headers, max_connections=args.max_connections, drain_s=args.drain,
    )  # fmt: skip
    result = asyncio.run(run)
    print(json.dumps(asdict(result)))


def ceiling(rates: list[float], duration_s: float, body: bytes) -> list[OpenLoopResult]:
    """Run the client against the no-op server at each rate (each run in a fresh client process)."""
    port = free_port()
    with start_noop_server(port):
        return [run_open_subprocess(f"http://127.0.0.1:{port}/noop", body, rate, duration_s, 1.0) for rate in rates]


def run_open_subprocess(
    url: str, body: bytes | Path, rate: float, duration_s: float, warmup_s: float, headers: dict[str, str] | None = None
) -> OpenLoopResult:
    """One open-loop run in a fresh process (the caller's process stays out of the measurement)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = body if isinstance(body, Path) else Path(tmp) / "body"
        if not isinstance(body, Path):
            path.write_bytes(body)
        cmd = [sys.executable, str(Path(__file__).resolve()), "open", "--url", url, "--body", str(path),
               "--rate", str(rate), "--duration", str(duration_s), "--warmup", str(warmup_s)]  # fmt: skip
        for key, value in (headers or {}).items():
            cmd += ["--header", f"{key}: {value}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return OpenLoopResult(**json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("open", help="fixed-rate load; prints one JSON line")
    run.add_argument("--url", required=True)
    run.add_argument("--body", required=True, help="file with the request body")
    run.add_argument("--header", action="append", default=[], help="extra header 'Name: value'")
    run.add_argument("--rate", type=float, required=True, help="requests per second")
    run.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    run.add_argument("--warmup", type=float, default=2.0, help="seconds at the same rate before measuring")
    run.add_argument("--max-connections", type=int, default=256)
    run.add_argument("--drain", type=float, default=10.0, help="seconds to wait for the last answers")
    noop = sub.add_parser("noop", help="serve fixed 200 answers (to measure the client)")
    noop.add_argument("--host", default="127.0.0.1")
    noop.add_argument("--port", type=int, required=True)
    ceil = sub.add_parser("ceiling", help="the client's own ceiling against the no-op server")
    ceil.add_argument("--rates", default="500,1000,2000,4000,8000")
    ceil.add_argument("--duration", type=float, default=5.0)
    ceil.add_argument("--body-bytes", type=int, default=5000)
    args = parser.parse_args(argv)
    if args.command == "open":
        _run_open(args)
    elif args.command == "noop":
        _event_loop_policy()
        asyncio.run(serve_noop(args.host, args.port))
    else:
        rates = [float(r) for r in args.rates.split(",")]
        for result in ceiling(rates, args.duration, b"x" * args.body_bytes):
            print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
