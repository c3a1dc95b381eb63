"""Several control-plane processes on one port: `spillway controlplane serve --workers N` (PostgreSQL only).

The parent starts N copies of itself (`SPILLWAY_WORKER_INDEX` set), each binding the port with `SO_REUSEPORT`, so the
kernel spreads new connections over them (hashing each connection to one process: a keep-alive connection stays with
the worker that accepted it). The parent serves nothing itself: it forwards SIGTERM and SIGINT (each worker drains
as one process does, `spillway.graceful`; a second signal forces them, as it does one process), restarts a worker that
died (after a second), and stops everything when a worker dies within its first seconds (a bad setting, or the port
taken by a process without `SO_REUSEPORT`): the same fault would only repeat.

Each worker runs in a process group of its own, so that a terminal's Ctrl-C (or a signal to the parent's group)
reaches the parent alone and each worker gets the signal once, from the parent: a worker that got it twice would
stop at once instead of draining. A worker is sent SIGTERM by the kernel when the parent dies (Linux), so a killed
parent leaves no worker serving the port behind it. Under systemd, `KillMode=mixed` (SIGTERM to the parent only)
gives the same single signal; the default `control-group` signals every process, the workers then twice.

What each worker holds for itself: its gateway's connections, budgets and outlier state, its ingest-log slot
(`controlplane/ingest`), its caches. What they share goes through the database: the control loop runs in the one
process holding PostgreSQL's advisory lock, migrations take turns under another.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

WORKER_ENV = "SPILLWAY_WORKER_INDEX"
EARLY_EXIT_S = 5.0  # a worker that exits this soon after its start is not restarted: everything stops
RESTART_AFTER_S = 1.0
STOP_GRACE_S = 60.0  # after the stop signal, a worker still running this long after is killed
_PR_SET_PDEATHSIG = 1


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


def port_in_use(host: str, port: int) -> bool:
    """Whether something is bound to (host, port) already: a plain bind (no `SO_REUSEPORT`) fails. Checked before the
    workers start, since their own binds would succeed beside an earlier generation of workers still serving it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no user
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _worker_preexec(parent: int) -> Callable[[], None]:
    """Run in each worker between fork and exec: its own process group, and SIGTERM when the parent dies."""

    def preexec() -> None:
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the line above: nobody would signal this worker
                os._exit(1)

    return preexec


def supervise(
    count: int,
    argv: list[str],
    *,
    say: Callable[[str], None] = print,
    address: tuple[str, int] | None = None,
    grace_s: float = STOP_GRACE_S,
) -> int:
    """Run `count` workers (`argv`, with `SPILLWAY_WORKER_INDEX` set) until a signal or an early death; the exit
    code: 0 after a signal when every worker exited cleanly, else 1. With `address` (host, port), refuse to start (1)
    when something is bound to it already."""
    if address is not None and port_in_use(*address):
        say(f"port {address[1]} on {address[0]} is in use already (another server, or workers left running)")
        return 1
    procs: dict[int, subprocess.Popen[bytes]] = {}
    started: dict[int, float] = {}
    signalled: set[int] = set()  # pids sent the stop signal
    stop_signal: int | None = None
    parent = os.getpid()

    def start(index: int) -> None:
        env = {**os.environ, WORKER_ENV: str(index)}
        proc = subprocess.Popen(argv, env=env, preexec_fn=_worker_preexec(parent))  # noqa: S603 (our own command line)
        procs[index] = proc
        started[index] = time.monotonic()

    def forward(sig: int) -> None:
        for proc in list(procs.values()):
            if proc.poll() is None:
                proc.send_signal(sig)
                signalled.add(proc.pid)

    def stop(sig: int, _frame: FrameType | None) -> None:
        nonlocal stop_signal
        stop_signal = sig
        forward(sig)  # a second signal reaches the workers a second time: they stop at once

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        for index in range(count):
            if stop_signal is not None:
                break
            start(index)
        while stop_signal is None:
            time.sleep(0.2)
            for index, proc in list(procs.items()):
                code = proc.poll()
                if code is None or stop_signal is not None:
                    continue
                if time.monotonic() - started[index] < EARLY_EXIT_S:
                    say(f"worker {index} exited with {code} within {EARLY_EXIT_S:g} s of its start: stopping all")
                    failed = True
                    stop(signal.SIGTERM, None)
                    break
                say(f"worker {index} exited with {code}; restarting it in {RESTART_AFTER_S:g} s")
                time.sleep(RESTART_AFTER_S)
                if stop_signal is None:
                    start(index)
        # A worker started while the signal was being handled has not had it yet.
        for proc in procs.values():
            if proc.poll() is None and proc.pid not in signalled:
                proc.send_signal(stop_signal or signal.SIGTERM)
                signalled.add(proc.pid)
        codes = []
        deadline = time.monotonic() + grace_s
        for index, proc in procs.items():
            try:
                codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                say(f"worker {index} still runs {grace_s:g} s after the stop signal: killing it")
                proc.kill()
                codes.append(proc.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed or any(code not in (0, -signal.SIGTERM, -signal.SIGINT) for code in codes) else 0


__all__ = ["WORKER_ENV", "port_in_use", "reuseport_socket", "supervise", "worker_index"]
