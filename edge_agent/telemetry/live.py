"""The agent's telemetry while policies change it: every served model version hooked to the instruments, and the
whole pipeline rebuilt when a policy changes the histogram buckets or the export interval (OpenTelemetry views
and readers are fixed once a meter provider exists)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from edge_agent.telemetry.metrics import AgentTelemetry, TelemetrySettings

if TYPE_CHECKING:
    from edge_agent.generation.pool import EnginePool
    from edge_agent.serving.models import LoadedModel, ModelRegistry

log = logging.getLogger("spillway.agent.telemetry")


class LiveTelemetry:
    """The current AgentTelemetry for the registry's models; `reconfigure` swaps it for one with new settings."""

    def __init__(
        self,
        base: TelemetrySettings,
        registry: ModelRegistry,
        *,
        factory: Callable[[TelemetrySettings], AgentTelemetry] = AgentTelemetry,
        policy: Callable[[], tuple[int, str]] | None = None,
        engines: Mapping[str, EnginePool] | None = None,
    ) -> None:
        """Args:
        base: the settings from the agent's config (a policy overrides buckets and interval only).
        registry: the served models; versions a policy loads later are hooked with `attach`.
        factory: builds the AgentTelemetry (tests give it an in-memory reader).
        policy: the active policy's (version, source), for the `spillway.policy.version` gauge.
        """
        self.base = base
        self.registry = registry
        self._factory = factory
        self._policy = policy
        self.engines = dict(engines or {})
        self.settings = base
        self.current = self._start(base)

    def _start(self, settings: TelemetrySettings) -> AgentTelemetry:
        telemetry = self._factory(settings)
        for model in [*self.registry.all(), *self.registry.retiring]:
            model.worker.stats.listener = telemetry.recorder(model.config.name, model.version)

        def depths() -> Iterable[tuple[dict[str, Any], int]]:
            for model in self.registry.all():
                for level, depth in enumerate(model.worker.scheduler.depth(), 1):
                    yield {"model": model.config.name, "model.version": str(model.version), "priority": level}, depth
            for name, engine in self.engines.items():
                for level, depth in enumerate(engine.waiting_by_level(), 1):
                    yield {"model": name, "model.version": engine.version, "priority": level}, depth

        telemetry.watch_queue(depths)
        for name, engine in self.engines.items():
            engine.listener = telemetry.generation(name, engine.version)
        telemetry.watch_engines(lambda: [(name, engine.json()) for name, engine in self.engines.items()])
        if self._policy is not None:
            telemetry.watch_policy(self._policy)
        return telemetry

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
        self.current.policy_refusals.add(1, {"policy.source": source})

    def json(self) -> dict[str, Any]:
        return {"export_interval_s": self.settings.export_interval_s,
                "latency_buckets_ms": list(self.settings.latency_buckets_ms)}  # fmt: skip

    def shutdown(self) -> None:
        self.current.shutdown()
