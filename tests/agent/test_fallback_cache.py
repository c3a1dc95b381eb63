"""The fallback cache's time to live: stale answers are never served, and the byte bound holds with a TTL."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.overflow.fallback import ResponseCache, inputs_key


class FakeClock:
    def __init__(self, now: float = 500.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return inputs_key("mlp", 1, {"input": np.full((1, 4), float(i), np.float32)})


ROW = {"output": np.zeros((1, 1000), np.float32)}  # 4000 bytes, plus the entry's overhead


def test_an_answer_is_served_for_ttl_s_after_it_was_stored_then_dropped() -> None:
    clock = FakeClock()
    cache = ResponseCache(1 << 20, ttl_s=10.0, clock=clock)
    cache.put(key(0), ROW)
    clock.now += 9.999
    assert cache.get(key(0)) is not None  # reading it does not make it fresher
    clock.now += 0.001
    assert cache.get(key(0)) is None
    assert len(cache) == 0 and cache.bytes == 0  # dropped on access, its bytes given back
    assert cache.json() == {"capacity_bytes": 1 << 20, "bytes": 0, "entries": 0, "hits": 1, "misses": 1,
                            "expired": 1, "ttl_s": 10.0}  # fmt: skip


def test_storing_the_same_inputs_again_restarts_the_clock() -> None:
    clock = FakeClock()
    cache = ResponseCache(1 << 20, ttl_s=10.0, clock=clock)
    cache.put(key(0), ROW)
    clock.now += 8
    cache.put(key(0), {"output": np.ones((1, 1000), np.float32)})
    clock.now += 8
    found = cache.get(key(0))
    assert found is not None and found["output"][0, 0] == 1.0
    assert len(cache) == 1


def test_without_a_ttl_answers_never_go_stale() -> None:
    clock = FakeClock()
    cache = ResponseCache(1 << 20, clock=clock)
    cache.put(key(0), ROW)
    clock.now += 1e9
    assert cache.get(key(0)) is not None and cache.json()["ttl_s"] is None


def test_the_byte_bound_and_lru_order_hold_with_a_ttl() -> None:
    clock = FakeClock()
    cache = ResponseCache(3 * 4300, ttl_s=60.0, clock=clock)
    for i in range(3):
        assert cache.put(key(i), ROW)
        clock.now += 1
    assert cache.get(key(0)) is not None  # the most recently used now, though the oldest stored
    cache.put(key(3), ROW)  # evicts key 1, the least recently used
    assert cache.get(key(1)) is None and len(cache) == 3 and cache.bytes <= cache.capacity_bytes
    for i in range(4, 40):  # many more than fit, stale or not
        cache.put(key(i), ROW)
        clock.now += 10
        assert cache.bytes <= cache.capacity_bytes and len(cache) <= 3
    assert not cache.put(key(99), {"output": np.zeros((4, 1000), np.float32)})  # larger than the whole cache


@pytest.mark.parametrize("ttl_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_ttl_must_be_a_positive_number_of_seconds(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        ResponseCache(1024, ttl_s=ttl_s)
