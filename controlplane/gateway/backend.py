"""One cloud backend as the gateway sees it: its registered spec, and what the gateway has learnt about it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RECENT = 256
"""Latencies kept per backend for the status page's percentiles."""


@dataclass(frozen=True)
class BackendSpec:
    """A row of the `backends` table, as loaded; `auth_header` is never shown (repr) nor logged."""

    id: str
    name: str
    url: str
    models: tuple[str, ...]
    weight: float = 1.0
    max_concurrency: int = 64
    timeout_ms: int = 10_000
    binary_tensors: bool = True
    auth_header: str | None = field(default=None, repr=False)
    protocol: str = "v2"  # v2 | v2_grpc | openai
    model_map: Mapping[str, str] = field(default_factory=dict, hash=False)  # openai: edge model -> the backend's
    # tenant -> the largest part (0..1] of the backend's max_concurrency that tenant's requests may hold at once
    tenant_share: Mapping[str, float] = field(default_factory=dict, hash=False)

    @property
    def request_protocol(self) -> str:
        """The requests it takes: `v2` (a `v2` backend's, and a `v2_grpc` one's, spoken to it over gRPC) or `openai`.
        Backends are peers (one request may try either) when their request protocol is the same."""
        return "v2" if self.protocol == "v2_grpc" else self.protocol

    def cloud_model(self, model: str) -> str:
        """The backend's name for the edge's `model`."""
        return self.model_map.get(model, model)

    def tenant_limit(self, tenant: str) -> int | None:
        """Requests of `tenant` this backend takes at once: its share of max_concurrency, rounded down, at least
        one; None where its share is not capped."""
        share = self.tenant_share.get(tenant)
        if share is None:
            return None
        return max(1, math.floor(share * self.max_concurrency + 1e-9))


@dataclass(frozen=True)
class Transition:
    """A change worth an event: `backend.ejected`, `backend.returned`, `backend.unhealthy` or `backend.healthy`."""

    kind: str
    backend_id: str
    backend: str
    reason: str
    data: dict[str, Any]


class BackendState:
    """Mutable, owned by the pool; survives reloads of the backends while the id stays."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.outstanding = 0
        self.tenants: dict[str, int] = {}  # requests in flight per tenant (a tenant appears while it has some)
        self.tenant_refused: dict[str, int] = {}  # per tenant named in tenant_share: refused for being at its share
        # Passive outlier detection
        self.consecutive_failures = 0
        self.ejected_at: float | None = None
        self.ejected_until: float | None = None
        self.times_ejected = 0  # the ejection multiplier; decays while the backend stays in
        self.decay_at: float | None = None  # when the multiplier next loses one
        # Active readiness checks, per model
        self.unhealthy: set[str] = set()
        self.checked: set[str] = set()
        self.check_failures: dict[str, int] = {}
        self.check_passes: dict[str, int] = {}
        # What the status page shows
        self.requests = 0
        self.errors = 0
        self.busy = 0  # shed by the backend (503 with Retry-After): not errors
        self.last_error: str | None = None
        self.recent: deque[float] = deque(maxlen=RECENT)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def weight(self) -> float:
        return self.spec.weight

    def within_share(self, tenant: str) -> bool:
        """Whether one more request of `tenant` stays within its share of this backend."""
        limit = self.spec.tenant_limit(tenant)
        return limit is None or self.tenants.get(tenant, 0) < limit

    def ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until

    def percentile_ms(self, q: float) -> float | None:
        """Nearest-rank percentile of the recent attempts' durations, in milliseconds."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
        return ordered[rank] * 1000
