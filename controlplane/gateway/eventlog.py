"""Ejections, returns and readiness changes written to the `events` table off the hot path: the request that
caused one only appends to a list; a background task writes them in batches from a worker thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from anyio import to_thread
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.repository import Actor, record_event
from controlplane.db.session import transaction
from controlplane.gateway.backend import Transition

log = logging.getLogger("spillway.controlplane.gateway")
ACTOR = "gateway"


class EventLog:
    def __init__(self, factory: sessionmaker[Session], max_pending: int = 10_000) -> None:
        self.factory = factory
        self.max_pending = max_pending
        self.pending: list[Transition] = []
        self.dropped = 0
        self._wake = asyncio.Event()

    def add(self, transitions: Iterable[Transition]) -> None:
        for transition in transitions:
            log.info("%s: backend %s: %s", transition.kind, transition.backend, transition.reason)
            if len(self.pending) >= self.max_pending:
                self.dropped += 1
                continue
            self.pending.append(transition)
        if self.pending:
            self._wake.set()

    async def run(self) -> None:
        """Write whatever is pending, as it comes; a failed write is logged and its events are dropped."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        try:
            await to_thread.run_sync(self._write, batch)
        except Exception:  # the gateway keeps serving; the log has what could not be recorded
            log.warning("could not record %d gateway events", len(batch), exc_info=True)

    def _write(self, batch: list[Transition]) -> None:
        with transaction(self.factory) as session:
            for t in batch:
                record_event(session, kind=t.kind, actor=Actor(ACTOR, t.reason), subject_type="backend",
                             subject_id=t.backend_id, data={"backend": t.backend, **t.data})  # fmt: skip
