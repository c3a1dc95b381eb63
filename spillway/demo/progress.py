"""Progress of long operations on stderr: live (a spinner or a bar with the elapsed time, drawn by rich, which typer
brings to every install) when stderr is a terminal, and plain lines otherwise, so that logs and tests read text.

    with waiting("the control plane (GET /readyz)"):
        cp.wait_ready(...)
    # a terminal: a spinner and the seconds so far, then "waited for the control plane (GET /readyz): 1.2 s"
    # otherwise: "waiting for the control plane (GET /readyz) ..." and then that same last line

    with Steps("building the demo model repository", total=4) as steps:
        ...
        steps.done("built mlp v1 (full): ...")  # -> "built mlp v1 (full): ... (1 of 4, 2.1 s)"
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _live(description: str, *, total: int | None) -> Any:
    """A rich progress display on stderr: a spinner, what, a bar when `total` is known, and the elapsed time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Say that the caller waits for `what` and, once done, how long it took (or that it gave up, and when)."""
    started = time.monotonic()
    live = _live(f"waiting for {what}", total=None) if stderr_is_terminal() else None
    if live is None:
        _line(f"waiting for {what} ...")
    else:
        live.start()
        live.add_task(f"waiting for {what}", total=None)
    try:
        yield
    except BaseException:
        if live is not None:
            live.stop()
        _line(f"gave up waiting for {what} after {time.monotonic() - started:.1f} s")
        raise
    if live is not None:
        live.stop()
    _line(f"waited for {what}: {time.monotonic() - started:.1f} s")


class Steps:
    """A known number of steps: a bar on a terminal, and a line per step done with its count and duration."""

    def __init__(self, what: str, *, total: int) -> None:
        self.what, self.total, self.count = what, total, 0
        self.started = self.last = time.monotonic()
        self.live: Any = None
        self.task: Any = None

    def __enter__(self) -> Steps:
        self.started = self.last = time.monotonic()
        if stderr_is_terminal():
            self.live = _live(self.what, total=self.total)
            self.live.start()
            self.task = self.live.add_task(self.what, total=self.total)
        else:
            _line(f"{self.what} ...")
        return self

    def done(self, line: str) -> None:
        """One step done: `line`, then its place and duration (`... (2 of 4, 1.3 s)`)."""
        now = time.monotonic()
        self.count += 1
        text = f"{line} ({self.count} of {self.total}, {now - self.last:.1f} s)"
        self.last = now
        if self.live is not None:
            self.live.console.print(text, markup=False, highlight=False)
            self.live.advance(self.task)
        else:
            _line(text)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.live is not None:
            self.live.stop()
        if exc_type is None:
            _line(f"{self.what}: {self.count} of {self.total} done in {self.elapsed:.1f} s")


__all__ = ["Steps", "stderr_is_terminal", "waiting"]
