"""KV-cache block accounting: what admission reserves, growth takes, and an end gives back, exactly."""

from __future__ import annotations

import random

import pytest

from edge_agent.generation import BlockManager, KvBudgetError, KvShape, blocks_for_budget
from spillway.demo.tiny_lm import TINY

TINY_KV = KvShape(layers=TINY.layers, kv_heads=TINY.kv_heads, head_size=TINY.head_size)


def test_a_prompt_reserves_its_blocks_and_grows_a_block_at_a_time() -> None:
    blocks = BlockManager(total_blocks=10, block_size=16)
    assert blocks.allocate("a", 33)  # 3 blocks: 16 + 16 + 1
    assert len(blocks.blocks_of("a")) == 3 and blocks.free_blocks == 7
    assert blocks.grow("a", 48) and len(blocks.blocks_of("a")) == 3  # the third block fills up: nothing new
    assert blocks.grow("a", 49) and len(blocks.blocks_of("a")) == 4  # the 49th token needs a fourth
    assert blocks.free("a") == 4 and blocks.free_blocks == 10 and not blocks.holds("a")
    assert blocks.free("a") == 0  # ending twice frees nothing twice


def test_nothing_is_taken_when_the_blocks_are_not_free() -> None:
    blocks = BlockManager(total_blocks=4, block_size=8)
    assert blocks.allocate("a", 24)  # 3 of 4
    assert not blocks.can_allocate(9) and not blocks.allocate("b", 9)  # 2 needed, 1 free
    assert not blocks.holds("b") and blocks.free_blocks == 1
    assert blocks.grow("a", 32) and blocks.free_blocks == 0
    assert not blocks.grow("a", 33)  # full: the scheduler must preempt
    assert len(blocks.blocks_of("a")) == 4
    with pytest.raises(ValueError, match="holds blocks already"):
        blocks.allocate("a", 1)


def test_blocks_are_never_shared_and_the_pool_adds_up_under_churn() -> None:
    rng = random.Random(3)
    blocks = BlockManager(total_blocks=64, block_size=16)
    tokens: dict[int, int] = {}
    for step in range(5000):
        choice = rng.random()
        if choice < 0.3:
            if blocks.allocate(step, rng.randint(1, 200)):
                tokens[step] = len(blocks.blocks_of(step)) * 16
        elif choice < 0.8 and tokens:
            seq = rng.choice(list(tokens))
            if blocks.grow(seq, tokens[seq] + rng.randint(1, 20)):
                tokens[seq] = len(blocks.blocks_of(seq)) * 16
        elif tokens:
            seq = rng.choice(list(tokens))
            assert blocks.free(seq) == tokens.pop(seq) // 16
        held = [b for seq in tokens for b in blocks.blocks_of(seq)]
        assert len(held) == len(set(held)) == blocks.used_blocks
        assert blocks.used_blocks + blocks.free_blocks == blocks.total
    assert blocks.json()["sequences"] == len(tokens)


def test_the_budget_in_bytes_or_as_a_share_of_free_memory() -> None:
    per_block = TINY_KV.bytes_per_token * 16
    assert TINY_KV.bytes_per_token == 2 * 3 * 2 * 24 * 4
    assert blocks_for_budget(TINY_KV, 16, context=512, budget_bytes=100 * per_block + 5) == 100
    assert blocks_for_budget(TINY_KV, 16, context=512, share=0.5, free_bytes=200 * per_block) == 100
    with pytest.raises(KvBudgetError, match="not one sequence of the 512-token context"):
        blocks_for_budget(TINY_KV, 16, context=512, budget_bytes=10 * per_block)
    with pytest.raises(KvBudgetError, match="share"):
        blocks_for_budget(TINY_KV, 16, context=512, share=1.5, free_bytes=1 << 30)
    with pytest.raises(KvBudgetError, match="unknown"):
        blocks_for_budget(TINY_KV, 16, context=512, share=0.5, free_bytes=None)
    with pytest.raises(KvBudgetError, match="not both or neither"):
        blocks_for_budget(TINY_KV, 16, context=512)
