"""Per-model counters in Triton's statistics shape, plus outcomes per priority for the demo and metrics."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from spillway.contract.tenants import DEFAULT_TENANT

log = logging.getLogger("spillway.agent")


class StatsListener(Protocol):
    """Gets every count and duration the statistics get (the agent's OpenTelemetry instruments)."""

    def outcome(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> None: ...

    def durations(self, priority: int, outcome: str, queue_s: float, compute_s: float, total_s: float,
                  tenant: str = DEFAULT_TENANT) -> None: ...  # fmt: skip

    def batch(self, rows: int, compute_s: float, ok: bool) -> None: ...


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """What `/v2/models/{m}/stats` reports (Triton's field names), updated only on the event loop."""

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    rows: int = 0  # reported as Triton's inference_count
    execution_count: int = 0  # batches run
    last_inference_ms: int = 0
    batches: dict[int, _Duration] = field(default_factory=dict)
    outcomes: Counter[tuple[int, str]] = field(default_factory=Counter)
    listener: StatsListener | None = None  # telemetry, when the agent exports metrics

    def outcome(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> None:
        self.outcomes[(priority, outcome)] += 1
        if self.listener is not None:
            self.listener.outcome(priority, outcome, tenant=tenant)

    def request(self, priority: int, outcome: str, queue_s: float, compute_s: float, total_s: float,
                tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        self.outcome(priority, outcome, tenant)
        if self.listener is not None:
            self.listener.durations(priority, outcome, queue_s, compute_s, total_s, tenant=tenant)
        (self.success if outcome == "local" else self.fail).add(total_s)
        self.queue.add(queue_s)

    def answered(self, priority: int, outcome: str, total_s: float, tenant: str = DEFAULT_TENANT) -> None:
        """A request answered without running here (overflow, a fallback, a job accepted): outcome and duration."""
        self.outcome(priority, outcome, tenant)
        if self.listener is not None:
            self.listener.durations(priority, outcome, 0.0, 0.0, total_s, tenant=tenant)

    def batch(self, rows: int, compute_s: float, ok: bool) -> None:
        if self.listener is not None:
            self.listener.batch(rows, compute_s, ok)
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        if ok:
            self.rows += rows
            self.compute_infer.add(compute_s)
            self.batches.setdefault(rows, _Duration()).add(compute_s)

    def json(self, name: str, version: str) -> dict[str, Any]:
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.rows,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.json(),
                "fail": self.fail.json(),
                "queue": self.queue.json(),
                "compute_infer": self.compute_infer.json(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_infer": d.json()} for size, d in sorted(self.batches.items())
            ],
            "outcomes": [{"priority": p, "outcome": o, "count": n} for (p, o), n in sorted(self.outcomes.items())],
        }


class RequestOutcome:
    """The one recorder of one request's outcome: whichever way the request ends (served here, refused, failed,
    overflowed, a fallback, a job accepted), exactly one of these methods counts it, in `stats` (and so in the
    telemetry). A second call is a bug of ours: it is logged and not counted, so the counts stay equal to the
    requests. `level` is 0 until the request's priority is resolved (a request refused before that); `tenant` is the
    tenant it belongs to (telemetry names it, bounded: see AgentTelemetry.tenant_label)."""

    __slots__ = ("arrived", "level", "recorded", "stats", "tenant")

    def __init__(self, stats: ModelStats, level: int = 0, arrived: float | None = None, *,
                 tenant: str = DEFAULT_TENANT) -> None:  # fmt: skip
        self.stats = stats
        self.level = level
        self.arrived = time.monotonic() if arrived is None else arrived
        self.recorded: str | None = None
        self.tenant = tenant

    def _first(self, outcome: str) -> bool:
        if self.recorded is not None:
            log.error("a request counted twice: %s, then %s (a bug; the second is not counted)", self.recorded, outcome)
            return False
        self.recorded = outcome
        return True

    def ran(self, outcome: str, queue_s: float, compute_s: float, total_s: float) -> None:
        """It reached the scheduler: served here (`local`), failed in its batch (`error`) or timed out queued
        (`rejected`), with its queue, compute and total times."""
        if self._first(outcome):
            self.stats.request(self.level, outcome, queue_s, compute_s, total_s, self.tenant)

    def answered(self, outcome: str) -> None:
        """Answered without running here (overflow, a fallback, a job accepted): its time since arrival."""
        if self._first(outcome):
            self.stats.answered(self.level, outcome, time.monotonic() - self.arrived, self.tenant)

    def refused(self, outcome: str = "rejected") -> None:
        """Refused at once (or an error of ours before any work): counted, with no duration."""
        if self._first(outcome):
            self.stats.outcome(self.level, outcome, self.tenant)
