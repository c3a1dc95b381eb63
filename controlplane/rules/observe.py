"""What each rule's condition sees for each agent it selects, now: whether it is met, and the numbers behind it
(they go into the events, so an operator can tell why a rule fired).

- `burn_rate`: the SLO's burn rate over the condition's long and short windows, for this agent;
- `latency`: the share of this agent's served requests (`request`), or of its generative streams' first tokens
  (`ttft`) or times per output token (`tpot`), within the threshold over the window (the quantile is above the
  threshold exactly when that share is below the quantile, thresholds being bucket boundaries); the SLO windows
  count them (`SloSpec.of_rule`);
- `error_ratio`: the share of this agent's requests with a bad outcome over the window;
- `gauge`: the agent's latest reading (queue depth of the selected models, GPU memory free, temperature,
  utilisation) from the last two minutes of rollups. GPU memory free is the worst device's (per `hw.id`, a MIG
  device being one; readings without it one device): the fewest bytes free, the smallest share free, since a model
  loads on one device and memory free summed over several says nothing about any of them; temperature and
  utilisation are the highest. For generative models (the selected ones, or all): KV-cache use (blocks held / the
  budget's blocks, summed over the models), sequences preempted in the last whole minute (the counter's delta
  rollup: the current minute is still filling), streams in flight. An agent that reported none of a generative
  model's series in the last two minutes has no reading: the condition is not met;
- `stale`: how long since the agent last reported (an agent that never reported is not stale: not yet started).

A ratio condition under its `min_requests` is not met: a quiet device with one slow request is not an incident.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from controlplane.query import Rollup, RollupReader
from controlplane.schemas.rules import (
    BurnRateCondition,
    Condition,
    ErrorRatioCondition,
    GaugeCondition,
    GaugeMetric,
    LatencyCondition,
    StaleCondition,
    unknown_kind,
)
from controlplane.slo import Counts, SloWindows, burn_rate
from spillway.contract.names import (
    ACTIVE_STREAMS,
    ATTR_MODEL,
    DEVICE_GAUGES,
    GENERATION_GAUGES,
    GPU_MEMORY_LIMIT,
    GPU_MEMORY_USAGE,
    GPU_UTILIZATION,
    KV_BLOCKS_TOTAL,
    KV_BLOCKS_USED,
    PREEMPTIONS,
    QUEUE_DEPTH,
    TEMPERATURE,
)

GAUGE_METRICS = (QUEUE_DEPTH, *DEVICE_GAUGES, *GENERATION_GAUGES)
"""The gauges whose latest reading gauge conditions compare."""
COUNTER_METRICS = (PREEMPTIONS,)
"""The counters whose increase over the last whole minute gauge conditions compare (a rate per minute)."""
_OPS = {">": np.greater, ">=": np.greater_equal, "<": np.less, "<=": np.less_equal}


@dataclass(frozen=True)
class Seen:
    met: bool
    numbers: dict[str, Any] = field(default_factory=dict)


def _per_model(readings: dict[str, float], model: str | None) -> float | None:
    """The selected model's reading, or the sum over every model; None when there is none."""
    if model is not None:
        return readings.get(model)
    return sum(readings.values()) if readings else None


ATTR_HW_ID = "hw.id"  # OpenTelemetry's hardware conventions: the device a reading is of
NO_DEVICE = ""
"""The device of GPU memory readings without `hw.id` (from agents or probes that name none): one device."""


