"""`spillway controlplane serve --workers N` (spillway/workers.py): N real processes on one port with SO_REUSEPORT.

The control plane's own test needs PostgreSQL (more workers than one refuse SQLite). The supervisor's behaviour
(drain on SIGTERM, stop all on an early death, no orphan after the parent's death) is checked with a small uvicorn
worker of the same shape (`GracefulServer` on a `reuseport_socket`), which starts in a second rather than five.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spillway.workers import port_in_use, supervise
from tests.utils.server import free_port

WORKER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    index = int(os.environ["SPILLWAY_WORKER_INDEX"])
    if os.environ.get("EXIT_INDEX") == str(index):
        time.sleep(float(os.environ.get("EXIT_AFTER_S", "0")))
        sys.exit(3)
    import uvicorn
    from spillway.graceful import GracefulServer
    from spillway.workers import reuseport_socket

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(1.5)
        body = str(os.getpid()).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    port = int(sys.argv[1])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    GracefulServer(config, quiet_s=0.2).run(sockets=[reuseport_socket("127.0.0.1", port)])
    """
)


def _get(port: int, path: str, timeout: float = 10.0) -> tuple[int, int]:
    """(status, pid of the worker that answered) over a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, int(response.read())
    finally:
        conn.close()


def _wait_serving(port: int, proc: subprocess.Popen[bytes], count: int = 2, timeout_s: float = 30.0) -> None:
    """Until `count` of `proc`'s workers listen on `port` (each binds once its app is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the supervisor exited with {proc.returncode}"
        if sum(_serving_pid(pid, port) for pid in _children(proc.pid)) >= count:
            return
        assert time.monotonic() < deadline, "the workers did not all listen in time"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _alive(p)]}"
        time.sleep(0.05)


@pytest.fixture
def worker_script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.fixture
def start_supervisor(worker_script: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(port: int, count: int = 2, **env: str) -> subprocess.Popen[bytes]:
        code = ("import sys; from spillway.workers import supervise; "
                f"sys.exit(supervise({count}, [sys.executable, {str(worker_script)!r}, '{port}']))")  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env})
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait(10)


def test_sigterm_drains_every_worker_and_exits_0(start_supervisor: Callable[..., subprocess.Popen[bytes]]) -> None:
    port = free_port()
    proc = start_supervisor(port)
    _wait_serving(port, proc)
    workers = _children(proc.pid)
    assert len(workers) == 2
    answers: list[tuple[int, int]] = []
    threads = [threading.Thread(target=lambda: answers.append(_get(port, "/slow"))) for _ in range(16)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # every request is in flight (each takes 1.5 s)
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(20)
    assert proc.wait(20) == 0
    # Every request in flight got its answer, from both workers (16 connections all hashed to one: 2**-15).
    assert len(answers) == 16 and {status for status, _ in answers} == {200}
    assert {pid for _, pid in answers} == set(workers)
    _wait_gone(workers)
    assert not port_in_use("127.0.0.1", port)


def test_a_worker_dying_early_stops_them_all(start_supervisor: Callable[..., subprocess.Popen[bytes]]) -> None:
    port = free_port()
    proc = start_supervisor(port, EXIT_INDEX="1", EXIT_AFTER_S="3")  # worker 1 fails 3 s in (< 5 s)
    _wait_serving(port, proc, count=1)
    survivor = _get(port, "/pid")[1]  # worker 0 serves the port alone
    assert proc.wait(30) == 1
    _wait_gone([survivor])
    assert not port_in_use("127.0.0.1", port)


def test_workers_do_not_outlive_a_killed_parent(start_supervisor: Callable[..., subprocess.Popen[bytes]]) -> None:
    port = free_port()
    proc = start_supervisor(port)
    _wait_serving(port, proc)
    workers = _children(proc.pid)
    proc.kill()  # no chance to forward anything: the kernel signals the workers (PR_SET_PDEATHSIG)
    proc.wait(10)
    _wait_gone(workers)


def test_a_port_in_use_is_refused_before_any_worker_starts() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said: list[str] = []
        argv = [sys.executable, "-c", "raise SystemExit('a worker started')"]
        assert supervise(2, argv, say=said.append, address=("127.0.0.1", port)) == 1
        assert said and "in use" in said[0]


@pytest.mark.postgres
def test_two_control_plane_workers_answer_on_one_port_and_stop_on_sigterm(postgres_url: str) -> None:
    from controlplane.db import migrate_to

    migrate_to(postgres_url)
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")},
           "SPILLWAY_DATABASE_URL": postgres_url, "SPILLWAY_HOST": "127.0.0.1", "SPILLWAY_PORT": str(port),
           "SPILLWAY_CONTROL_LOOP_INTERVAL_S": "0", "SPILLWAY_LOG_LEVEL": "warning"}  # fmt: skip
    cmd = [sys.executable, "-m", "spillway.cli", "controlplane", "serve", "--no-migrate", "--workers", "2"]
    proc = subprocess.Popen(cmd, env=env)
    conns: list[http.client.HTTPConnection] = []
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 or not _serving(port):
            assert proc.poll() is None, f"serve --workers 2 exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the workers did not come up in 60 s"
            time.sleep(0.1)
        workers = _children(proc.pid)
        deadline = time.monotonic() + 60
        while not all(_serving_pid(pid, port) for pid in workers):  # each worker binds when its app is ready
            assert time.monotonic() < deadline, "a worker never listened"
            time.sleep(0.1)
        for _ in range(16):  # kept open: each stays with the worker that accepted it
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/readyz")
            response = conn.getresponse()
            assert response.status == 200, response.read()
            response.read()
            conns.append(conn)
        # Both workers hold some of the 16 connections (all hashed to one: 2**-15).
        assert all(_connections_of(pid, port) for pid in workers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _wait_gone(workers)
    finally:
        for conn in conns:
            conn.close()
        if proc.poll() is None:
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait(10)


def _serving(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/readyz")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _tcp_sockets(port: int, state: str) -> set[str]:
    """Inodes of loopback TCP sockets with local port `port` in `state` (0A: listening, 01: established)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == state:
            found.add(fields[9])
    return found


def _serving_pid(pid: int, port: int) -> bool:
    return bool(_socket_inodes(pid) & _tcp_sockets(port, "0A"))


def _connections_of(pid: int, port: int) -> int:
    return len(_socket_inodes(pid) & _tcp_sockets(port, "01"))
