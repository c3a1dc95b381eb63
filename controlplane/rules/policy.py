"""Compose the active rules of one agent into its policy document (spillway/contract/policy.py).

Several rules on one agent compose along the action ladder (`ACTION_LADDER`), mildest first (tune_batching,
cap_max_tokens, limit_generation, overflow, switch_variant, shed, fallback): each fills its own fields, so different
kinds never conflict. Rules of the same kind on the same model (or on every model, `*`) resolve deterministically:
  - tune_batching: the shortest `max_queue_delay_us`; `preferred_batch_sizes` of the rule whose name sorts first;
  - cap_max_tokens, limit_generation: the strictest, i.e. the smallest `max_tokens_cap`, `max_num_seqs` and
    `max_num_batched_tokens` each (after step-wise recovery); unlike the other fields, a model's own entry never
    relaxes these: it carries the smaller of its own and the `*` value, so the strictest wins whatever the
    selectors;
  - overflow: the union: deadline misses always, the largest `fraction`, the smallest level number;
  - switch_variant: the rule whose name sorts first;
  - shed / fallback: the harshest, i.e. the smallest level number (after step-wise recovery), ties by name;
    shed's `retry_after_s` is the longest asked for; fallback's `default_outputs` and `default_text` come with
    the rule chosen.
A model's own entry overrides the `*` entry field by field on the agent.

Step-wise recovery (`recovery_steps` > 1) makes each action milder a step at a time: shed, fallback and overflow by
priority cover one level fewer, an overflow fraction halves, and the generative limits double (cap_max_tokens'
cap, limit_generation's `max_num_seqs` and `max_num_batched_tokens`, each at most the document's maximum) before
the rule lets go. With one step the action is reverted at once. Doubling, not a linear ramp: the engine's cost of
a limit is roughly proportional to it, so each step at most doubles the load the agent takes back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.schemas.rules import (
    MAX_BATCHED_TOKENS_LIMIT,
    MAX_NUM_SEQS_LIMIT,
    MAX_TOKENS_LIMIT,
    Action,
    CapMaxTokensAction,
    FallbackAction,
    LimitGenerationAction,
    OverflowAction,
    ShedAction,
    SwitchVariantAction,
    TuneBatchingAction,
    unknown_kind,
)
from spillway.contract.policy import ALL_MODELS, Cause, Fallback, ModelPolicy, Overflow, PolicyDocument, Shed
from spillway.contract.tenants import Tenant


@dataclass(frozen=True)
class Active:
    """One rule in force on one agent."""

    rule_id: str
    name: str
    action: Action
    model: str | None
    step: int
    since: datetime | None


def stepped_level(level: int, step: int) -> int:
    """The level a shed or fallback covers from after `step` recovery steps (one level fewer each)."""
    return min(64, level + step)


def doubled(limit: int | None, step: int, most: int) -> int | None:
    """A generative limit after `step` recovery steps: twice as large a step, never above `most`."""
    return None if limit is None else min(most, limit * 2**step)


GENERATIVE_LIMITS = ("max_tokens_cap", "max_num_seqs", "max_num_batched_tokens")
"""The ModelPolicy fields where the strictest (smallest) value wins, also between a model's entry and `*`."""


def stepped_action(action: Action, step: int) -> Action:
    """The action as it applies after `step` recovery steps: levels covered shrink by one a step (shed, fallback,
    overflow by priority), an overflow fraction halves, a generative limit doubles."""
    if step <= 0:
        return action
    match action:
        case OverflowAction(fraction=fraction, priority_at_or_below=level):
            update: dict[str, Any] = {}
            if level is not None:
                update["priority_at_or_below"] = stepped_level(level, step)
            if fraction is not None:
                update["fraction"] = fraction / 2**step
            return action.model_copy(update=update)
        case ShedAction(priority_at_or_below=level) | FallbackAction(priority_at_or_below=level):
            return action.model_copy(update={"priority_at_or_below": stepped_level(level, step)})
        case CapMaxTokensAction(max_tokens=cap):
            return action.model_copy(update={"max_tokens": doubled(cap, step, MAX_TOKENS_LIMIT)})
        case LimitGenerationAction(max_num_seqs=seqs, max_num_batched_tokens=tokens):
            return action.model_copy(
                update={
                    "max_num_seqs": doubled(seqs, step, MAX_NUM_SEQS_LIMIT),
                    "max_num_batched_tokens": doubled(tokens, step, MAX_BATCHED_TOKENS_LIMIT),
                }
            )
        case TuneBatchingAction() | SwitchVariantAction():
            return action
        case _:
            unknown_kind(action)


