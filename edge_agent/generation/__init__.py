"""Generative models on the agent (ARCHITECTURE.md, "Generative serving"). So far: KV-cache memory in blocks
(`blocks`) and the decoder runner on a plain onnxruntime session with explicit past/present tensors (`runner`:
chunked prefill, batched decode of sequences of different lengths). The iteration-level scheduler, sampling,
tokenizer and chat templates and the OpenAI-compatible APIs are to come (issue 13). Importing this package does not
load onnxruntime; building a `DecoderRunner` does."""

from edge_agent.generation.blocks import BlockManager, KvBudgetError, KvShape, blocks_for_budget
from edge_agent.generation.runner import DecoderConfig, DecoderRunner, GenerationConfigError, SequenceCache

__all__ = [
    "BlockManager",
    "DecoderConfig",
    "DecoderRunner",
    "GenerationConfigError",
    "KvBudgetError",
    "KvShape",
    "SequenceCache",
    "blocks_for_budget",
]
