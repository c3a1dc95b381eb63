"""Start the agent: load the repository, warm every model up, serve the V2 API, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from edge_agent.config import AgentConfig
from edge_agent.runtime.repository import load_repository
from edge_agent.runtime.spec import ModelConfig, ModelVersion
from edge_agent.scheduling.core import LevelPolicy, Scheduler, SchedulerConfig
from edge_agent.scheduling.worker import ModelWorker
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import LoadedModel, ModelRegistry

if TYPE_CHECKING:
    from edge_agent.telemetry import AgentTelemetry

log = logging.getLogger("spillway.agent")


def scheduler_config(model: ModelConfig, agent: AgentConfig) -> SchedulerConfig:
    """Triton's dynamic batching and queue policies, in the scheduler's terms."""
    batching = model.dynamic_batching
    max_batch = max(1, model.max_batch_size)
    if batching is None:
        return SchedulerConfig(max_batch_size=max_batch, instances=model.instance_count, merge=False,
                               max_queued_requests=agent.max_queued_requests, aging_s=agent.aging_s)  # fmt: skip
    level_count = max(1, batching.priority_levels)
    levels = []
    for level in range(1, level_count + 1):
        policy = batching.priority_queue_policy.get(level, batching.default_queue_policy)
        levels.append(
            LevelPolicy(
                max_queue_size=policy.max_queue_size,
                default_timeout_s=policy.default_timeout_us / 1e6,
                allow_timeout_override=policy.allow_timeout_override,
                timeout_action=policy.timeout_action,
            )
        )
    return SchedulerConfig(
        max_batch_size=max_batch,
        preferred_batch_sizes=tuple(s for s in batching.preferred_batch_sizes if s <= max_batch),
        max_queue_delay_s=batching.max_queue_delay_us / 1e6,
        levels=tuple(levels),
        default_level=batching.default_priority_level or 1 if batching.priority_levels else 1,
        instances=model.instance_count,
        max_queued_requests=agent.max_queued_requests,
        aging_s=agent.aging_s,
    )


def load_model(version: ModelVersion, agent: AgentConfig) -> LoadedModel:
    """Create the model's instances, measure its warm-up profile, and put a worker in front."""
    from edge_agent.runtime.profile import warmup_batch_sizes
    from edge_agent.runtime.runner import OrtRunner

    threads = agent.intra_op_threads or (os.cpu_count() or 1)
    runners = [
        OrtRunner(
            version,
            intra_op_threads=threads,
            inter_op_threads=agent.inter_op_threads,
            providers=agent.providers,
            gpu_mem_limit=agent.gpu_mem_limit,
            device_id=agent.device_id,
        )
        for _ in range(version.config.instance_count)
    ]
    profile = runners[0].warm_up(warmup_batch_sizes(max(1, version.config.max_batch_size)))
    scheduler = Scheduler(scheduler_config(version.config, agent), profile)
    worker = ModelWorker(scheduler, list(runners), profile, batching=version.config.max_batch_size > 0,
                         name=f"{version.config.name}-v{version.version}")  # fmt: skip
    log.info("loaded %s v%d on %s; warm-up %s", version.config.name, version.version, runners[0].providers,
             {k: f"{v * 1e3:.2f} ms" for k, v in profile.snapshot().items()})  # fmt: skip
    return LoadedModel(version.config, version.version, worker, tuple(runners[0].providers))


def build_registry(agent: AgentConfig) -> ModelRegistry:
    repository = load_repository(agent.model_repository)
    return ModelRegistry([load_model(version, agent) for version in repository])


DRAIN_LINGER_S = 0.5


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop admitting (new requests get 503 `draining`), answer everything queued, then exit."""

    def __init__(self, config: uvicorn.Config, app: InferenceApp, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.inference = app
        self.drain_timeout_s = drain_timeout_s
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        self._draining = loop.create_task(self._drain())

    async def _drain(self) -> None:
        self.inference.ready = False
        workers = [m.worker for m in self.inference.registry.all()]
        try:
            await asyncio.wait_for(asyncio.gather(*(w.drain() for w in workers)), self.drain_timeout_s)
            log.info("drained: every queued request was answered")
        except asyncio.TimeoutError:
            log.warning("drain timed out after %.0f s", self.drain_timeout_s)
        # Linger a moment, still answering 503 `draining` with `Connection: close`: a client whose keep-alive
        # connection is idle now would otherwise send into a socket being closed and never get an answer.
        await asyncio.sleep(DRAIN_LINGER_S)
        self.should_exit = True


def serve(agent: AgentConfig, *, registry: ModelRegistry | None = None, log_level: str = "info") -> None:
    registry = registry or build_registry(agent)
    app = InferenceApp(
        registry,
        token=agent.token.get_secret_value() if agent.token else None,
        max_body_bytes=agent.max_body_bytes,
        allow_non_finite=agent.allow_non_finite,
    )
    options: dict[str, Any] = {"host": agent.host, "port": agent.port, "log_level": log_level,
                               "access_log": False, "server_header": False, "lifespan": "on"}  # fmt: skip
    server = DrainingServer(uvicorn.Config(app, **options), app, agent.drain_timeout_s)
    telemetry = start_telemetry(agent, registry)
    try:
        server.run()
    finally:
        for model in registry.all():
            model.worker.close()
        if telemetry is not None:
            telemetry.shutdown()


def start_telemetry(agent: AgentConfig, registry: ModelRegistry) -> AgentTelemetry | None:
    """Hook every model's statistics to the OpenTelemetry instruments, if metrics have somewhere to go."""
    settings = agent.telemetry()
    if settings is None:
        return None
    from edge_agent.telemetry import AgentTelemetry

    telemetry = AgentTelemetry(settings)
    attach_telemetry(telemetry, registry)
    log.info("exporting metrics every %.0f s as agent %s", settings.export_interval_s, settings.agent_id)
    return telemetry


def attach_telemetry(telemetry: AgentTelemetry, registry: ModelRegistry) -> None:
    for model in registry.all():
        model.worker.stats.listener = telemetry.recorder(model.config.name, model.version)

    def depths() -> Iterable[tuple[dict[str, Any], int]]:
        for model in registry.all():
            for level, depth in enumerate(model.worker.scheduler.depth(), 1):
                yield {"model": model.config.name, "model.version": str(model.version), "priority": level}, depth

    telemetry.watch_queue(depths)
