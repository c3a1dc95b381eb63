"""The one process harness that the demo, the tests, the benchmarks and the dashboard's launcher share: start a
command with its output in a log file, wait until an HTTP URL answers the wanted status (checking all the while
that the process still runs, and naming its log's last lines when it does not come up), and stop it: a signal,
then SIGKILL after a grace.

    with Process.start([sys.executable, "-m", "spillway.cli", "controlplane", "serve"], name="the control plane",
                       log=root / "controlplane.log") as cp:
        cp.wait_ready("http://127.0.0.1:8400/readyz")
        ...
    # stopped here: SIGTERM, and SIGKILL if it is still running after the grace

The standard library and httpx only: `dashboards/launch.py` imports this module, and the dashboard must not pull
in the demo's models, the agent or the control plane.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

TAIL_CHARS = 3000  # how much of the end of a log an error shows
GRACE_S = 30.0  # how long `stop` waits after its signal before SIGKILL
KILL_WAIT_S = 10.0  # how long it then waits for the killed process to be gone


class ProcessError(RuntimeError):
    """A process did not become ready."""


class ProcessExited(ProcessError):
    """The process ended before it was ready."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class NotReady(ProcessError):
    """The process still runs, but did not answer as wanted within the time given."""


class Process:
    """A child process, its log, and how to stop it. `Process.start(...)` starts one; `Process(popen)` adopts one
    started otherwise. As a context manager it stops the process on exit.

    Besides its own methods it answers what callers used of `subprocess.Popen`: `pid`, `returncode`, `poll()`,
    `wait()`, `send_signal()`, `terminate()` and `kill()`; signals go to its whole process group when `group`.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        *,
        name: str = "the process",
        log: Path | None = None,
        group: bool = False,
        grace_s: float = GRACE_S,
    ) -> None:
        self.popen = popen
        self.name = name
        self.log = log
        self.group = group
        self.grace_s = grace_s

    @classmethod
    def start(
        cls,
        args: Sequence[str | os.PathLike[str]],
        *,
        name: str | None = None,
        log: Path | int | None = None,
        append: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        group: bool = False,
        stdin: int | None = None,
        grace_s: float = GRACE_S,
    ) -> Process:
        """Start `args`.

        Args:
            name: what errors call it ("the control plane"); the program's name by default.
            log: a file for its stdout and stderr (appended to, or written afresh without `append`; the parent
                keeps no descriptor of it), `subprocess.DEVNULL` to discard them, or None to share the caller's.
            env: its whole environment (the caller's by default).
            group: its own session and process group, and every signal to the whole group: what it forks stops
                with it, and a Ctrl-C in the terminal reaches only the caller (which stops it).
            stdin: as `subprocess.Popen`'s (e.g. `subprocess.DEVNULL`).
            grace_s: how long `stop` waits after its signal before SIGKILL.
        """
        command = [os.fspath(a) for a in args]
        label = name or Path(command[0]).name

        def popen(stdout: int | IO[bytes] | None) -> subprocess.Popen[bytes]:
            return subprocess.Popen(  # noqa: S603 - the caller's own command line
                command, env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                stderr=None if stdout is None else subprocess.STDOUT, start_new_session=group,
            )  # fmt: skip

        if not isinstance(log, Path):
            return cls(popen(log), name=label, group=group, grace_s=grace_s)
        with log.open("ab" if append else "wb") as out:  # the child holds its own copy of the descriptor
            return cls(popen(out), name=label, log=log, group=group, grace_s=grace_s)

    # ---- what subprocess.Popen answers -----------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """`sig` to the process (to its process group when `group`), unless it has already exited."""
        if self.popen.poll() is not None:
            return
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        else:
            self.popen.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    # ---- the harness ----------------------------------------------------------------------------------

    def log_tail(self, chars: int = TAIL_CHARS) -> str:
        """The end of its log ("" without a log file)."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:]

    def _failed(self, what: str) -> str:
        if self.log is None:
            return what
        tail = self.log_tail()
        return f"{what}; see {self.log}" + (f", which ends:\n{tail}" if tail.strip() else " (empty)")

    def _exited(self, waiting_for: str) -> ProcessExited:
        code = self.popen.returncode
        assert code is not None
        return ProcessExited(self._failed(f"{self.name} exited with code {code} before {waiting_for}"), code)

    def wait_ready(
        self,
        url: str,
        status: int | None = 200,
        *,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        interval_s: float = 0.1,
    ) -> httpx.Response:
        """Poll `GET url` until it answers `status` (any status when None) and return that answer.

        Raises:
            ProcessExited: the process ended first.
            NotReady: no such answer within `timeout_s` (the last answer, if any, is named).
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        # trust_env=False: a proxy from the environment has no business between us and our own child.
        with httpx.Client(timeout=2.0, headers=dict(headers or {}), trust_env=False) as client:
            while True:
                if self.popen.poll() is not None:
                    raise self._exited(f"GET {url} answered {'at all' if status is None else status}")
                try:
                    response = client.get(url)
                    if status is None or response.status_code == status:
                        return response
                    last = f"the last answer was {response.status_code}"
                except httpx.TransportError as exc:
                    last = f"the last try ended in {type(exc).__name__}"
                if time.monotonic() >= deadline:
                    wanted = "an answer" if status is None else f"{status}"
                    raise NotReady(self._failed(f"{self.name} did not answer GET {url} with {wanted} within "
                                                f"{timeout_s:g} s ({last})"))  # fmt: skip
                time.sleep(interval_s)

    def wait_listening(
        self, port: int, host: str = "127.0.0.1", *, timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> None:
        """Until a TCP connection to `host:port` succeeds (for servers with no URL to ask); raises as `wait_ready`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise self._exited(f"it listened on {host}:{port}")
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
                return
            if time.monotonic() >= deadline:
                raise NotReady(self._failed(f"{self.name} did not listen on {host}:{port} within {timeout_s:g} s"))
            time.sleep(interval_s)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float | None = None) -> int:
        """`sig` (SIGTERM by default), then SIGKILL if it still runs after `grace_s` (the process's grace by
        default); returns its exit code. Nothing happens to a process that has already exited."""
        if self.popen.poll() is not None:
            return self.popen.returncode
        self.send_signal(sig)
        return self._reap(self.grace_s if grace_s is None else grace_s)

    def _reap(self, grace_s: float) -> int:
        try:
            return self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            return self.popen.wait(KILL_WAIT_S)

    def __enter__(self) -> Process:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.popen.poll() is None else f"exited {self.popen.returncode}"
        return f"<Process {self.name!r} pid {self.popen.pid} {state}>"


def stop(
    process: Process | subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, grace_s: float | None = None
) -> None:
    """`Process.stop` for a process that may be None or a plain `subprocess.Popen`."""
    if process is None:
        return
    (process if isinstance(process, Process) else Process(process)).stop(sig, grace_s)


def stop_all(processes: Iterable[Process], sig: int = signal.SIGTERM, grace_s: float | None = None) -> None:
    """Stop several at once: `sig` to each, then one shared grace (the longest of theirs, or `grace_s`) counted from
    the signals, after which those still running get SIGKILL: a few stuck processes cost one grace, not one each."""
    running = [p for p in processes if p.running]
    for process in running:
        process.send_signal(sig)
    grace = max((p.grace_s for p in running), default=0.0) if grace_s is None else grace_s
    deadline = time.monotonic() + grace
    for process in running:
        process._reap(max(0.0, deadline - time.monotonic()))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` just now (another process may take it before the caller's server binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


__all__ = ["NotReady", "Process", "ProcessError", "ProcessExited", "free_port", "stop", "stop_all"]