@dataclass
class AgentGauges:
    """An agent's latest device, queue and generation readings (per model where the metric has a model, per
    device for GPU memory)."""

    queue_depth: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    gpu_memory_used: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by hw.id
    gpu_memory_limit: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by hw.id
    gpu_utilization: float | None = None
    gpu_temperature_c: float | None = None
    kv_blocks_used: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    kv_blocks_total: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    active_streams: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Preempted in the last whole minute; a model whose counter reported lately but not in that minute has 0.
    preemptions: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def details(self, metric: GaugeMetric, model: str | None) -> dict[str, Any]:
        """The readings a derived value comes from, for the events (KV blocks behind the use ratio, the device
        whose GPU memory is compared and its readings)."""
        if metric == "kv_cache_use_ratio":
            return {"kv_blocks_used": _per_model(self.kv_blocks_used, model),
                    "kv_blocks_total": _per_model(self.kv_blocks_total, model)}  # fmt: skip
        if metric in ("gpu_memory_free_bytes", "gpu_memory_free_ratio"):
            worst = self._worst_device(metric)
            if worst is None:
                return {}
            return {"device": worst or None, "gpu_memory_used": self.gpu_memory_used[worst],
                    "gpu_memory_limit": self.gpu_memory_limit[worst],
                    "devices": len(self._gpu_free(metric))}  # fmt: skip
        return {}

    def _gpu_free(self, metric: GaugeMetric) -> dict[str, float]:
        """Per device with both readings (and, for the ratio, a limit above 0): its free bytes or share free."""
        free: dict[str, float] = {}
        for device, limit in self.gpu_memory_limit.items():
            used = self.gpu_memory_used.get(device)
            if used is None:
                continue
            if metric == "gpu_memory_free_bytes":
                free[device] = limit - used
            elif limit > 0:
                free[device] = 1.0 - used / limit
        return free

    def _worst_device(self, metric: GaugeMetric) -> str | None:
        """The device with the least GPU memory free (by bytes or by share, as `metric` compares); ties: the first
        by id. None when no device has both readings."""
        free = self._gpu_free(metric)
        return min(sorted(free), key=lambda device: free[device]) if free else None

    def value(self, metric: GaugeMetric, model: str | None) -> float | None:
        """The reading a gauge condition compares, for `model` (None: every model); None when there is none."""
        if metric == "kv_cache_use_ratio":
            used, total = _per_model(self.kv_blocks_used, model), _per_model(self.kv_blocks_total, model)
            return None if used is None or not total else used / total
        if metric == "preemptions_per_minute":
            return _per_model(self.preemptions, model)
        if metric == "active_streams":
            return _per_model(self.active_streams, model)
        if metric == "queue_depth":
            if model is not None:
                return self.queue_depth.get(model, 0.0) if self.queue_depth else None
            return sum(self.queue_depth.values()) if self.queue_depth else None
        if metric == "gpu_memory_free_bytes" or metric == "gpu_memory_free_ratio":  # `==` narrows the Literal
            free = self._gpu_free(metric)
            return min(free.values()) if free else None
        if metric == "gpu_temperature_c":
            return self.gpu_temperature_c
        if metric == "gpu_utilization":
            return self.gpu_utilization
        unknown_kind(metric)


def read_gauges(session: Session, now: datetime, reader: RollupReader | None = None) -> dict[str, AgentGauges]:
    """Every agent's latest gauge readings from the rollups of the current and the previous minute, and its
    preemptions of the previous (the last whole) minute. The control loop keeps one `reader` across cycles, so
    each series' attributes are decoded once, not every cycle."""
    since = now.replace(second=0, microsecond=0) - timedelta(minutes=1)
    latest: dict[tuple[str, str], Rollup] = {}
    gauges: dict[str, AgentGauges] = defaultdict(AgentGauges)
    metrics = (*GAUGE_METRICS, *COUNTER_METRICS)
    for rollup in (reader or RollupReader()).read(session, since=since, metrics=metrics, kinds=("gauge", "sum")):
        if rollup.kind == "sum":
            if rollup.metric == PREEMPTIONS:  # the last whole minute's; a later one (still counting) says "reporting"
                model = str(rollup.attributes.get(ATTR_MODEL))
                gauges[rollup.agent].preemptions[model] += rollup.total if rollup.minute == since else 0.0
            continue
        key = (rollup.agent, rollup.series)
        seen = latest.get(key)
        # A series with two rows in one minute (stored before and after the attribute rename): the higher reading.
        if seen is None or (rollup.minute, _reading(rollup)) > (seen.minute, _reading(seen)):
            latest[key] = rollup
    for (agent, _), rollup in latest.items():
        if rollup.last is None:
            continue
        g, last = gauges[agent], rollup.last
        model = str(rollup.attributes.get(ATTR_MODEL))
        if rollup.metric == QUEUE_DEPTH:
            g.queue_depth[model] += last
        elif rollup.metric == KV_BLOCKS_USED:
            g.kv_blocks_used[model] += last
        elif rollup.metric == KV_BLOCKS_TOTAL:
            g.kv_blocks_total[model] += last
        elif rollup.metric == ACTIVE_STREAMS:
            g.active_streams[model] += last
        elif rollup.metric == GPU_MEMORY_USAGE:
            g.gpu_memory_used[_device(rollup)] += last
        elif rollup.metric == GPU_MEMORY_LIMIT:
            g.gpu_memory_limit[_device(rollup)] += last
        elif rollup.metric == GPU_UTILIZATION:
            g.gpu_utilization = max(g.gpu_utilization or 0.0, last)
        elif rollup.metric == TEMPERATURE:
            g.gpu_temperature_c = max(g.gpu_temperature_c or -273.0, last)
    return gauges


def _device(rollup: Rollup) -> str:
    """The device a GPU memory reading is of: its `hw.id`; readings without one are one device together."""
    device = rollup.attributes.get(ATTR_HW_ID)
    return NO_DEVICE if device is None else str(device)