def compose(agent_id: str, active: list[Active], *, buckets_ms: list[float], export_interval_s: float,
            poll_interval_s: float, tenants: list[Tenant] | None = None) -> PolicyDocument:  # fmt: skip
    """The document for `agent_id` with these rules in force and these tenants on it (`rules/tenants.py`), at
    version 0 (`document` gives it its version).

    Raises:
        ValidationError: a composition the agent would refuse (validated with the agent's own schema).
    """
    ordered = sorted(active, key=lambda a: (a.name, a.rule_id))
    models: dict[str, dict[str, Any]] = {}  # model -> the ModelPolicy fields set so far
    for item in ordered:
        entry = models.setdefault(item.model or ALL_MODELS, {})
        match stepped_action(item.action, item.step):
            case TuneBatchingAction(max_queue_delay_us=delay, preferred_batch_sizes=sizes):
                if delay is not None:
                    entry["max_queue_delay_us"] = min(delay, entry.get("max_queue_delay_us", delay))
                if sizes and "preferred_batch_sizes" not in entry:
                    entry["preferred_batch_sizes"] = list(sizes)
            case CapMaxTokensAction(max_tokens=cap):
                _lower(entry, "max_tokens_cap", cap)
            case LimitGenerationAction(max_num_seqs=seqs, max_num_batched_tokens=tokens):
                _lower(entry, "max_num_seqs", seqs)
                _lower(entry, "max_num_batched_tokens", tokens)
            case OverflowAction(fraction=fraction, priority_at_or_below=level):
                current: Overflow = entry.get("overflow", Overflow(fraction=0.0, at_or_below=None))
                if fraction is not None:
                    current = Overflow(fraction=max(current.fraction, fraction), at_or_below=current.at_or_below)
                if level is not None:
                    lowest = level if current.at_or_below is None else min(current.at_or_below, level)
                    current = Overflow(fraction=current.fraction, at_or_below=lowest)
                entry["overflow"] = current
            case SwitchVariantAction(version=version):
                entry.setdefault("variant", version)
            case ShedAction(priority_at_or_below=level, retry_after_s=retry):
                shed: Shed | None = entry.get("shed")
                if shed is None or level < shed.at_or_below:
                    entry["shed"] = Shed(at_or_below=level, retry_after_s=max(retry, shed.retry_after_s if shed else 0))
                else:
                    entry["shed"] = Shed(at_or_below=shed.at_or_below, retry_after_s=max(shed.retry_after_s, retry))
            case FallbackAction(priority_at_or_below=level, mode=mode, default_outputs=outputs, default_text=text):
                fallback: Fallback | None = entry.get("fallback")
                if fallback is None or level < fallback.at_or_below:
                    given = {k: v for k, v in (("default_outputs", outputs), ("default_text", text)) if v is not None}
                    entry["fallback"] = Fallback(at_or_below=level, mode=mode, **given)
            case unknown:
                unknown_kind(unknown)
    everywhere = models.get(ALL_MODELS, {})
    for name, entry in models.items():  # a model's own, milder limit does not relax the `*` one
        if name != ALL_MODELS:
            for limit in GENERATIVE_LIMITS:
                _lower(entry, limit, everywhere.get(limit))
    causes = [Cause(rule=a.rule_id, name=a.name, action=a.action.kind, model=a.model or ALL_MODELS, since=a.since)
              for a in ordered]  # fmt: skip
    return PolicyDocument(
        agent=agent_id, version=0, models={name: ModelPolicy(**fields) for name, fields in models.items()},
        latency_buckets_ms=sorted(buckets_ms), export_interval_s=export_interval_s, poll_interval_s=poll_interval_s,
        causes=causes, tenants=tenants,
    )  # fmt: skip


def _lower(entry: dict[str, Any], field: str, value: int | None) -> None:
    """Set `field` to `value` unless it holds a smaller one already (None: nothing asked)."""
    if value is not None:
        entry[field] = min(value, entry.get(field, value))


def document(content: PolicyDocument, version: int) -> tuple[dict[str, Any], str]:
    """The full document at `version`, as stored and served (JSON, every field), and its ETag."""
    full = content.model_copy(update={"version": version}).model_dump(mode="json")
    canonical = json.dumps(full, sort_keys=True, separators=(",", ":")).encode()
    return full, f'"{hashlib.sha256(canonical).hexdigest()[:32]}"'


def same_content(stored: dict[str, Any], content: PolicyDocument) -> bool:
    """Whether a stored document says what `content` says (its version aside)."""
    try:
        return PolicyDocument.model_validate(stored) == content.model_copy(update={"version": stored.get("version", 0)})
    except ValueError:
        return False


__all__ = ["Active", "compose", "document", "doubled", "same_content", "stepped_action", "stepped_level"]
