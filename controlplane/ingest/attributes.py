"""A series' metric and attributes under the current names, and its identity.

Agents before 0.2 named their point attributes `model`, `model.version`, `priority`, `outcome` and `policy.source`;
they are now namespaced (`spillway.model`, ...: `names.LEGACY_ATTRIBUTES`). They also sent the KV-cache budget gauge
as `spillway.kv.blocks.total`, now `spillway.kv.blocks.limit` (`names.LEGACY_METRICS`: Prometheus keeps `_total` for
counters). For one release the control plane reads both: the receiver renames the old ones before it stores a point,
and the rollup reader selects the old metric names with the new ones and renames both in rows stored before the
upgrade, so every reader sees the new names only, and an old row and a new one of the same series have the same
identity (`series_key` of the renamed metric and attributes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import Any

from spillway.contract.names import LEGACY_ATTRIBUTES, LEGACY_METRICS

_OLD_METRICS: dict[str, tuple[str, ...]] = {}  # a current metric name -> the legacy names read as it
for _old, _new in LEGACY_METRICS.items():
    _OLD_METRICS[_new] = (*_OLD_METRICS.get(_new, ()), _old)


def current_metric(name: str) -> str:
    """The current name of a metric (a legacy name's replacement; any other name as it is)."""
    return LEGACY_METRICS.get(name, name)


def with_legacy_metrics(metrics: Collection[str]) -> list[str]:
    """`metrics` and the legacy names stored rows may still carry for them: what a reader selects."""
    return [*metrics, *(old for name in metrics for old in _OLD_METRICS.get(name, ()))]


def current_names(attributes: dict[str, Any]) -> dict[str, Any]:
    """`attributes` with each legacy name replaced by its new one; a point that carries both keeps the new one's
    value. The same mapping when it holds no legacy name (the common case: nothing is copied)."""
    if not any(key in LEGACY_ATTRIBUTES for key in attributes):
        return attributes
    return {
        LEGACY_ATTRIBUTES.get(key, key): value
        for key, value in attributes.items()
        if key not in LEGACY_ATTRIBUTES or LEGACY_ATTRIBUTES[key] not in attributes
    }


def series_key(metric: str, attributes: dict[str, Any]) -> str:
    """A series' stable identity (the `series` column): sha256 of its metric name and attributes."""
    return hashlib.sha256(json.dumps([metric, attributes], sort_keys=True, default=str).encode()).hexdigest()


def layout_key(series: str, bounds: tuple[float, ...]) -> str:
    """The `series` column of a histogram's rows: its series and bucket bounds hashed together, so a row only ever
    holds one layout (a series whose layout changes within a minute, as an agent's does when its first policy sets
    the control plane's buckets, gets a row per layout, each exact, instead of buckets added across layouts)."""
    return hashlib.sha256(json.dumps([series, list(bounds)]).encode()).hexdigest()


__all__ = ["current_metric", "current_names", "layout_key", "series_key", "with_legacy_metrics"]
