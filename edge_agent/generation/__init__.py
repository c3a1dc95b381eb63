"""Generative models on the agent (ARCHITECTURE.md, "Generative serving"). So far: KV-cache memory in blocks
(`blocks`). The decoder runner, the iteration-level scheduler, sampling and the OpenAI-compatible APIs are to come
(issue 13)."""

from edge_agent.generation.blocks import BlockManager, KvBudgetError, KvShape, blocks_for_budget

__all__ = ["BlockManager", "KvBudgetError", "KvShape", "blocks_for_budget"]
