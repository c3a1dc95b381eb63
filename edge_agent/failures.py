"""A streak of failures of one kind of work (policy polls, writes to a full disk), logged once when it begins and
once when it ends, however many failures came between: a device that cannot reach its control plane or write its
disk for an hour must not write a line per request. And the stopping of such work's background loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any


class FailureStreak:
    """Consecutive failures; `failing` is logged (a warning) at the first, `working` (info) when one succeeds again.

    Both are `str.format` templates: `failing` gets `{error}` and the keywords given to `failed`, `working` gets
    `{failures}` (how many the streak had) and the keywords given to `worked`."""

    def __init__(self, log: logging.Logger, failing: str, working: str) -> None:
        self._log = log
        self._failing = failing
        self._working = working
        self.failures = 0
        self.last_error: str | None = None

    def failed(self, error: object, **context: Any) -> None:
        self.failures += 1
        self.last_error = str(error)
        if self.failures == 1:
            self._log.warning(self._failing.format(error=error, **context))

    def worked(self, **context: Any) -> None:
        if self.failures:
            self._log.info(self._working.format(failures=self.failures, **context))
        self.failures = 0

    def json(self) -> dict[str, Any]:
        return {"ok": self.failures == 0, "consecutive_failures": self.failures, "last_error": self.last_error}


async def cancelled(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background loop's task and wait until it has stopped (None: nothing was started)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
