"""Envoy's retry budget: retries in flight may be at most `budget_percent` of the requests in flight, and never
fewer than `min_retry_concurrency`. When many requests fail at once, most of them answer with their failure
instead of doubling the load on the backends that are left."""

from __future__ import annotations


class RetryBudget:
    def __init__(self, budget_percent: float = 20.0, min_retry_concurrency: int = 3) -> None:
        self.budget_percent = budget_percent
        self.min_retry_concurrency = min_retry_concurrency
        self.active_requests = 0
        self.active_retries = 0

    @property
    def limit(self) -> float:
        return max(float(self.min_retry_concurrency), self.active_requests * self.budget_percent / 100)

    def try_retry(self) -> bool:
        """Take a retry slot if the budget has one; the caller gives it back with `retry_done`."""
        if self.active_retries + 1 > self.limit:
            return False
        self.active_retries += 1
        return True

    def retry_done(self) -> None:
        self.active_retries -= 1
