"""Compute time per batch size: seeded by a warm-up, interpolated between sizes, refined online by EWMA.

The batcher asks `predict` on its hot path (how long would a batch of n take?) while executors `observe` the
batches they ran. The table is swapped as one immutable tuple, so readers never see it half-updated.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping


def warmup_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `max_batch_size` (just 1 for a model that does not batch)."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch_size:
        sizes.append(sizes[-1] * 2)
    if max_batch_size > 1:
        sizes.append(max_batch_size)
    return tuple(sizes)


class ComputeProfile:
    """Predicted seconds of compute per batch size: piecewise linear between measured sizes, EWMA-refined."""

    def __init__(self, seconds_by_batch_size: Mapping[int, float], *, alpha: float = 0.2) -> None:
        """Args: seconds_by_batch_size: warm-up measurements (at least one); alpha: weight of each new observation."""
        if not seconds_by_batch_size:
            raise ValueError("a compute profile needs at least one measured batch size")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        for size, seconds in seconds_by_batch_size.items():
            _check(size, seconds)
        self.alpha = alpha
        ordered = sorted(seconds_by_batch_size.items())
        self._table: tuple[tuple[int, ...], tuple[float, ...]] = (
            tuple(size for size, _ in ordered),
            tuple(float(seconds) for _, seconds in ordered),
        )
        self._write_lock = threading.Lock()  # several instances may observe; readers never take it

    def predict(self, batch_size: int) -> float:
        """Seconds a batch of `batch_size` is expected to take."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        sizes, seconds = self._table
        index = bisect.bisect_left(sizes, batch_size)
        if index < len(sizes) and sizes[index] == batch_size:
            return seconds[index]
        if index == 0:
            return seconds[0]  # smaller than anything measured: a smaller batch is never slower
        if index == len(sizes):
            return _extrapolate(sizes, seconds, batch_size)
        low, high = sizes[index - 1], sizes[index]
        fraction = (batch_size - low) / (high - low)
        return seconds[index - 1] + fraction * (seconds[index] - seconds[index - 1])

    def observe(self, batch_size: int, seconds: float) -> None:
        """Fold one measured batch into the estimate for its size (a new size starts from its prediction)."""
        _check(batch_size, seconds)
        with self._write_lock:
            sizes, table = self._table
            index = bisect.bisect_left(sizes, batch_size)
            if index < len(sizes) and sizes[index] == batch_size:
                updated = (1 - self.alpha) * table[index] + self.alpha * seconds
                self._table = (sizes, (*table[:index], updated, *table[index + 1 :]))
            else:
                updated = (1 - self.alpha) * self.predict(batch_size) + self.alpha * seconds
                self._table = ((*sizes[:index], batch_size, *sizes[index:]), (*table[:index], updated, *table[index:]))

    def snapshot(self) -> dict[int, float]:
        """The current estimate per batch size that has been measured (for stats and logs)."""
        sizes, seconds = self._table
        return dict(zip(sizes, seconds, strict=True))


def _extrapolate(sizes: tuple[int, ...], seconds: tuple[float, ...], batch_size: int) -> float:
    """Beyond the largest measured size: continue the last segment's slope, or scale linearly from one point."""
    if len(sizes) == 1:
        return seconds[0] * batch_size / sizes[0]
    slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
    return seconds[-1] + slope * (batch_size - sizes[-1])


def _check(batch_size: int, seconds: float) -> None:
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"compute time must be a finite number of seconds >= 0, got {seconds}")
