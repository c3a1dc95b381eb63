"""A tenant's quotas as numbers that change with a clock: requests in flight, a requests-per-second token bucket, a
generative token balance and streams; all pure (the clock is handed in), guarded by the registry's lock."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from spillway.contract.tenants import TenantLimits


class QuotaExceeded(Exception):
    """A request over one of its tenant's quotas: answered 429 with `Retry-After` and reason `tenant_quota`."""

    def __init__(self, tenant: str, quota: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.quota = quota  # max_in_flight | rate_rps | tokens_per_s | max_streams
        self.retry_after_s = max(1, retry_after_s)
        self.message = message


@dataclass
class Bucket:
    """A token bucket: `rate` tokens a second up to `capacity`; the level may go below zero (a debt)."""

    rate: float
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def seconds_until(self, level: float) -> int:
        """Whole seconds (at least 1) until the level reaches `level`."""
        return max(1, math.ceil((level - self.level) / self.rate))

    def resize(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level = min(self.level, capacity)


@dataclass
class TenantState:
    """What one tenant holds now and has been counted for (kept while its leases are out, whatever the policy)."""

    in_flight: int = 0
    streams: int = 0
    admitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # by quota
    requests: Bucket | None = None  # rate_rps
    tokens: Bucket | None = None  # tokens_per_s

    def fit(self, limits: TenantLimits, now: float) -> None:
        """Follow the tenant's limits (a policy may change them): a bucket appears full, resizes, or goes."""
        self.requests = _fit(self.requests, limits.rate_rps, max(1.0, limits.rate_rps or 0.0), now)
        self.tokens = _fit(self.tokens, limits.tokens_per_s, limits.tokens_per_s or 0.0, now)

    def check(self, name: str, limits: TenantLimits, generative: bool, now: float) -> QuotaExceeded | None:
        """Why a new request of this tenant is refused now (None: it may come in). Takes nothing."""
        if limits.max_in_flight is not None and self.in_flight >= limits.max_in_flight:
            return QuotaExceeded(name, "max_in_flight", 1, f"tenant '{name}' has {self.in_flight} requests in flight, "
                                 f"its quota max_in_flight is {limits.max_in_flight}")  # fmt: skip
        if generative and limits.max_streams is not None and self.streams >= limits.max_streams:
            return QuotaExceeded(name, "max_streams", 1, f"tenant '{name}' has {self.streams} streams generating, its "
                                 f"quota max_streams is {limits.max_streams}")  # fmt: skip
        if self.requests is not None:
            self.requests.refill(now)
            if self.requests.level < 1.0:
                message = f"tenant '{name}' is over its quota rate_rps of {limits.rate_rps:g} requests a second"
                return QuotaExceeded(name, "rate_rps", self.requests.seconds_until(1.0), message)
        if generative and self.tokens is not None:
            self.tokens.refill(now)
            if self.tokens.level < 0:
                message = f"tenant '{name}' is over its quota tokens_per_s of {limits.tokens_per_s:g} tokens a second"
                return QuotaExceeded(name, "tokens_per_s", self.tokens.seconds_until(0.0), message)
        return None

    def take(self, generative: bool, tokens: int) -> None:
        self.in_flight += 1
        self.admitted += 1
        if generative:
            self.streams += 1
        if self.requests is not None:
            self.requests.level -= 1.0
        if generative and self.tokens is not None:
            self.tokens.level -= tokens

    def json(self) -> dict[str, object]:
        return {
            "in_flight": self.in_flight,
            "streams": self.streams,
            "admitted": self.admitted,
            "refused": sum(self.refused.values()),
            "refused_by_quota": dict(sorted(self.refused.items())),
        }


def _fit(bucket: Bucket | None, rate: float | None, capacity: float, now: float) -> Bucket | None:
    if rate is None:
        return None
    if bucket is None:
        return Bucket(rate, capacity, capacity, now)
    bucket.refill(now)
    bucket.resize(rate, capacity)
    return bucket
