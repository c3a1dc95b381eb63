"""Sentences and rows for what the API returns: conditions, actions, rule states, an agent's degradation ladder.

Plain functions over the API's JSON (no Streamlit), so they are tested on their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

ALL_MODELS = "*"
# The degradation ladder, mildest first (ARCHITECTURE.md "Degradation rules"); each rule action is one rung.
LADDER: tuple[tuple[str, str], ...] = (
    ("tune_batching", "tune batching"),
    ("overflow", "overflow to the cloud"),
    ("switch_variant", "lighter variant"),
    ("shed", "shed low priorities"),
    ("fallback", "serve fallbacks"),
)
OPS = {">": "above", ">=": "at or above", "<": "below", "<=": "at or below"}


def labels_text(labels: Any) -> str:
    if isinstance(labels, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return str(labels or "")


def selector_text(selector: dict[str, Any] | None) -> str:
    selector = selector or {}
    labels = labels_text(selector.get("labels")) or "every agent"
    model = selector.get("model") or "every model"
    return f"{labels} · {model}"


def condition_text(condition: dict[str, Any]) -> str:
    kind = condition.get("kind")
    if kind == "burn_rate":
        return (f"SLO {condition.get('slo')} burns ≥ {condition.get('threshold')}x over "
                f"{condition.get('long_window')} and {condition.get('short_window')}")  # fmt: skip
    if kind == "latency":
        quantile = float(condition.get("quantile", 0)) * 100
        return f"p{quantile:g} latency > {condition.get('threshold_ms')} ms over {condition.get('window')}"
    if kind == "error_ratio":
        return f"error ratio > {condition.get('threshold')} over {condition.get('window')}"
    if kind == "gauge":
        op = OPS.get(str(condition.get("op")), condition.get("op"))
        return f"{condition.get('metric')} {op} {condition.get('threshold')}"
    if kind == "stale":
        after = condition.get("after")
        return f"agent silent for {after}" if after else "agent stale"
    return str(kind)


def action_text(action: dict[str, Any]) -> str:
    kind = action.get("kind")
    if kind == "tune_batching":
        parts = batching_parts(action, "batch window", "preferred sizes")
        return "tune batching: " + (", ".join(parts) or "as configured")
    if kind == "overflow":
        mode = action.get("mode", "deadline")
        if mode == "fraction":
            extra = f" and {share(action.get('fraction'))} of the rest"
        elif mode == "priority":
            extra = f" and all of priority {action.get('priority_at_or_below')} and lower"
        else:
            extra = ""
        return f"overflow to the cloud: requests predicted to miss their deadline{extra}"
    if kind == "switch_variant":
        return f"serve variant (version) {action.get('version')}"
    if kind == "shed":
        return (f"shed priority {action.get('priority_at_or_below')} and lower "
                f"(Retry-After {action.get('retry_after_s', 5)} s)")  # fmt: skip
    if kind == "fallback":
        return f"{action.get('mode', 'cache')} fallback for priority {action.get('priority_at_or_below')} and lower"
    return str(kind)


def batching_parts(entry: dict[str, Any], window: str, sizes: str) -> list[str]:
    """The batching an action or a policy entry sets (`max_queue_delay_us`, `preferred_batch_sizes`), named by
    `window` and `sizes`; empty when it sets neither."""
    parts = []
    if entry.get("max_queue_delay_us") is not None:
        parts.append(f"{window} {entry['max_queue_delay_us']} µs")
    if entry.get("preferred_batch_sizes"):
        parts.append(f"{sizes} {entry['preferred_batch_sizes']}")
    return parts


def rule_now(rule: dict[str, Any], states: list[dict[str, Any]]) -> str:
    """What a rule does right now, from its per-agent states (`GET /rules/{id}/status`)."""
    if not rule.get("enabled", True):
        return "disabled: not evaluated"
    verb = "would " if rule.get("dry_run") else ""
    if not states:
        return "condition not met on any agent: nothing to do"
    parts = []
    for state in states:
        name = state.get("agent_name") or state.get("agent")
        what = state.get("state")
        if what == "pending":
            parts.append(f"{name}: met, waiting out `for` (since {clock(state.get('since'))})")
        elif what == "recovering":
            parts.append(f"{name}: recovering, step {state.get('step')}: {verb}still {action_text(rule['action'])}")
        else:
            latched = " (latched by the flap limit)" if state.get("latched") else ""
            parts.append(f"{name}: {verb}{action_text(rule['action'])}{latched}")
    return "; ".join(parts)


def observed_text(observed: dict[str, Any]) -> str:
    return ", ".join(f"{k}={number(v)}" for k, v in sorted(observed.items()))


def selects(rule: dict[str, Any], agent: dict[str, Any]) -> bool:
    """Whether a rule's selector picks an agent (labels are all required; the model is checked per request)."""
    wanted = (rule.get("selector") or {}).get("labels") or {}
    if isinstance(wanted, str):
        wanted = dict(pair.split("=", 1) for pair in wanted.split(",") if "=" in pair)
    have = agent.get("labels") or {}
    return all(have.get(k) == v for k, v in wanted.items())


