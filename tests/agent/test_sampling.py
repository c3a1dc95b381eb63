"""Sampling the next token: greedy is the argmax, a seed reproduces, top-k and top-p keep what they say, and the
draws follow the softmax of the logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from edge_agent.generation.sampling import Sampler, SamplingParams

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))


def _draws(params: SamplingParams, n: int = 4000) -> Counter[int]:
    sampler = Sampler(params)
    return Counter(sampler.sample(LOGITS) for _ in range(n))


def test_greedy_is_the_argmax() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1
    assert Sampler(SamplingParams(top_k=1, seed=3)).sample(logits) == 1


def test_a_seed_reproduces_the_same_tokens() -> None:
    first, second = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    assert [first.sample(LOGITS) for _ in range(50)] == [second.sample(LOGITS) for _ in range(50)]


def test_draws_follow_the_softmax() -> None:
    counts = _draws(SamplingParams(seed=1))
    for token, p in enumerate(np.exp(LOGITS)):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_and_top_p_keep_only_the_most_likely() -> None:
    assert set(_draws(SamplingParams(top_k=2, seed=2))) == {0, 1}
    assert set(_draws(SamplingParams(top_p=0.7, seed=3))) == {0, 1}  # 0.5 + 0.25 reaches 0.7
    assert set(_draws(SamplingParams(top_p=0.5, seed=4))) == {0}  # the first token alone reaches 0.5
    counts = _draws(SamplingParams(top_k=2, seed=5))
    assert abs(counts[0] / 4000 - 2 / 3) < 0.03  # renormalised over the two kept


def test_a_low_temperature_sharpens_and_a_high_one_flattens() -> None:
    cold, hot = _draws(SamplingParams(temperature=0.3, seed=6)), _draws(SamplingParams(temperature=2.0, seed=7))
    assert cold[0] > 3600 and hot[0] < 2000


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
    ],
)
def test_bad_parameters_are_refused_by_name(field: str, value: float, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SamplingParams(**{field: value})
