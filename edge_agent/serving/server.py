"""Start the agent: load the repository, warm every model up, apply the cached policy, serve the V2 API while
polling the control plane for policy changes, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn

from edge_agent.config import AgentConfig
from edge_agent.overflow.fallback import ResponseCache
from edge_agent.policy.apply import PolicyApplier
from edge_agent.policy.cache import PolicyCache
from edge_agent.policy.plan import PolicyRefused, ServedDecoder, ServedModel, validate_default_outputs
from edge_agent.runtime.config import ModelConfigError
from edge_agent.runtime.memory import MemoryGuard
from edge_agent.runtime.repository import UnknownModelError, check_onnx_graph, load_repository
from edge_agent.scheduling.core import Scheduler, SchedulerConfig, level_policies
from edge_agent.scheduling.worker import ModelWorker
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.models import LoadedModel, ModelRegistry
from edge_agent.tenants import TenantRegistry
from spillway.contract.policy import Overflow
from spillway.contract.spec import ModelConfig, ModelVersion
from spillway.graceful import GracefulServer

if TYPE_CHECKING:
    import socket

    import numpy as np

    from edge_agent.generation.pool import EnginePool
    from edge_agent.overflow.forward import Forwarder
    from edge_agent.overflow.queue import AsyncQueue
    from edge_agent.policy.client import PolicyPoller
    from edge_agent.runtime.repository import GenerativeModel
    from edge_agent.serving.ports import Ports, SidePorts
    from edge_agent.telemetry import LiveTelemetry

log = logging.getLogger("spillway.agent")


def scheduler_config(model: ModelConfig, agent: AgentConfig) -> SchedulerConfig:
    """Triton's dynamic batching and queue policies, in the scheduler's terms."""
    batching = model.dynamic_batching
    max_batch = max(1, model.max_batch_size)
    if batching is None:
        return SchedulerConfig(max_batch_size=max_batch, instances=model.instance_count, merge=False,
                               max_queued_requests=agent.max_queued_requests, aging_s=agent.aging_s)  # fmt: skip
    return SchedulerConfig(
        max_batch_size=max_batch,
        preferred_batch_sizes=tuple(s for s in batching.preferred_batch_sizes if s <= max_batch),
        max_queue_delay_s=batching.max_queue_delay_us / 1e6,
        levels=level_policies(batching),
        default_level=batching.default_priority_level or 1 if batching.priority_levels else 1,
        instances=model.instance_count,
        max_queued_requests=agent.max_queued_requests,
        aging_s=agent.aging_s,
    )


def load_model(version: ModelVersion, agent: AgentConfig, memory: MemoryGuard | None = None) -> LoadedModel:
    """Create the model's instances (each on the GPU its `instance_group.gpus` pins it to, else the agent's
    `device_id`; a pinned GPU this machine does not have is refused, naming the field), measure its warm-up profile,
    and put a worker in front. Before anything loads, `memory` (the agent's guard) checks the model's need on each
    device against the free memory, its `gpu_mem_limit` and the agent's GPU budget; it measures what the load took
    and holds it against the budget until the registry retires the version."""
    import onnxruntime as ort

    from edge_agent.runtime import gpu
    from edge_agent.runtime.config import check_instance_gpus, pinning_field, placed_devices, read_config_message
    from edge_agent.runtime.profile import warmup_batch_sizes
    from edge_agent.runtime.runner import RunnerError, create_runner, runner_providers
    from edge_agent.serving.triton_config import completed_config

    threads = agent.intra_op_threads or (os.cpu_count() or 1)
    message = read_config_message(version.config)
    count = version.config.instance_count
    devices = placed_devices(message, count, agent.device_id)
    chosen = runner_providers(version, ort.get_available_providers(), agent.providers)
    on_gpu = any(p in gpu.GPU_PROVIDERS for p in chosen)
    present = gpu.device_count() if on_gpu else None  # None (no NVML): a GPU not there fails its session, said below
    if present is not None:
        check_instance_gpus(message, present, version.config.source)
    memory = memory or MemoryGuard.for_agent(agent)
    need = memory.need_of(version, placements=devices, providers=chosen, agent_cap=agent.gpu_mem_limit)
    with memory.loading(need) as loading:
        runners = []
        for index, device in enumerate(devices):
            try:
                runners.append(create_runner(version, intra_op_threads=threads,
                                             inter_op_threads=agent.inter_op_threads, providers=agent.providers,
                                             gpu_mem_limit=need.cap, device_id=device,
                                             state_dir=agent.state_dir, memory_checked=True))  # fmt: skip
            except RunnerError as exc:
                field = pinning_field(message, count, index) if on_gpu else None
                if field is None:
                    raise
                raise RunnerError(f"{exc} (config field '{field}' of {version.config.source} pins instance {index} "
                                  f"to GPU {device})") from exc  # fmt: skip
        profile = runners[0].warm_up(warmup_batch_sizes(max(1, version.config.max_batch_size)))
        scheduler = Scheduler(scheduler_config(version.config, agent), profile)
        worker = ModelWorker(scheduler, list(runners), profile, batching=version.config.max_batch_size > 0,
                             name=f"{version.config.name}-v{version.version}")  # fmt: skip
        providers = tuple(runners[0].providers)
        model = LoadedModel(version.config, version.version, worker, providers,
                            completed_config(message, version.config, providers))  # fmt: skip
        loading.done(model)
    placed = f" (instances on devices {list(devices)})" if set(devices) != {agent.device_id} else ""
    log.info("loaded %s v%d on %s%s; warm-up %s", version.config.name, version.version, list(providers), placed,
             {k: f"{v * 1e3:.2f} ms" for k, v in profile.snapshot().items()})  # fmt: skip
    return model


def build_registry(agent: AgentConfig) -> ModelRegistry:
    """Load every served version and log each model's config hints once; `default_versions` that name no served
    version are refused at start. The registry keeps where its models came from, for the repository extension."""
    from edge_agent.runtime.config import log_config_hints, read_config_message
    from edge_agent.runtime.repository import generative_models
    from edge_agent.serving.models import ModelSource
    from edge_agent.serving.triton_config import generative_config

    repository = load_repository(agent.model_repository)
    unknown = sorted(set(agent.default_versions) - set(repository.models))
    if unknown:
        raise ModelConfigError(f"agent config default_versions: no model(s) {unknown} in {agent.model_repository}")
    decoders: dict[str, tuple[Any, tuple[str, ...], str]] = {}  # name -> (config message, providers, version)
    found = generative_models(agent.model_repository)
    if found:
        import onnxruntime as ort

        from edge_agent.runtime.runner import PREFERRED_PROVIDERS, choose_providers

        wanted = agent.providers or [p for p in PREFERRED_PROVIDERS if p != "TensorrtExecutionProvider"]
        chosen = tuple(choose_providers(ort.get_available_providers(), wanted))  # as generation/load.py chooses
        for name, decoder in found.items():
            message = None if decoder.config is None else read_config_message(decoder.config)
            decoders[name] = (message, chosen, decoder.folder.name)
    memory = MemoryGuard.for_agent(agent)  # one per agent: its GPU budget counts every model it loads
    memory.starting = True
    try:
        models = [load_model(version, agent, memory) for version in repository]
    finally:
        memory.starting = False
    try:
        registry = ModelRegistry(models, defaults=agent.default_versions)
    except UnknownModelError as exc:
        for model in models:
            model.worker.close()
        raise ModelConfigError(f"agent config default_versions: {exc}") from None
    for name in registry.names():
        first = registry.of(name)[0]
        log_config_hints(name, read_config_message(first.config), first.providers)
    for name, (message, chosen, _) in decoders.items():
        log_config_hints(name, message, chosen)
    registry.memory = memory
    registry.source = ModelSource(
        agent.model_repository,
        load=lambda version: load_model(version, agent, memory),
        check_fits=lambda version: check_variant_fits(version, agent, memory),
        defaults=dict(agent.default_versions),
        generative={name: generative_config(name, version, message, chosen)
                    for name, (message, chosen, version) in decoders.items()},
    )  # fmt: skip
    return registry


def load_variant(version: ModelVersion, agent: AgentConfig, memory: MemoryGuard | None = None) -> LoadedModel:
    """Load a version a policy asks for, which the start-up checks may not have seen: check its graph first."""
    if version.path.name == "model.onnx":
        check_onnx_graph(version.config, version.path)
    return load_model(version, agent, memory)


def check_variant_fits(version: ModelVersion, agent: AgentConfig, memory: MemoryGuard | None = None) -> None:
    """Refuse (GpuMemoryError, HostMemoryError, GpuBudgetError) a version that would not fit beside the loaded ones,
    on each device its instances are placed on (`instance_group.gpus`; else the agent's `device_id`), under its
    `gpu_mem_limit` and the agent's GPU budget."""
    import onnxruntime as ort

    from edge_agent.runtime.config import placed_devices, read_config_message
    from edge_agent.runtime.runner import runner_providers

    providers = runner_providers(version, ort.get_available_providers(), agent.providers)
    devices = placed_devices(read_config_message(version.config), version.config.instance_count, agent.device_id)
    memory = memory or MemoryGuard.for_agent(agent)
    memory.check(memory.need_of(version, placements=devices, providers=providers, agent_cap=agent.gpu_mem_limit))


def load_decoder_version(name: str, model: GenerativeModel, version: int, agent: AgentConfig,
                         memory: MemoryGuard | None = None) -> EnginePool:  # fmt: skip
    """Load another version of a generative model (a policy's variant, or the default again), with the model's
    config and the agent's settings; `memory` checks its need (weights, measured at an earlier load or estimated,
    plus its KV budget) against the free memory, its cap and the GPU budget before it loads (GpuMemoryError,
    HostMemoryError), and the load itself the KV budget against the memory free then (ModelConfigError)."""
    from edge_agent.generation.load import load_engine

    folder = model.folder.parent / str(version)
    return load_engine(name, folder, agent.generation, model=model.config, threads=agent.intra_op_threads,
                       providers=agent.providers, device_id=agent.device_id, gpu_mem_limit=agent.gpu_mem_limit,
                       memory=memory or MemoryGuard.for_agent(agent))  # fmt: skip


@dataclass
class Agent:
    """The serving app and everything that changes it while it serves."""

    config: AgentConfig
    registry: ModelRegistry
    app: InferenceApp
    applier: PolicyApplier
    responses: ResponseCache
    telemetry: LiveTelemetry  # always: /metrics, and the OTLP push where one is configured
    poller: PolicyPoller | None
    forwarder: Forwarder | None = None
    jobs: AsyncQueue | None = None
    engines: dict[str, EnginePool] = field(default_factory=dict)
    tenants: TenantRegistry | None = None

    def status(self) -> dict[str, Any]:
        """The body of `GET /v2/spillway/status`."""
        return {
            "agent_id": self.telemetry.base.agent_id,  # as the telemetry and the poller name it
            "role": self.config.role,
            "ready": self.app.ready,
            **self.applier.json(),
            "poll": None if self.poller is None else self.poller.json(),
            "fallback_cache": self.responses.json(),
            "overflow": None if self.forwarder is None else self.forwarder.json(),
            "async_jobs": None if self.jobs is None else self.jobs.json(),
            "outcomes": [
                {"model": m.config.name, "version": m.version, "priority": priority, "outcome": outcome, "count": count}
                for m in self.registry.all()
                for (priority, outcome), count in sorted(m.worker.stats.outcomes.items())
            ],
            "telemetry": self.telemetry.json(),
            "generative": self.applier.generative_json(),
            "tenants": None if self.tenants is None else self.tenants.json(),
        }

    async def start(self) -> None:
        """Before the first request: the cached policy (when a control plane is configured), then the poller."""
        if self.poller is not None:
            try:
                await self.applier.apply_cached()
            except Exception:  # a bug of ours must not keep the agent from serving with its local configuration
                log.exception("applying the cached policy failed; serving with the local configuration")
            self.poller.start()
        if self.jobs is not None:
            self.jobs.start()

    async def stop(self) -> None:
        if self.poller is not None:
            await self.poller.stop()
        if self.jobs is not None:
            await self.jobs.stop()
        if self.forwarder is not None:
            await self.forwarder.close()
        await self.applier.close()

    def close(self) -> None:
        """After serving: stop every worker and flush telemetry."""
        for worker in self.registry.workers():
            worker.close()
        for engine in self.engines.values():
            engine.close()
        self.telemetry.shutdown()


def _default_outputs(config: AgentConfig, registry: ModelRegistry,
                     generative: Collection[str] = ()) -> dict[str, dict[str, np.ndarray]]:  # fmt: skip
    """`overflow.default_outputs`, checked against each model's outputs (ModelConfigError names what is wrong)."""
    found = {}
    for name, raw in config.overflow.default_outputs.items():
        if name not in registry.names():
            raise ModelConfigError(f"agent config overflow.default_outputs: no model {name!r} is served")
        try:
            found[name] = validate_default_outputs(f"overflow.default_outputs[{name!r}]", registry.of(name)[0].config,
                                                   raw)  # fmt: skip
        except PolicyRefused as exc:
            raise ModelConfigError(f"agent config {exc}") from None
    unknown = sorted(set(config.async_jobs.models) - set(registry.names()) - set(generative))
    if unknown:
        raise ModelConfigError(f"agent config async_jobs.models: no model(s) {unknown} are served")
    return found


def _breaker_config(config: AgentConfig) -> Any:
    from edge_agent.overflow.breaker import BreakerConfig

    return BreakerConfig(**config.overflow.breaker.model_dump())


def build_agent(config: AgentConfig, registry: ModelRegistry) -> Agent:
    """Wire the app, the policy applier, the fallback cache, telemetry, overflow, the async queue and (with a
    control plane) the poller."""
    try:
        settings = config.telemetry()
    except ValueError as exc:  # an OTEL_* variable the agent cannot use
        raise ModelConfigError(f"telemetry: {exc}") from None
    generative = _generative_models(config)
    defaults = _default_outputs(config, registry, generative)
    gateway = config.gateway()
    local_overflow = None
    if config.overflow.enabled and gateway is not None:
        local_overflow = Overflow(fraction=config.overflow.fraction, at_or_below=config.overflow.at_or_below)
    served = {
        name: ServedModel(
            config=registry.of(name)[0].config,
            default_version=registry.default_version(name),
            configured_versions=tuple(registry.versions(name)),
            repository=config.model_repository,
            overflow=local_overflow,
        )
        for name in registry.names()
    }
    engines = _generative(config, generative, registry.memory)
    decoders = {name: ServedDecoder(model.folder.parent, int(model.folder.name), overflow=local_overflow)
                for name, model in generative.items()}  # fmt: skip
    tenants = _tenants(config)
    agent_id = settings.agent_id  # the config's; else OTEL_RESOURCE_ATTRIBUTES' service.instance.id; else the host
    polling = config.control_plane is not None and config.agent_token is not None
    applier = PolicyApplier(
        registry,
        served,
        load=lambda version: load_variant(version, config, registry.memory),
        check_fits=lambda version: check_variant_fits(version, config, registry.memory),
        cache=PolicyCache(config.state_dir, agent_id) if polling else None,
        agent_id=agent_id,
        engines=engines,
        decoders=decoders,
        load_engine=lambda name, version: load_decoder_version(
            name, generative[name], version, config, registry.memory
        ),
        tenants=tenants,
    )

    def weigh(weights: dict[str, float]) -> None:
        """The tenants' weights to every scheduler that serves them: V2 workers (retiring ones too) and pools."""
        for worker in registry.workers():
            worker.set_weights(weights)
        for pool in [*engines.values(), *applier.retiring_engines]:
            pool.set_weights(weights)

    weigh(tenants.weights())
    tenants.on_change(weigh)
    from edge_agent.telemetry import LiveTelemetry, TelemetryConfigError
    from edge_agent.telemetry.otlp import describe

    try:  # always: /metrics needs no destination
        telemetry = LiveTelemetry(settings, registry, policy=lambda: (applier.plan.version or 0, applier.plan.source),
                                  engines=engines, tenant_label=tenants.label)  # fmt: skip
    except TelemetryConfigError as exc:
        raise ModelConfigError(f"telemetry: {exc}") from None
    applier.telemetry = telemetry
    if settings.destinations():
        log.info("metrics at GET /metrics, and pushed every %g s as agent %s to %s", settings.export_interval_s,
                 settings.agent_id, describe(settings))  # fmt: skip
    else:
        log.info("metrics at GET /metrics (to push them too: otlp_endpoints, or OTEL_EXPORTER_OTLP_ENDPOINT)")
    poller = None
    if polling:
        from edge_agent.policy.client import PolicyPoller

        assert config.control_plane is not None and config.agent_token is not None
        poller = PolicyPoller(config.control_plane, agent_id, config.agent_token.get_secret_value(), applier,
                              interval_s=config.policy_poll_interval_s)  # fmt: skip
    responses = ResponseCache(config.fallback_cache_bytes, ttl_s=config.overflow.cache_ttl_s)
    forwarder = None
    if gateway is not None and config.agent_token is not None:
        from edge_agent.overflow.forward import Forwarder

        def breaker_changed(old: str, new: str, reason: str) -> None:
            log.warning("overflow breaker %s -> %s: %s", old, new, reason)

        forwarder = Forwarder(gateway, config.agent_token.get_secret_value(), breaker=_breaker_config(config),
                              max_in_flight=config.overflow.max_in_flight,
                              default_timeout_s=config.overflow.default_timeout_s,
                              on_breaker_change=breaker_changed)  # fmt: skip
    jobs = None
    if config.async_jobs.models:
        from edge_agent.overflow.jobs import JobStore
        from edge_agent.overflow.queue import AsyncQueue

        store = JobStore(config.state_dir / f"jobs-{_safe(agent_id)}.sqlite", max_jobs=config.async_jobs.max_jobs,
                         ttl_s=config.async_jobs.ttl_s)  # fmt: skip
        if not store.opened:  # a full disk, say: serve without it, try again on each use (jobs.py)
            log.warning("the async job store %s cannot be opened now; requests that reach it are refused "
                        "(async_storage_full or async_storage_unavailable) until it can", store.path)  # fmt: skip
        jobs = AsyncQueue(store, registry, config.async_jobs.models, drain_below=config.async_jobs.drain_below,
                          allow_non_finite=config.allow_non_finite)  # fmt: skip
    openai = None
    if engines:
        from edge_agent.serving.openai_api import OpenAIApi

        openai = OpenAIApi(engines, max_body_bytes=config.max_body_bytes,
                           default_max_tokens=config.generation.default_max_tokens, policy=applier,
                           forwarder=forwarder, cache_bytes=config.fallback_cache_bytes,
                           cache_ttl_s=config.overflow.cache_ttl_s, jobs=jobs, tenants=tenants)  # fmt: skip
    app = InferenceApp(
        registry,
        token=config.token.get_secret_value() if config.token else None,
        max_body_bytes=config.max_body_bytes,
        allow_non_finite=config.allow_non_finite,
        policy=applier,
        responses=responses,
        forwarder=forwarder,
        default_outputs=defaults,
        jobs=jobs,
        openai=openai,
        tenants=tenants,
    )
    app.engines = engines
    app.metrics = telemetry.metrics_text
    app.control.on_loaded.append(telemetry.attach)
    app.control.on_loaded.append(lambda model: model.worker.set_weights(tenants.weights()))
    agent = Agent(config, registry, app, applier, responses, telemetry, poller, forwarder, jobs, engines, tenants)
    app.status = agent.status
    app.on_startup.append(agent.start)
    app.on_shutdown.append(agent.stop)
    return agent


def _tenants(config: AgentConfig) -> TenantRegistry:
    """The configured tenants and the operator's token (ModelConfigError: a tenant has the operator's token)."""
    try:
        return TenantRegistry(config.tenant_list(), config.token.get_secret_value() if config.token else None)
    except ValueError as exc:
        raise ModelConfigError(f"agent config tenants: {exc}") from None


def _generative_models(config: AgentConfig) -> dict[str, GenerativeModel]:
    from edge_agent.runtime.repository import generative_models

    return generative_models(config.model_repository)


def _generative(config: AgentConfig, found: dict[str, GenerativeModel],
                memory: MemoryGuard | None = None) -> dict[str, EnginePool]:  # fmt: skip
    """An engine for each generative model of the repository (ModelConfigError naming what does not fit; memory
    errors from the agent's guard)."""
    if not found:
        return {}
    from edge_agent.generation.load import load_engine

    engines: dict[str, EnginePool] = {}
    for name, model in found.items():
        engines[name] = load_engine(name, model.folder, config.generation, model=model.config,
                                    threads=config.intra_op_threads, providers=config.providers,
                                    device_id=config.device_id, gpu_mem_limit=config.gpu_mem_limit,
                                    memory=memory)  # fmt: skip
    return engines


def _safe(agent_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in agent_id)


class DrainingServer(GracefulServer):
    """On SIGTERM/SIGINT: stop admitting (new requests get 503 `draining` with `Connection: close`), answer everything
    queued, then close the listener and each connection between two requests (GracefulServer), then exit. The gRPC
    server and the legacy port (`side`) close with the HTTP listener. One deadline, `drain_timeout_s` after the
    signal, bounds it all: the queues' drain, the connections' and the RPCs' each get only the time left."""

    def __init__(self, config: uvicorn.Config, app: InferenceApp, drain_timeout_s: float,
                 applier: PolicyApplier | None = None, side: SidePorts | None = None) -> None:  # fmt: skip
        """`side`: the gRPC server and the legacy port (ports.py), bound before the app starts, started after it,
        drained with it."""
        super().__init__(config, close_timeout_s=drain_timeout_s)
        self.inference = app
        self.applier = applier
        self.drain_timeout_s = drain_timeout_s
        self.side = side
        self._side_drained: asyncio.Task[None] | None = None
        self._deadline: float | None = None  # time.monotonic() by which the drain ends, set at the first signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.drain_timeout_s
        super().handle_exit(sig, frame)

    def _time_left(self) -> float:
        """Seconds to the drain's deadline (from now, when the drain did not start with a signal)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.drain_timeout_s
        return max(0.0, self._deadline - time.monotonic())

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.side is not None:
            await self.side.bind(self.config.port)  # PortUnavailable: a start error, before the app starts
        await super().startup(sockets=sockets)
        if self.started and self.side is not None:
            await self.side.start(self.servers[0].sockets[0].getsockname()[1])

    async def quiesce(self, deadline: float) -> None:
        await super().quiesce(min(deadline, time.monotonic() + self._time_left()))

    async def close_listeners(self) -> None:
        await super().close_listeners()
        if self.side is not None:  # new RPCs refused from now on; those in flight end by the deadline
            self.side.close_listeners()
            self._side_drained = asyncio.ensure_future(self.side.drain(self._time_left()))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.side is not None:
            if self._side_drained is not None and not self.force_exit:  # a second signal: no more waiting
                await asyncio.wait([self._side_drained], timeout=self._time_left())
            await self.side.close(0.0 if self.force_exit else min(1.0, self._time_left()))
        await super().shutdown(sockets=sockets)

    async def before_close(self) -> None:
        self.inference.ready = False
        if self.applier is not None:
            self.applier.closing = True  # no variant is loaded or switched to while draining
        workers = self.inference.registry.workers()  # retiring versions too: they still answer their queues
        engines = self.inference.engines.values()  # every running stream ends, with its tokens
        try:
            await asyncio.wait_for(asyncio.gather(*(w.drain() for w in workers), *(e.drain() for e in engines)),
                                   self._time_left())  # fmt: skip
            log.info("drained: every queued request was answered")
        except asyncio.TimeoutError:
            log.warning("drain timed out after %.0f s", self.drain_timeout_s)


def serve(config: AgentConfig, *, registry: ModelRegistry | None = None, ports: Ports | None = None,
          log_level: str = "info") -> None:  # fmt: skip
    """Serve until SIGTERM/SIGINT: HTTP on `port`, V2 gRPC on `grpc_port` and, for one release, the pre-0.2 HTTP port
    (ports.py). `ports`: as `check_ports` found them before the models loaded (else planned here). PortUnavailable (a
    ModelConfigError, exit 2): a port the config names cannot be served."""
    from edge_agent.serving.ports import SidePorts, plan_ports

    ports = ports or plan_ports(config)
    agent = build_agent(config, registry or build_registry(config))
    options: dict[str, Any] = {"host": config.host, "port": config.port, "log_level": log_level,
                               "access_log": False, "server_header": False, "lifespan": "on"}  # fmt: skip
    side = None
    if ports.grpc is not None or ports.legacy is not None:
        side = SidePorts(ports, agent.app, max_body_bytes=config.max_body_bytes)
    server = DrainingServer(uvicorn.Config(agent.app, **options), agent.app, config.drain_timeout_s, agent.applier,
                            side)  # fmt: skip
    try:
        server.run()
    finally:
        agent.close()
