"""Building a generative model's engine from its directory and the agent's `generation` settings: the decoder
runner, the text codec, the KV budget checked against the memory that is free at load, and the scheduler."""

from __future__ import annotations

import logging
from pathlib import Path

from edge_agent.config import GenerationSettings
from edge_agent.generation.blocks import BlockManager, KvBudgetError, blocks_for_budget
from edge_agent.generation.engine import GenerationEngine
from edge_agent.generation.runner import DecoderConfig, DecoderRunner
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler
from edge_agent.generation.text import TextCodec
from edge_agent.runtime.config import ModelConfigError

log = logging.getLogger("spillway.agent.generation")

__all__ = ["load_engine"]


def load_engine(name: str, folder: Path, settings: GenerationSettings, *, threads: int = 0,
                free_bytes: int | None = None) -> GenerationEngine:  # fmt: skip
    """The engine of the model in `folder` (one version's directory), with the agent config's `generation`
    settings; raises ModelConfigError naming what does not fit."""
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
                         default_level=settings.default_level),
        BlockManager(blocks, settings.block_size),
    )  # fmt: skip
    log.info("generative model %s: %d KV blocks of %d tokens (%d bytes a token), context %d", name, blocks,
             settings.block_size, config.kv.bytes_per_token, config.context)  # fmt: skip
    return GenerationEngine(name, runner, text, scheduler, context=config.context, eos=config.eos,
                            version=folder.name)  # fmt: skip