def policy_fields(model: dict[str, Any], rung: str) -> str | None:
    """What one model entry of a policy document says for one rung, or None when the rung is not in force."""
    if rung == "tune_batching":
        return ", ".join(batching_parts(model, "window", "sizes")) or None
    if rung == "overflow":
        return overflow_text(model.get("overflow"))
    if rung == "switch_variant":
        return f"variant {model['variant']}" if model.get("variant") is not None else None
    if rung == "shed":
        shed = model.get("shed")
        return f"priority ≥ {shed['at_or_below']} refused" if shed else None
    if rung == "fallback":
        fallback = model.get("fallback")
        return f"priority ≥ {fallback['at_or_below']} get {fallback['mode']}" if fallback else None
    return None


def overflow_text(overflow: dict[str, Any] | None) -> str | None:
    """A policy document's `overflow` entry (`{"fraction", "at_or_below"}`) in words; None: nothing overflows."""
    if not overflow:
        return None
    parts = ["deadline misses"]
    if overflow.get("fraction"):
        parts.append(f"{share(overflow['fraction'])} of the rest")
    if overflow.get("at_or_below") is not None:
        parts.append(f"priority ≥ {overflow['at_or_below']}")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{listed} overflow"


def share(fraction: Any) -> str:
    """A fraction (0.25) as a share of traffic (25 %), without rounding a small one away."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        return str(fraction)
    return f"{fraction * 100:.3g} %"


def ladder(policy: dict[str, Any], rules: Iterable[dict[str, Any]], agent: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rung, mildest first: what the agent's policy has in force there, which rules put it there,
    and which enabled rules selecting this agent could take that step."""
    causes = policy.get("causes") or []
    models = policy.get("models") or {}
    rows = []
    for step, (rung, label) in enumerate(LADDER, start=1):
        in_force = [f"{name}: {text}" for name, entry in sorted(models.items())
                    if (text := policy_fields(entry, rung)) is not None]  # fmt: skip
        by = sorted({c["name"] for c in causes if c.get("action") == rung})
        could = sorted(r["name"] for r in rules if r["action"]["kind"] == rung and r.get("enabled", True)
                       and not r.get("dry_run") and selects(r, agent))  # fmt: skip
        rows.append({
            "step": step,
            "rung": label,
            "in force": "yes" if in_force else "no",
            "now": "; ".join(in_force) or "-",
            "by rules": ", ".join(by) or "-",
            "rules that can take it": ", ".join(could) or "-",
        })  # fmt: skip
    return rows


def agent_state(agent: dict[str, Any], policy: dict[str, Any] | None) -> str:
    """healthy, degraded (healthy but with rules in force), stale or never_seen."""
    status = str(agent.get("status", "unknown"))
    if status == "healthy" and policy and policy.get("causes"):
        return "degraded"
    return status


def worst_p99(metrics: dict[str, Any]) -> float | None:
    """The highest p99 over the agent's model/priority groups: its slowest traffic."""
    values = [t["latency_ms"]["p99"] for t in metrics.get("traffic", []) if t["latency_ms"].get("p99") is not None]
    return max(values) if values else None


def outcome_mix(outcomes: dict[str, float]) -> str:
    total = sum(outcomes.values())
    if not total:
        return "-"
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))


def number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value)}"
    return f"{value:.{digits}g}"


def percent(value: float | None, digits: int = 3) -> str:
    """A number already in percent (an objective: 99.5)."""
    return "-" if value is None else f"{value:.{digits}f} %"


def ratio_percent(value: float | None, digits: int = 3) -> str:
    """A ratio (an SLI: 0.995) in percent."""
    return "-" if value is None else percent(value * 100, digits)


def clock(value: Any) -> str:
    """An API timestamp as HH:MM:SS UTC (dates only when not today would need the reader's zone; keep UTC)."""
    if not value:
        return "-"
    try:
        moment = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return str(value)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def event_numbers(event: dict[str, Any], limit: int = 8) -> str:
    """The numbers behind an event in one line: what a rule observed, what a change changed, a policy's version."""
    data = event.get("data") or {}
    if isinstance(data.get("observed"), dict):
        state = f"state {data['state']}, " if data.get("state") else ""
        return state + observed_text(data["observed"])
    if isinstance(data.get("changes"), dict):
        return "; ".join(f"{k}: {_short(v.get('from'))} -> {_short(v.get('to'))}"
                         for k, v in sorted(data["changes"].items()) if isinstance(v, dict))  # fmt: skip
    if event.get("kind") == "policy.published":
        causes = ", ".join(f"{c.get('name')} ({c.get('action')})" for c in data.get("causes") or []) or "none"
        return f"version {data.get('version')}, causes: {causes}"
    scalars = [f"{k}={_short(flat)}" for k, v in sorted(data.items()) if k not in ("spec", "name", "backend")
               and (flat := _flat(v)) is not None]  # fmt: skip
    return ", ".join(scalars[:limit])


def event_subject(event: dict[str, Any]) -> str:
    """What an event is about, by name: a resource's own events say `name`, the gateway's say `backend`."""
    data = event.get("data") or {}
    return str(data.get("name") or data.get("backend") or event.get("subject_id") or "-")


def _flat(value: Any) -> Any:
    """A scalar as it is, a list of scalars joined with commas (a backend event's `models`); else None."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if not any(isinstance(v, (dict, list)) for v in value) else None
    return None if isinstance(value, dict) else value


def _short(value: Any, width: int = 60) -> str:
    text = number(value) if isinstance(value, (int, float)) else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"
