"""The agent's telemetry while policies change it: every served model version hooked to the instruments, and the
whole pipeline rebuilt when a policy changes the histogram buckets or the export interval (OpenTelemetry views
and readers are fixed once a meter provider exists).

Generative models: the engines dict is the one the APIs read (a variant switch puts the new pool in it); a pool
switched away from stays hooked while it finishes its streams, and its gauges (active streams, KV blocks, queue
depth) add up with the served pool's under the model's name until it is closed. The preemption counter stays
monotonic across switches: a closed pool's count is carried over."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from edge_agent.telemetry.metrics import AgentTelemetry, TelemetrySettings
from spillway.contract import names

if TYPE_CHECKING:
    from edge_agent.generation.pool import EnginePool
    from edge_agent.serving.models import LoadedModel, ModelRegistry

log = logging.getLogger("spillway.agent.telemetry")


class LiveTelemetry:
    """The current AgentTelemetry for the registry's models (always built: `/metrics` needs no destination);
    `reconfigure` swaps it for one with new settings."""

    def __init__(
        self,
        base: TelemetrySettings,
        registry: ModelRegistry,
        *,
        factory: Callable[[TelemetrySettings], AgentTelemetry] = AgentTelemetry,
        policy: Callable[[], tuple[int, str]] | None = None,
        engines: dict[str, EnginePool] | None = None,
        tenant_label: Callable[[str], str] | None = None,
    ) -> None:
        """Args:
        base: the settings from the agent's config (a policy overrides buckets and interval only).
        registry: the served models; versions a policy loads later are hooked with `attach`.
        factory: builds the AgentTelemetry (tests give it an in-memory reader).
        policy: the active policy's (version, source), for the `spillway.policy.version` gauge.
        engines: the generative models' pools by name: the dict itself, read at every collection.
        tenant_label: a request's tenant as the `spillway.tenant` attribute names it (the tenants registry's `label`:
            bounded); None: as it is.
        """
        self.base = base
        self.registry = registry
        self._factory = factory
        self._policy = policy
        self.engines: dict[str, EnginePool] = engines if engines is not None else {}
        self.retiring: list[EnginePool] = []  # switched away from, still finishing streams
        self._closed_preemptions: dict[str, int] = {}  # by model: preemptions of its pools closed since start
        self._pools = threading.Lock()  # a collection (the exporter's thread) sees a pool in one place, never two
        self.tenant_label = tenant_label
        self.settings = base
        self.current = self._start(base)

    def _start(self, settings: TelemetrySettings) -> AgentTelemetry:
        telemetry = self._factory(settings)
        if self.tenant_label is not None:
            telemetry.tenant_label = self.tenant_label
        for model in [*self.registry.all(), *self.registry.retiring]:
            model.worker.stats.listener = telemetry.recorder(model.config.name, model.version)

        def depths() -> Iterable[tuple[dict[str, Any], int]]:
            for model in self.registry.all():
                for level, depth in enumerate(model.worker.scheduler.depth(), 1):
                    yield {names.ATTR_MODEL: model.config.name, names.ATTR_VERSION: str(model.version),
                           names.ATTR_PRIORITY: level}, depth  # fmt: skip
            for engine in [*self.engines.values(), *self.retiring]:
                for level, depth in enumerate(engine.waiting_by_level(), 1):
                    yield {names.ATTR_MODEL: engine.name, names.ATTR_VERSION: engine.version,
                           names.ATTR_PRIORITY: level}, depth  # fmt: skip

        telemetry.watch_queue(depths)
        for engine in [*self.engines.values(), *self.retiring]:
            engine.listener = telemetry.generation(engine.name, engine.version)
        telemetry.watch_engines(self._engine_states)
        if self._policy is not None:
            telemetry.watch_policy(self._policy)
        return telemetry

    def _engine_states(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(model, state) per generative model: the served pool's state with its retiring pools' added."""
        with self._pools:
            served, retiring, closed = list(self.engines.items()), list(self.retiring), dict(self._closed_preemptions)
        for name, engine in served:
            state = engine.json()
            for old in [pool for pool in retiring if pool.name == name]:
                before = old.json()
                for key in ("running", "waiting", "active", "preemptions"):
                    state[key] += before[key]
                blocks, old_blocks = state["kv_blocks"], before["kv_blocks"]
                state["kv_blocks"] = {**blocks, "used": blocks["used"] + old_blocks["used"],
                                      "total": blocks["total"] + old_blocks["total"]}  # fmt: skip
            state["preemptions"] += closed.get(name, 0)
            yield name, state

    def engine_swapped(self, name: str, new: EnginePool, old: EnginePool) -> None:
        """A variant switch: `new` serves `name` now (hooked here, and put in the engines dict), `old` finishes its
        streams (still counted)."""
        new.listener = self.current.generation(name, new.version)
        with self._pools:
            self.engines[name] = new
            self.retiring.append(old)

    def engine_retired(self, old: EnginePool) -> None:
        """A pool switched away from is closed: its gauges go, its preemptions stay counted."""
        preemptions = old.json()["preemptions"]
        with self._pools:
            if old in self.retiring:
                self.retiring.remove(old)
                self._closed_preemptions[old.name] = self._closed_preemptions.get(old.name, 0) + preemptions

    def attach(self, model: LoadedModel) -> None:
        """Hook a newly loaded model version to the instruments."""
        model.worker.stats.listener = self.current.recorder(model.config.name, model.version)

    def settings_for(
        self, latency_buckets_ms: Sequence[float] | None, export_interval_s: float | None
    ) -> TelemetrySettings:
        """The base settings with a policy's overrides (None: as configured)."""
        return replace(
            self.base,
            latency_buckets_ms=self.base.latency_buckets_ms
            if latency_buckets_ms is None
            else tuple(latency_buckets_ms),
            export_interval_s=self.base.export_interval_s if export_interval_s is None else export_interval_s,
        )

    async def reconfigure(self, latency_buckets_ms: Sequence[float] | None, export_interval_s: float | None) -> bool:
        """Rebuild the pipeline if the settings change: the new one takes over every hook at once (nothing recorded
        in between is lost), then the old one flushes and stops off the event loop. Returns whether it changed."""
        settings = self.settings_for(latency_buckets_ms, export_interval_s)
        if settings == self.settings:
            return False
        old = self.current
        self.current = self._start(settings)
        self.settings = settings
        log.info("telemetry rebuilt: buckets %s ms, export every %.1f s", list(settings.latency_buckets_ms),
                 settings.export_interval_s)  # fmt: skip
        await asyncio.to_thread(old.shutdown)
        return True

    def refused(self, source: str) -> None:
        """Count one refused policy document."""
        self.current.policy_refusals.add(1, {names.ATTR_POLICY_SOURCE: source})

    def metrics_text(self) -> tuple[bytes, str]:
        """`GET /metrics` (InferenceApp.metrics): the current pipeline's instruments in the Prometheus text format."""
        return self.current.metrics_text()

    def json(self) -> dict[str, Any]:
        return {"export_interval_s": self.settings.export_interval_s,
                "latency_buckets_ms": list(self.settings.latency_buckets_ms)}  # fmt: skip

    def shutdown(self) -> None:
        self.current.shutdown()
