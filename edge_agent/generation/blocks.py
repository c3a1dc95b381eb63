"""KV-cache memory in fixed blocks (PagedAttention-style accounting): a sequence holds whole blocks of `block_size`
tokens; it reserves its prompt's blocks at admission and one more block whenever its next token needs one; its
blocks return to the pool the moment it ends or is preempted.

The physical cache may be laid out per sequence (the runner's business); this is the budget that admission,
growth and preemption decide on, kept exact: free + used == total at every step. Pure and synchronous, run on
the engine's thread.

Bytes per token = 2 (key and value) x layers x KV heads x head size x dtype size; the budget is a number of bytes or
a share of the memory that is free at model load (NVML on a GPU, MemAvailable on a CPU or a Jetson).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edge_agent.errors import AgentError

__all__ = ["BlockManager", "KvBudgetError", "KvShape", "blocks_for_budget"]


class KvBudgetError(AgentError, ValueError):
    """A KV budget that holds not even one sequence of the model's context, or that is not a budget at all."""


@dataclass(frozen=True)
class KvShape:
    """What one token costs in the cache."""

    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int = 4  # float32; 2 for float16 and bfloat16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * self.dtype_bytes


def blocks_for_budget(
    shape: KvShape,
    block_size: int,
    *,
    context: int,
    budget_bytes: int | None = None,
    share: float | None = None,
    free_bytes: int | None = None,
) -> int:
    """How many blocks the budget holds: `budget_bytes` itself, or `share` (0 < share <= 1) of `free_bytes`.
    Raises KvBudgetError when that is not even one sequence of `context` tokens (the model could never answer a
    long prompt), naming the numbers."""
    if block_size < 1:
        raise KvBudgetError(f"block_size must be at least 1 token, got {block_size}")
    if (budget_bytes is None) == (share is None):
        raise KvBudgetError("give the KV budget as bytes or as a share of free memory, not both or neither")
    if share is not None:
        if not 0 < share <= 1:
            raise KvBudgetError(f"the KV budget's share of free memory must be in (0, 1], got {share}")
        if free_bytes is None:
            raise KvBudgetError("the free memory is unknown here, so a share of it is no budget: give bytes")
        budget_bytes = int(free_bytes * share)
    assert budget_bytes is not None
    blocks = budget_bytes // (shape.bytes_per_token * block_size)
    needed = math.ceil(context / block_size)
    if blocks < needed:
        raise KvBudgetError(
            f"a KV budget of {budget_bytes} bytes holds {blocks} blocks of {block_size} tokens "
            f"({shape.bytes_per_token} bytes a token): not one sequence of the {context}-token context "
            f"({needed} blocks)"
        )
    return blocks


class BlockManager:
    """Blocks by sequence. `allocate` at admission, `grow` before each step that adds tokens, `free` at the end."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        if total_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {total_blocks} blocks of {block_size}")
        self.total = total_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(total_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._held: dict[Any, list[int]] = {}
        self._tokens: dict[Any, int] = {}

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total

    def holds(self, sequence: Any) -> bool:
        return sequence in self._held

    def blocks_of(self, sequence: Any) -> tuple[int, ...]:
        return tuple(self._held.get(sequence, ()))

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def allocate(self, sequence: Any, tokens: int) -> bool:
        """Reserve the blocks of `tokens` (a prompt) for a new sequence; False, and nothing taken, if they are not
        free."""
        if sequence in self._held:
            raise ValueError(f"sequence {sequence!r} holds blocks already")
        needed = self.blocks_for(tokens)
        if needed > len(self._free):
            return False
        self._held[sequence] = [self._free.pop() for _ in range(needed)]
        self._tokens[sequence] = tokens
        return True

    def grow(self, sequence: Any, tokens: int) -> bool:
        """Make room for the sequence to hold `tokens` in all (its next step's); takes a block when the last one is
        full. False, and nothing taken, when no block is free: the scheduler preempts someone, or this one."""
        held = self._held[sequence]
        needed = self.blocks_for(tokens) - len(held)
        if needed > len(self._free):
            return False
        held.extend(self._free.pop() for _ in range(max(0, needed)))
        self._tokens[sequence] = max(tokens, self._tokens[sequence])
        return True

    def free(self, sequence: Any) -> int:
        """Return the sequence's blocks to the pool (it ended, was cancelled or preempted); how many. A sequence that
        holds none frees none."""
        held = self._held.pop(sequence, [])
        self._tokens.pop(sequence, None)
        self._free.extend(reversed(held))
        return len(held)

    def json(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "total": self.total, "used": self.used_blocks,
                "free": self.free_blocks, "sequences": len(self._held)}  # fmt: skip
