"""The `backends` table, loaded into the pool: every `refresh_s`, at once after a change made through this
process's API, and on a request for a model nobody serves (at most every 0.5 s), so that a backend registered
through another replica answers its first request. A failed load leaves the pool as it was."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from anyio import to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db.models import Backend
from controlplane.gateway.backend import BackendSpec, BackendState
from controlplane.gateway.errors import InvalidModelName
from controlplane.gateway.pool import BackendPool
from controlplane.gateway.tenant import is_tenant_name
from controlplane.schemas.backends import is_model_name

log = logging.getLogger("spillway.controlplane.gateway")
MISS_RELOAD_S = 0.5


def spec_of(row: Backend) -> BackendSpec:
    return BackendSpec(id=row.id, name=row.name, url=row.url.rstrip("/"), models=tuple(row.models),
                       weight=row.weight, max_concurrency=row.max_concurrency, timeout_ms=row.timeout_ms,
                       binary_tensors=row.binary_tensors, auth_header=row.auth_header or None,
                       protocol=row.protocol or "v2", model_map=dict(row.model_map or {}),
                       tenant_share=tenant_share_of(getattr(row, "tenant_share", None)))  # fmt: skip


def tenant_share_of(stored: Any) -> dict[str, float]:
    """A backend's `tenant_share` as stored: {tenant name: share in (0, 1]}. The API checks it; an entry that is not
    one (a row written past it) is left out, so that it caps nothing rather than stop the gateway loading."""
    if not isinstance(stored, dict):
        return {}
    shares: dict[str, float] = {}
    for tenant, share in stored.items():
        if not isinstance(tenant, str) or not is_tenant_name(tenant):
            continue
        if isinstance(share, int | float) and not isinstance(share, bool) and 0 < share <= 1:
            shares[tenant] = float(share)
    return shares


class BackendCatalog:
    def __init__(
        self,
        pool: BackendPool,
        *,
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_removed: Callable[[BackendState], None] = lambda _: None,
    ) -> None:
        self.pool = pool
        self.refresh_s = refresh_s
        self.clock = clock
        self.on_removed = on_removed
        self.factory: sessionmaker[Session] | None = None
        self.loaded_at: float | None = None
        self._generation = 0  # bumped by `changed` (from any thread)
        self._loaded_generation = -1
        self._loading: asyncio.Future[None] | None = None
        self._last_miss_load = -1e9
        self._failing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()

    def attach(self, factory: sessionmaker[Session]) -> None:
        """Bind to the database and to the running event loop (in the app's lifespan)."""
        self.factory = factory
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()

    def detach(self) -> None:
        self._loop = None

    def changed(self) -> None:
        """A backend was changed through this process (called from the route's thread): the next request
        reloads before it picks, and the refresh loop reloads at once (so that the status page shows it)."""
        self._generation += 1
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    async def reload(self) -> None:
        """Load the backends; concurrent callers share one load."""
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._reload())
        await asyncio.shield(self._loading)

    async def _reload(self) -> None:
        generation = self._generation
        specs = await to_thread.run_sync(self._read)
        for state in self.pool.replace(specs):
            self.on_removed(state)
        self._loaded_generation = generation
        self.loaded_at = self.clock()

    def _read(self) -> list[BackendSpec]:
        assert self.factory is not None, "attach() first"
        with self.factory() as session:
            return [spec_of(row) for row in session.scalars(select(Backend))]

    async def current(self, model: str, protocol: str = "v2") -> None:
        """Before a request picks: reload if this process changed a backend since the last load, or if nobody
        serves `model` over `protocol` (then at most every MISS_RELOAD_S). A failed load does not raise: the last
        one serves.

        Raises InvalidModelName for a name that no backend can register (the backends' own rule): no load
        could ever serve it, so it is the request that is wrong, not the fleet that lacks a backend."""
        if not is_model_name(model):
            raise InvalidModelName(
                f"model: {model[:64]!r} is not a model name (1-128 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit)"
            )
        try:
            for _ in range(3):  # a load that began before the change does not count
                if self._generation == self._loaded_generation:
                    break
                await self.reload()
            if not self.pool.knows(model, protocol):
                if self._loading is not None and not self._loading.done():
                    await asyncio.shield(self._loading)
                elif self.clock() - self._last_miss_load >= MISS_RELOAD_S:
                    self._last_miss_load = self.clock()
                    await self.reload()
        except Exception:
            log.warning("gateway: could not reload the backends", exc_info=True)

    async def run(self, after: Callable[[], None] = lambda: None) -> None:
        """Reload every `refresh_s` or when woken by `changed`; `after` runs after each load."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            self._wake.clear()
            try:
                await self.reload()
                if self._failing:
                    log.info("gateway: the backends load again")
                self._failing = False
            except Exception:
                if not self._failing:  # once per streak, not at every refresh
                    log.warning("gateway: could not reload the backends", exc_info=True)
                self._failing = True
            after()