def _reading(rollup: Rollup) -> float:
    return -math.inf if rollup.last is None else rollup.last


class Observer:
    """Answers 'is this rule's condition met for this agent' for one cycle, from the windows and gauges."""

    def __init__(self, windows: SloWindows, slo_ids: dict[str, str], gauges: dict[str, AgentGauges],
                 last_seen: dict[str, datetime | None], stale_after_s: float, now: datetime) -> None:  # fmt: skip
        self.windows = windows
        self.slo_ids = slo_ids  # SLO name -> id
        self.gauges = gauges
        self.last_seen = last_seen
        self.stale_after_s = stale_after_s
        self.now = now
        self._sums: dict[tuple[str, tuple[int, ...]], tuple[dict[str, int], list[np.ndarray]] | None] = {}

    def _window(self, spec_id: str, seconds: tuple[int, ...]) -> tuple[dict[str, int], list[np.ndarray]] | None:
        key = (spec_id, seconds)
        if key not in self._sums:
            found = self.windows.window_sums(spec_id, list(seconds))
            self._sums[key] = None if found is None else ({a: i for i, a in enumerate(found[0])}, found[1])
        return self._sums[key]

    def see(self, rule_id: str, condition: Condition, model: str | None, agent: str) -> Seen:
        match condition:
            case BurnRateCondition():
                return self._burn(condition, agent)
            case LatencyCondition() | ErrorRatioCondition():
                return self._ratio(rule_id, condition, agent)
            case GaugeCondition(metric=metric, op=op, threshold=threshold):
                readings = self.gauges.get(agent)
                value = readings.value(metric, model) if readings is not None else None
                numbers = {"metric": metric, "value": value, "op": op, "threshold": threshold,
                           **(readings.details(metric, model) if readings is not None else {})}  # fmt: skip
                return Seen(value is not None and bool(_OPS[op](value, threshold)), numbers)
            case StaleCondition(after=after):
                seen_at = self.last_seen.get(agent)
                after_s = float(after or self.stale_after_s)
                if seen_at is None:
                    return Seen(False, {"last_seen": None, "after_s": after_s})
                silent = (self.now - seen_at).total_seconds()
                return Seen(silent > after_s, {"silent_s": round(silent, 1), "after_s": after_s})
            case _:
                unknown_kind(condition)

    def _burn(self, condition: BurnRateCondition, agent: str) -> Seen:
        slo_id = self.slo_ids.get(condition.slo)
        numbers: dict[str, Any] = {"slo": condition.slo, "threshold": condition.threshold}
        if slo_id is None:
            return Seen(False, {**numbers, "error": "no SLO with this name"})
        found = self._window(slo_id, (condition.long_window, condition.short_window))
        if found is None or agent not in found[0]:
            return Seen(False, {**numbers, "error": "the SLO does not select this agent"})
        column = found[0][agent]
        objective = self.windows.objective(slo_id)
        rates = [burn_rate(Counts(float(sums[0, column]), float(sums[1, column])), objective) for sums in found[1]]
        short_total = float(found[1][1][1, column])
        numbers.update(long_burn_rate=rates[0], short_burn_rate=rates[1], requests_short=short_total)
        met = (rates[0] is not None and rates[1] is not None and short_total >= condition.min_requests
               and rates[0] >= condition.threshold and rates[1] >= condition.threshold)  # fmt: skip
        return Seen(met, numbers)

    def _ratio(self, rule_id: str, condition: LatencyCondition | ErrorRatioCondition, agent: str) -> Seen:
        found = self._window(f"rule:{rule_id}", (condition.window,))
        if found is None or agent not in found[0]:
            return Seen(False, {"requests": 0})
        column = found[0][agent]
        good, total = float(found[1][0][0, column]), float(found[1][0][1, column])
        enough = total >= condition.min_requests and total > 0
        if isinstance(condition, LatencyCondition):
            share = good / total if total > 0 else None
            numbers = {"metric": condition.metric, "requests": total, "within_threshold": share,
                       "threshold_ms": condition.threshold_ms, "quantile": condition.quantile}  # fmt: skip
            return Seen(enough and share is not None and share < condition.quantile, numbers)
        ratio = (total - good) / total if total > 0 else None
        numbers = {"requests": total, "error_ratio": ratio, "threshold": condition.threshold}
        return Seen(enough and ratio is not None and ratio > condition.threshold, numbers)


__all__ = ["COUNTER_METRICS", "GAUGE_METRICS", "AgentGauges", "Observer", "Seen", "read_gauges"]
