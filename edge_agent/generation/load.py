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
    for key in model.parameters:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ModelConfigError(f"{model.source}: parameters[{key!r}]: not a generation setting; {hint}"
                                   f"one of {sorted(fields)}")  # fmt: skip
    merged: dict[str, object] = {**agent.model_dump(), **model.parameters}
    batching = model.dynamic_batching
    if batching is not None and batching.priority_levels:
        for key in ("levels", "default_level"):
            if key in model.parameters:
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
                device_id: int = 0, gpu_mem_limit: int | None = None) -> EnginePool:  # fmt: skip
    """The engines of the model in `folder` (one version's directory): one per instance (its config's
    `instance_group` count; one without a config), each with its own session and an even share of the KV budget,
    with the agent config's `generation` settings and what its model config says instead; raises ModelConfigError
    naming what does not fit.

    Providers: the agent's `providers` where given, else CUDA then CPU, whichever is installed (not TensorRT by
    default: a decoder's shapes change at every step, and each new shape would build a TensorRT engine). On a GPU
    provider the KV budget's share is of the GPU's free memory (NVML), else of the host's (MemAvailable; a Jetson's
    GPU shares it)."""
    settings = generation_settings(agent_settings, model)
    batching = None if model is None else model.dynamic_batching
    count = 1 if model is None else model.instance_count
    chosen = _providers(providers, device_id, gpu_mem_limit)
    try:
        config = DecoderConfig.load(folder)
        text = TextCodec.load(folder)  # shared: the engines only read it, each stream detokenizes on its own
    except ValueError as exc:
        raise ModelConfigError(f"generative model {name!r}: {exc}") from None
    plan = GenerationConfig(max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                            long_prefill_threshold=settings.long_prefill_threshold, levels=settings.levels,
                            default_level=settings.default_level, queue_policy=settings.queue_policy,
                            aging_s=settings.aging_s, level_policies=_levels(batching, settings.levels))  # fmt: skip
    engines = []
    for index in range(count):
        try:
            runner = DecoderRunner(config, threads=threads, providers=chosen)
            free = free_bytes if free_bytes is not None else _free_memory(runner, device_id)
            budget = None if settings.kv_budget_bytes is None else settings.kv_budget_bytes // count
            blocks = blocks_for_budget(runner.kv, settings.block_size, context=config.context, budget_bytes=budget,
                                       share=None if budget else settings.kv_budget_share / count,
                                       free_bytes=free)  # fmt: skip
            _check_working_memory(runner, blocks * settings.block_size, free, gpu_mem_limit)
        except (KvBudgetError, ValueError) as exc:
            raise ModelConfigError(f"generative model {name!r}: {exc}") from None
        scheduler = GenerationScheduler(plan, BlockManager(blocks, settings.block_size))
        log.info("generative model %s instance %d of %d on %s: %d KV blocks of %d tokens (%d bytes a token), "
                 "context %d", name, index + 1, count, runner.session.get_providers()[0], blocks, settings.block_size,
                 runner.kv.bytes_per_token, config.context)  # fmt: skip
        engines.append(GenerationEngine(name, runner, text, scheduler, context=config.context, eos=config.eos_ids,
                                        version=folder.name))  # fmt: skip
    return EnginePool(engines, default_max_tokens=settings.default_max_tokens, fallback_text=settings.fallback_text)


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


def _free_memory(runner: DecoderRunner, device_id: int) -> int | None:
    """Free bytes where the KV cache will live: the GPU's when the session runs on one, else the host's."""
    from edge_agent.runtime.memory import available_host_memory

    if _on_gpu(runner):
        free = gpu.free_gpu_memory(device_id)
        if free is not None:
            return free
    return available_host_memory()
