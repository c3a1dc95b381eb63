"""Building a generative model's engine from its directory, its model config and the agent's `generation` settings:
the decoder runner, the text codec, the KV budget checked against the memory that is free at load, and the scheduler.

A model config (`platform: "onnxruntime_decoder"`) overrides the agent's settings for that model: any key of the
agent's `generation` settings as a Triton `parameters` entry (string values, as Triton writes them), and the
priority levels, the default level and each level's default first-token timeout and queue cap from
`dynamic_batching` (`priority_levels`, `default_priority_level`, `default_queue_policy`, `priority_queue_policy`)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from pathlib import Path

import pydantic

from edge_agent.config import GenerationSettings
from edge_agent.generation.blocks import BlockManager, KvBudgetError, blocks_for_budget
from edge_agent.generation.engine import GenerationEngine
from edge_agent.generation.pool import EnginePool
from edge_agent.generation.runner import DecoderConfig, DecoderRunner
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler
from edge_agent.generation.text import TextCodec
from edge_agent.runtime import gpu
from edge_agent.runtime.config import ModelConfigError
from edge_agent.runtime.devices import MemoryProbe, default_probe
from edge_agent.runtime.memory import GPU_MEM_LIMIT, MemoryGuard, model_gpu_mem_limit
from edge_agent.runtime.runner import PREFERRED_PROVIDERS, RunnerError, choose_providers, provider_options
from edge_agent.scheduling.core import LevelPolicy, level_policies
from spillway.contract.spec import DynamicBatching, ModelConfig

log = logging.getLogger("spillway.agent.generation")

__all__ = ["generation_settings", "load_engine"]


def generation_settings(agent: GenerationSettings, model: ModelConfig | None) -> GenerationSettings:
    """The agent's settings with what the model's config says instead (ModelConfigError naming the key)."""
    if model is None:
        return agent
    fields = GenerationSettings.model_fields
    parameters = {key: value for key, value in model.parameters.items() if key != GPU_MEM_LIMIT}  # memory.py's
    for key in parameters:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ModelConfigError(f"{model.source}: parameters[{key!r}]: not a generation setting; {hint}"
                                   f"one of {sorted(fields)}")  # fmt: skip
    merged: dict[str, object] = {**agent.model_dump(), **parameters}
    batching = model.dynamic_batching
    if batching is not None and batching.priority_levels:
        for key in ("levels", "default_level"):
            if key in parameters:
                raise ModelConfigError(f"{model.source}: parameters[{key!r}]: dynamic_batching.priority_levels sets "
                                       "the levels already; keep one")  # fmt: skip
        merged["levels"], merged["default_level"] = batching.priority_levels, batching.default_priority_level
    try:
        return GenerationSettings.model_validate(merged)
    except pydantic.ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        if not where:  # a rule between settings: some may be the agent's own or come from dynamic_batching
            raise ModelConfigError(f"{model.source}: parameters (with the agent's generation settings and "
                                   f"dynamic_batching): {problem['msg']}") from None  # fmt: skip
        raise ModelConfigError(f"{model.source}: parameters[{where!r}]: {problem['msg']}") from None


def load_engine(name: str, folder: Path, agent_settings: GenerationSettings, *, model: ModelConfig | None = None,
                threads: int = 0, free_bytes: int | None = None, providers: Sequence[str] | None = None,
                device_id: int = 0, gpu_mem_limit: int | None = None,
                memory: MemoryGuard | None = None) -> EnginePool:  # fmt: skip
    """The engines of the model in `folder` (one version's directory): one per instance (its config's
    `instance_group` count; one without a config), each with its own session and an even share of the KV budget,
    with the agent config's `generation` settings and what its model config says instead; raises ModelConfigError
    naming what does not fit.

    Providers: the agent's `providers` where given, else CUDA then CPU, whichever is installed (not TensorRT by
    default: a decoder's shapes change at every step, and each new shape would build a TensorRT engine). On a GPU
    provider the KV budget's share is of the GPU's free memory, else of the host's (MemAvailable; a Jetson's GPU
    shares it). Each session's CUDA arena is capped by the model config's `gpu_mem_limit` parameter, else by
    `gpu_mem_limit` (the agent's). With `memory` (the agent's guard), the load is first checked against the device's
    free memory, the cap and the agent's GPU budget (GpuMemoryError, HostMemoryError), with the weights' need as
    measured at an earlier load (else estimated from the files) plus the KV budget, and what it takes is measured,
    remembered and held against the budget by the pool returned (release it through the guard when it unloads)."""
    settings = generation_settings(agent_settings, model)
    batching = None if model is None else model.dynamic_batching
    count = 1 if model is None else model.instance_count
    cap, cap_source = model_gpu_mem_limit(model, gpu_mem_limit)
    chosen = _providers(providers, device_id, cap)
    try:
        config = DecoderConfig.load(folder)
        text = TextCodec.load(folder)  # shared: the engines only read it, each stream detokenizes on its own
    except ValueError as exc:
        raise ModelConfigError(f"generative model {name!r}: {exc}") from None
    plan = GenerationConfig(max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                            long_prefill_threshold=settings.long_prefill_threshold, levels=settings.levels,
                            default_level=settings.default_level, queue_policy=settings.queue_policy,
                            aging_s=settings.aging_s, level_policies=_levels(batching, settings.levels))  # fmt: skip
    probe = memory.probe if memory is not None else default_probe()

    def build() -> tuple[EnginePool, int]:
        engines, kv_bytes = [], 0
        for index in range(count):
            try:
                runner = DecoderRunner(config, threads=threads, providers=chosen)
                free = free_bytes if free_bytes is not None else probe.read(device_id, gpu=_on_gpu(runner)).free
                budget = None if settings.kv_budget_bytes is None else settings.kv_budget_bytes // count
                share = None if budget else settings.kv_budget_share / count
                blocks = blocks_for_budget(runner.kv, settings.block_size, context=config.context,
                                           budget_bytes=budget, share=share, free_bytes=free)  # fmt: skip
                _check_working_memory(runner, blocks * settings.block_size, free, cap)
            except (KvBudgetError, ValueError) as exc:
                raise ModelConfigError(f"generative model {name!r}: {exc}") from None
            kv_bytes += blocks * settings.block_size * runner.kv.bytes_per_token
            scheduler = GenerationScheduler(plan, BlockManager(blocks, settings.block_size))
            log.info("generative model %s instance %d of %d on %s: %d KV blocks of %d tokens (%d bytes a token), "
                     "context %d", name, index + 1, count, runner.session.get_providers()[0], blocks,
                     settings.block_size, runner.kv.bytes_per_token, config.context)  # fmt: skip
            engines.append(GenerationEngine(name, runner, text, scheduler, context=config.context,
                                            eos=config.eos_ids, version=folder.name))  # fmt: skip
        pool = EnginePool(engines, default_max_tokens=settings.default_max_tokens,
                          fallback_text=settings.fallback_text)  # fmt: skip
        return pool, kv_bytes

    if memory is None:
        return build()[0]
    gpu_session = any((p if isinstance(p, str) else p[0]) in gpu.GPU_PROVIDERS for p in chosen)
    kv = _kv_estimate(settings, probe, device_id, gpu_session)
    need = memory.need(name, folder.name, folder, placements=[device_id] * count, on_gpu=gpu_session, cap=cap,
                       cap_source=cap_source, kv_bytes=kv)  # fmt: skip
    with memory.loading(need) as loading:
        pool, kv_bytes = build()
        try:
            loading.done(pool, kv_bytes=kv_bytes)
        except BaseException:
            pool.close()
            raise
    return pool


def _kv_estimate(settings: GenerationSettings, probe: MemoryProbe, device_id: int, on_gpu: bool) -> int:
    """The KV budget before the load: its bytes, else its share of the memory free now (0 where that is unknown)."""
    if settings.kv_budget_bytes is not None:
        return settings.kv_budget_bytes
    free = probe.read(device_id, gpu=on_gpu).free
    return 0 if free is None else int(free * settings.kv_budget_share)


# Beside the blocks in use, a decode step holds the batch fed as the past, the present coming back (one token
# longer) and the buffer the next rebuild gathers into: up to about three times the cache, padding aside.
WORKING_FACTOR = 3


def _check_working_memory(runner: DecoderRunner, tokens: int, free: int | None, gpu_mem_limit: int | None) -> None:
    """Refuse a KV budget whose working copies would not fit the free memory (or a GPU session's arena cap)."""
    need = tokens * runner.kv.bytes_per_token * WORKING_FACTOR
    limits = [(free, "the free memory")] + ([(gpu_mem_limit, "gpu_mem_limit")] if _on_gpu(runner) else [])
    for limit, what in limits:
        if limit is not None and need > limit:
            raise KvBudgetError(f"the KV budget ({tokens} tokens, {tokens * runner.kv.bytes_per_token >> 20} MiB) "
                                f"needs about {WORKING_FACTOR}x that while decoding ({need >> 20} MiB), more than "
                                f"{what} ({limit >> 20} MiB): lower kv_budget_bytes or kv_budget_share")  # fmt: skip


def _levels(batching: DynamicBatching | None, levels: int) -> tuple[LevelPolicy, ...]:
    """Each level's queue policy: Triton's per level with `priority_levels`, else its `default_queue_policy` for
    every level (none without `dynamic_batching`)."""
    if batching is None:
        return ()
    if batching.priority_levels:
        return level_policies(batching)
    return level_policies(batching)[:1] * levels


def _providers(requested: Sequence[str] | None, device_id: int,
               gpu_mem_limit: int | None) -> list[str | tuple[str, dict[str, str]]]:  # fmt: skip
    import onnxruntime as ort

    wanted = requested or [p for p in PREFERRED_PROVIDERS if p != "TensorrtExecutionProvider"]
    try:
        chosen = choose_providers(ort.get_available_providers(), wanted)
    except RunnerError as exc:
        raise ModelConfigError(str(exc)) from None
    return [(name, provider_options(name, gpu_mem_limit, device_id)) for name in chosen]


def _on_gpu(runner: DecoderRunner) -> bool:
    """Whether the session runs on a GPU: the provider onnxruntime put first is one of them."""
    return runner.session.get_providers()[0] in gpu.GPU_PROVIDERS
