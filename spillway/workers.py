"""Several control-plane processes on one port: `spillway controlplane serve --workers N` (PostgreSQL only).

The parent starts N copies of itself (`SPILLWAY_WORKER_INDEX` set), each binding the port with `SO_REUSEPORT`, so the
kernel spreads new connections over them (hashing each connection to one process: a keep-alive connection stays with
the worker that accepted it). The parent serves nothing itself: it forwards SIGTERM and SIGINT (each worker drains
as one process does, `spillway.graceful`), restarts a worker that died (after a second), and stops everything when a
worker dies within its first seconds (a bad setting, or the port taken by a process without `SO_REUSEPORT`): the same
fault would only repeat.

What each worker holds for itself: its gateway's connections, budgets and outlier state, its ingest-log slot
(`controlplane/ingest`), its caches. What they share goes through the database: the control loop runs in the one
process holding PostgreSQL's advisory lock, migrations take turns under another.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from types import FrameType

WORKER_ENV = "SPILLWAY_WORKER_INDEX"
EARLY_EXIT_S = 5.0  # a worker that exits this soon after its start is not restarted: everything stops
RESTART_AFTER_S = 1.0


def worker_index() -> int | None:
    """This process's index among the workers, or None when it is not a worker."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value not in (None, "") else None


def reuseport_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes may bind too (`SO_REUSEPORT`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def supervise(count: int, argv: list[str], *, say: object = print) -> int:
    """Run `count` workers (`argv`, with `SPILLWAY_WORKER_INDEX` set) until a signal or an early death; the exit
    code: 0 after a signal when every worker exited cleanly, else 1."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    started: dict[int, float] = {}
    stopping = False

    def start(index: int) -> None:
        env = {**os.environ, WORKER_ENV: str(index)}
        procs[index] = subprocess.Popen(argv, env=env)  # noqa: S603 (our own command line)
        started[index] = time.monotonic()

    def stop(sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(sig)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        for index in range(count):
            start(index)
        while not stopping:
            time.sleep(0.2)
            for index, proc in list(procs.items()):
                code = proc.poll()
                if code is None or stopping:
                    continue
                if time.monotonic() - started[index] < EARLY_EXIT_S:
                    say(f"worker {index} exited with {code} within {EARLY_EXIT_S:g} s of its start: stopping all")  # type: ignore[operator]
                    failed = True
                    stop(signal.SIGTERM, None)
                    break
                say(f"worker {index} exited with {code}; restarting it in {RESTART_AFTER_S:g} s")  # type: ignore[operator]
                time.sleep(RESTART_AFTER_S)
                if not stopping:
                    start(index)
        codes = [proc.wait() for proc in procs.values()]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed or any(code not in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 0


__all__ = ["WORKER_ENV", "reuseport_socket", "supervise", "worker_index"]
