"""SLO arithmetic, kept pure so that it can be checked against hand-computed cases.

SLI = good / total. Error budget = 1 - objective. Burn rate over a window = (bad / total in the window) / budget:
1 spends the budget exactly over the SLO window, 14.4 spends 2 % of a 30-day budget in one hour. A multiwindow
alert fires when both its long and its short window burn at least at its rate (Google SRE workbook, ch. 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spillway.contract.names import GOOD_OUTCOMES  # available: the caller got an answer it can use


@dataclass(frozen=True)
class Counts:
    good: float = 0.0
    total: float = 0.0

    @property
    def bad(self) -> float:
        return self.total - self.good

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.good + other.good, self.total + other.total)


def sli(counts: Counts) -> float | None:
    """Share of good events; None without events (no traffic is neither good nor bad)."""
    return counts.good / counts.total if counts.total > 0 else None


def error_budget(objective_percent: float) -> float:
    return 1.0 - objective_percent / 100.0


def burn_rate(counts: Counts, objective_percent: float) -> float | None:
    if counts.total <= 0:
        return None
    return (counts.bad / counts.total) / error_budget(objective_percent)


def budget_remaining(counts: Counts, objective_percent: float) -> float | None:
    """Share of the window's error budget not yet spent (negative once overspent)."""
    rate = burn_rate(counts, objective_percent)
    return None if rate is None else 1.0 - rate


def good_under_threshold(buckets: Sequence[float], bounds: Sequence[float], threshold_s: float) -> float:
    """Observations at or under `threshold_s` from explicit-bucket counts (bucket i holds (bounds[i-1], bounds[i]]).

    Only whole buckets count, so a threshold between two boundaries counts the lower one: conservative, never
    reporting a slow request as good. Make SLO thresholds bucket boundaries (the policy pushes them) to be exact.
    """
    good = 0.0
    for count, upper in zip(buckets, bounds, strict=False):
        if upper <= threshold_s * (1 + 1e-9):
            good += count
        else:
            break
    return good


def firing(long_rate: float | None, short_rate: float | None, threshold: float) -> bool:
    return long_rate is not None and short_rate is not None and long_rate >= threshold and short_rate >= threshold


__all__ = [
    "GOOD_OUTCOMES",
    "Counts",
    "budget_remaining",
    "burn_rate",
    "error_budget",
    "firing",
    "good_under_threshold",
    "sli",
]
