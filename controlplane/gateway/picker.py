"""Which of the backends that can take a request gets it: power of two choices by default."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Weighted(Protocol):
    """What a picker looks at: a backend's weight and its requests in flight."""

    @property
    def weight(self) -> float: ...

    @property
    def outstanding(self) -> int: ...


class BackendPicker(Protocol):
    def pick(self, candidates: Sequence[Weighted], rng: random.Random) -> int:
        """The index of the chosen candidate; `candidates` is never empty."""
        ...


def _weighted_index(candidates: Sequence[Weighted], rng: random.Random, skip: int = -1) -> int:
    total = sum(c.weight for i, c in enumerate(candidates) if i != skip)
    point = rng.random() * total
    last = -1
    for i, candidate in enumerate(candidates):
        if i == skip:
            continue
        last = i
        point -= candidate.weight
        if point < 0:
            return i
    return last  # float rounding left a sliver at the end


class PowerOfTwoChoices:
    """Two distinct candidates drawn at random by weight; the one with fewer requests in flight per unit of
    weight wins (ties: the first drawn). Nearly as good as least-loaded, without herding onto one backend."""

    def pick(self, candidates: Sequence[Weighted], rng: random.Random) -> int:
        if len(candidates) == 1:
            return 0
        first = _weighted_index(candidates, rng)
        second = _weighted_index(candidates, rng, skip=first)
        a, b = candidates[first], candidates[second]
        return second if b.outstanding / b.weight < a.outstanding / a.weight else first


class WeightedRandom:
    """One candidate drawn at random by weight, load ignored."""

    def pick(self, candidates: Sequence[Weighted], rng: random.Random) -> int:
        return 0 if len(candidates) == 1 else _weighted_index(candidates, rng)


PICKERS: dict[str, type[BackendPicker]] = {"p2c": PowerOfTwoChoices, "random": WeightedRandom}


def make_picker(name: str) -> BackendPicker:
    try:
        return PICKERS[name]()
    except KeyError:
        raise ValueError(f"unknown backend picker {name!r}: use one of {sorted(PICKERS)}") from None
