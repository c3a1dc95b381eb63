"""Generative models on the agent (ARCHITECTURE.md, "Generative serving"). So far:

- `blocks`: KV-cache memory in blocks;
- `runner`: the decoder on a plain onnxruntime session with explicit past/present tensors (chunked prefill, one
  batched decode over sequences of different lengths);
- `sampling`: greedy, temperature, top-k and top-p, seeded per sequence;
- `text`: the tokenizer, chat template and incremental detokenization;
- `engine`: the engine thread that owns the runner and steps the scheduler, and the streams it feeds;
- `scheduler`: the iteration-level scheduler core (decode first, prompt chunks in a token budget, `max_num_seqs`,
  preemption by recompute, admission on the predicted first token).

The OpenAI-compatible and Triton generate APIs, the GenAI metrics and the demo act are to come (issue 13).
Importing this package does not load onnxruntime; building a `DecoderRunner` does."""

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
