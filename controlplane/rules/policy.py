"""Compose the active rules of one agent into its policy document (spillway/contract/policy.py).

Several rules on one agent compose along the action ladder, mildest first (tune_batching, overflow, switch_variant,
shed, fallback): each fills its own fields, so different kinds never conflict. Rules of the same kind on the same
model (or on every model, `*`) resolve deterministically:
  - tune_batching: the shortest `max_queue_delay_us`; `preferred_batch_sizes` of the rule whose name sorts first;
  - overflow: the union: deadline misses always, the largest `fraction`, the smallest level number;
  - switch_variant: the rule whose name sorts first;
  - shed / fallback: the harshest, i.e. the smallest level number (after step-wise recovery), ties by name;
    shed's `retry_after_s` is the longest asked for.
A model's own entry overrides the `*` entry field by field on the agent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spillway.contract.policy import ALL_MODELS, FORMAT, PolicyDocument


@dataclass(frozen=True)
class Active:
    """One rule in force on one agent."""

    rule_id: str
    name: str
    action: dict[str, Any]
    model: str | None
    step: int
    since: datetime | None


def stepped_level(action: dict[str, Any], step: int) -> int:
    """The level a shed or fallback covers from after `step` recovery steps (one level fewer each)."""
    return min(64, int(action["priority_at_or_below"]) + step)


def stepped_action(action: dict[str, Any], step: int) -> dict[str, Any]:
    """The action as it applies after `step` recovery steps: levels covered shrink by one a step (shed, fallback,
    overflow by priority), an overflow fraction halves."""
    if step <= 0:
        return dict(action)
    stepped = dict(action)
    if action.get("priority_at_or_below") is not None:
        stepped["priority_at_or_below"] = stepped_level(action, step)
    if action.get("kind") == "overflow" and action.get("fraction") is not None:
        stepped["fraction"] = float(action["fraction"]) / 2**step
    return stepped


def compose(agent_id: str, active: list[Active], *, buckets_ms: list[float], export_interval_s: float,
            poll_interval_s: float) -> dict[str, Any]:  # fmt: skip
    """The document's content (everything but its version) for `agent_id` with these rules in force."""
    models: dict[str, dict[str, Any]] = {}
    for item in sorted(active, key=lambda a: (a.name, a.rule_id)):
        entry = models.setdefault(item.model or ALL_MODELS, {})
        action, kind = stepped_action(item.action, item.step), item.action["kind"]
        if kind == "tune_batching":
            delay = action.get("max_queue_delay_us")
            if delay is not None:
                entry["max_queue_delay_us"] = min(delay, entry.get("max_queue_delay_us", delay))
            if action.get("preferred_batch_sizes") and "preferred_batch_sizes" not in entry:
                entry["preferred_batch_sizes"] = list(action["preferred_batch_sizes"])
        elif kind == "overflow":
            current = entry.setdefault("overflow", {"fraction": 0.0, "at_or_below": None})
            if action.get("fraction") is not None:
                current["fraction"] = max(current["fraction"], float(action["fraction"]))
            level = action.get("priority_at_or_below")
            if level is not None:
                current["at_or_below"] = level if current["at_or_below"] is None else min(current["at_or_below"], level)
        elif kind == "switch_variant":
            entry.setdefault("variant", int(action["version"]))
        elif kind == "shed":
            level = int(action["priority_at_or_below"])
            current = entry.get("shed")
            retry = int(action.get("retry_after_s", 5))
            if current is None or level < current["at_or_below"]:
                entry["shed"] = {
                    "at_or_below": level,
                    "retry_after_s": max(retry, (current or {}).get("retry_after_s", 0)),
                }
            else:
                current["retry_after_s"] = max(current["retry_after_s"], retry)
        elif kind == "fallback":
            level = int(action["priority_at_or_below"])
            current = entry.get("fallback")
            if current is None or level < current["at_or_below"]:
                fallback: dict[str, Any] = {"at_or_below": level, "mode": action.get("mode", "cache")}
                if action.get("default_outputs") is not None:
                    fallback["default_outputs"] = action["default_outputs"]
                entry["fallback"] = fallback
        # kinds this agent cannot apply (added by later issues) are left out rather than half-applied
    causes = [
        {"rule": a.rule_id, "name": a.name, "action": a.action["kind"], "model": a.model or ALL_MODELS,
         "since": a.since.isoformat() if a.since else None}
        for a in sorted(active, key=lambda a: (a.name, a.rule_id))
    ]  # fmt: skip
    return {
        "format": FORMAT, "agent": agent_id, "models": models, "latency_buckets_ms": sorted(buckets_ms),
        "export_interval_s": export_interval_s, "poll_interval_s": poll_interval_s, "causes": causes,
    }  # fmt: skip


def document(content: dict[str, Any], version: int) -> tuple[dict[str, Any], str]:
    """The full document (validated with the agent's own schema, so no agent would refuse it) and its ETag."""
    full = PolicyDocument.model_validate({**content, "version": version}).model_dump(mode="json")
    canonical = json.dumps(full, sort_keys=True, separators=(",", ":")).encode()
    return full, f'"{hashlib.sha256(canonical).hexdigest()[:32]}"'


def same_content(stored: dict[str, Any], content: dict[str, Any]) -> bool:
    """Whether a stored document says what `content` says (its version aside)."""
    try:
        normal = PolicyDocument.model_validate({**content, "version": stored.get("version", 0)})
        return PolicyDocument.model_validate(stored) == normal
    except ValueError:
        return False


__all__ = ["Active", "compose", "document", "same_content", "stepped_action", "stepped_level"]
