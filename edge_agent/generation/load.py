"""Building a generative model's engine from its directory, its model config and the agent's `generation` settings:
the decoder runner, the text codec, the KV budget checked against the memory that is free at load, and the scheduler.

A model config (`platform: "onnxruntime_decoder"`) overrides the agent's settings for that model: any key of the
agent's `generation` settings as a Triton `parameters` entry (string values, as Triton writes them), and the
priority levels, the default level and each level's default first-token timeout and queue cap from
`dynamic_batching` (`priority_levels`, `default_priority_level`, `default_queue_policy`, `priority_queue_policy`)."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

import pydantic

from edge_agent.config import GenerationSettings
from edge_agent.generation.blocks import BlockManager, KvBudgetError, blocks_for_budget
from edge_agent.generation.engine import GenerationEngine
from edge_agent.generation.runner import DecoderConfig, DecoderRunner
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler
from edge_agent.generation.text import TextCodec
from edge_agent.runtime.config import ModelConfigError
from edge_agent.scheduling.core import level_policies
from spillway.contract.spec import ModelConfig

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
        where = ".".join(str(p) for p in problem["loc"]) or "dynamic_batching"
        raise ModelConfigError(f"{model.source}: parameters[{where!r}]: {problem['msg']}") from None


def load_engine(name: str, folder: Path, agent_settings: GenerationSettings, *, model: ModelConfig | None = None,
                threads: int = 0, free_bytes: int | None = None) -> GenerationEngine:  # fmt: skip
    """The engine of the model in `folder` (one version's directory), with the agent config's `generation`
    settings and what its model config says instead; raises ModelConfigError naming what does not fit."""
    settings = generation_settings(agent_settings, model)
    batching = None if model is None else model.dynamic_batching
    if free_bytes is None:
        from edge_agent.runtime.memory import available_host_memory

        free_bytes = available_host_memory()
    try:
        config = DecoderConfig.load(folder)
        text = TextCodec.load(folder)
        blocks = blocks_for_budget(config.kv, settings.block_size, context=config.context,
                                   budget_bytes=settings.kv_budget_bytes,
                                   share=None if settings.kv_budget_bytes else settings.kv_budget_share,
                                   free_bytes=free_bytes)  # fmt: skip
        runner = DecoderRunner(config, threads=threads)
    except (KvBudgetError, ValueError) as exc:
        raise ModelConfigError(f"generative model {name!r}: {exc}") from None
    scheduler = GenerationScheduler(
        GenerationConfig(max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                         long_prefill_threshold=settings.long_prefill_threshold, levels=settings.levels,
                         default_level=settings.default_level, queue_policy=settings.queue_policy,
                         aging_s=settings.aging_s,
                         level_policies=level_policies(batching) if batching and batching.priority_levels else ()),
        BlockManager(blocks, settings.block_size),
    )  # fmt: skip
    log.info("generative model %s: %d KV blocks of %d tokens (%d bytes a token), context %d", name, blocks,
             settings.block_size, config.kv.bytes_per_token, config.context)  # fmt: skip
    return GenerationEngine(name, runner, text, scheduler, context=config.context, eos=config.eos_ids,
                            version=folder.name)  # fmt: skip
