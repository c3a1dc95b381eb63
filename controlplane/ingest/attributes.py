"""A series' attributes under the current names, and its identity.

Agents before 0.2 named their point attributes `model`, `model.version`, `priority`, `outcome` and `policy.source`;
they are now namespaced (`spillway.model`, ...: `names.LEGACY_ATTRIBUTES`). For one release the control plane reads
both: the receiver renames the old ones before it stores a point, and the rollup reader renames them in rows stored
before the upgrade, so every reader sees the new names only, and an old row and a new one of the same series have
the same identity (`series_key` of the renamed attributes).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from spillway.contract.names import LEGACY_ATTRIBUTES


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


__all__ = ["current_names", "series_key"]
