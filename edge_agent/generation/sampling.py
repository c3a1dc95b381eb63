"""Choosing the next token from a step's logits: greedy (temperature 0), or sampled with temperature, top-k and
top-p (nucleus), reproducibly with a seed. Pure numpy, one `Sampler` per sequence (it owns the sequence's random
generator, so a seeded request gives the same text however it was batched)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI's and vLLM's meanings: `temperature` 0 is greedy; `top_p` 1 and `top_k` 0 (or -1) keep every token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise ValueError(f"temperature must be a number from 0 to 2, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (all tokens) or a positive number of tokens, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        """The next token from one sequence's logits [vocab]."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if p.top_k > 0 and p.top_k < scaled.size:
            cutoff = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled >= cutoff, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p)) + 1]  # the smallest set reaching top_p
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self._rng.choice(probs.size, p=probs))
