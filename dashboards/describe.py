"""Sentences and rows for what the API returns: conditions, actions, rule states, an agent's degradation ladder.

Plain functions over the API's JSON (no Streamlit), so they are tested on their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from dashboards.fmt import DASH, duration, number, ratio_percent, seconds
from dashboards.fmt import share as fmt_share

ALL_MODELS = "*"
# The degradation ladder, mildest first (ARCHITECTURE.md "Degradation rules"); each rule action is one rung.
LADDER: tuple[tuple[str, str], ...] = (
    ("tune_batching", "tune batching"),
    ("cap_max_tokens", "cap max_tokens"),
    ("limit_generation", "limit generation"),
    ("overflow", "overflow to the cloud"),
    ("switch_variant", "lighter variant"),
    ("shed", "shed low priorities"),
    ("fallback", "serve fallbacks"),
)
OPS = {">": "above", ">=": "at or above", "<": "below", "<=": "at or below"}
# What a latency condition's `metric` measures (the API's LatencyCondition.metric).
LATENCY_METRICS = {"request": "latency", "ttft": "time to first token", "tpot": "time per output token"}
# SLI kinds that judge a time against `threshold_ms` (the others, availability, have none).
THRESHOLD_KINDS = frozenset({"latency", "ttft", "tpot"})


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
        what = LATENCY_METRICS.get(str(condition.get("metric") or "request"), condition.get("metric"))
        return f"p{quantile:g} {what} > {condition.get('threshold_ms')} ms over {condition.get('window')}"
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
    if kind == "cap_max_tokens":
        return f"cap max_tokens at {action.get('max_tokens')}"
    if kind == "limit_generation":
        return "limit generation: " + (", ".join(generation_parts(action)) or "as configured")
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
        text = " (default text)" if action.get("mode") == "default" and action.get("default_text") else ""
        return (f"{action.get('mode', 'cache')} fallback{text} for priority {action.get('priority_at_or_below')} "
                "and lower")  # fmt: skip
    return str(kind)


def generation_parts(entry: dict[str, Any]) -> list[str]:
    """The engine limits an action or a policy entry sets (`max_num_seqs`, `max_num_batched_tokens`)."""
    parts = []
    if entry.get("max_num_seqs") is not None:
        parts.append(f"max_num_seqs {entry['max_num_seqs']}")
    if entry.get("max_num_batched_tokens") is not None:
        parts.append(f"token budget {entry['max_num_batched_tokens']}")
    return parts


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
    if rung == "cap_max_tokens":
        return f"max_tokens ≤ {model['max_tokens_cap']}" if model.get("max_tokens_cap") is not None else None
    if rung == "limit_generation":
        return ", ".join(generation_parts(model)) or None
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
    return ratio_percent(fraction, 3)


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
            "now": "; ".join(in_force) or DASH,
            "by rules": ", ".join(by) or DASH,
            "rules that can take it": ", ".join(could) or DASH,
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
    """Each outcome's share of the requests, largest first: `local 95%, rejected 5%`."""
    total = sum(v for v in outcomes.values() if v)
    if not total:
        return DASH
    return ", ".join(f"{k} {fmt_share(v / total)}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]) if v)


def clock(value: Any) -> str:
    """An API timestamp as HH:MM:SS UTC (dates only when not today would need the reader's zone; keep UTC)."""
    if not value:
        return DASH
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
    return str(data.get("name") or data.get("backend") or event.get("subject_id") or DASH)


def _flat(value: Any) -> Any:
    """A scalar as it is, a list of scalars joined with commas (a backend event's `models`); else None."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if not any(isinstance(v, (dict, list)) for v in value) else None
    return None if isinstance(value, dict) else value


def _short(value: Any, width: int = 60) -> str:
    text = number(value) if isinstance(value, (int, float)) else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def sli_text(slo: dict[str, Any]) -> str:
    """An SLO's SLI kind with its threshold when it has one: `ttft ≤ 500 ms`, `availability`."""
    kind = str(slo.get("sli_kind"))
    if kind in THRESHOLD_KINDS and slo.get("threshold_ms") is not None:
        return f"{kind} ≤ {number(slo['threshold_ms'])} ms"
    return kind


def model_policy(policy: dict[str, Any] | None, model: str) -> dict[str, Any]:
    """What a policy document applies to one model: its own entry's fields over the `*` entry's (as the agent
    reads it, `PolicyDocument.for_model`)."""
    models = (policy or {}).get("models") or {}
    base = {k: v for k, v in (models.get(ALL_MODELS) or {}).items() if v is not None}
    return {**base, **{k: v for k, v in (models.get(model) or {}).items() if v is not None}}


GENERATIVE_FIELDS = ("max_tokens_cap", "max_num_seqs", "max_num_batched_tokens")


def generative_settings(policy: dict[str, Any] | None, models: Iterable[str]) -> list[dict[str, Any]]:
    """One row per generative model (those the agent reports, and any a policy entry limits): the variant and the
    engine limits in force, `as configured` where the policy leaves one alone."""
    entries = (policy or {}).get("models") or {}
    limited = {m for m, e in entries.items() if m != ALL_MODELS and any(e.get(f) for f in GENERATIVE_FIELDS)}
    named = set(models) | limited
    rows = []
    for model in sorted(named):
        entry = model_policy(policy, model)

        def show(field: str, entry: dict[str, Any] = entry) -> str:
            return number(entry[field]) if entry.get(field) is not None else "as configured"

        rows.append({
            "model": model, "variant": show("variant"), "max_tokens cap": show("max_tokens_cap"),
            "max_num_seqs": show("max_num_seqs"), "token budget per step": show("max_num_batched_tokens"),
        })  # fmt: skip
    return rows


def kv_cache_text(entry: dict[str, Any]) -> str:
    """KV-cache use of one generative model: `75 % (96 / 128 blocks)`, from the last gauges."""
    use, used, total = entry.get("kv_cache_use"), entry.get("kv_blocks_used"), entry.get("kv_blocks_total")
    if use is None:
        return DASH
    blocks = f" ({number(used)} / {number(total)} blocks)" if used is not None and total is not None else ""
    return f"{use:.0%}{blocks}"


def generation_rows(generation: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent metrics' `generation` entries as table rows: throughput, TTFT and TPOT, KV cache, preemptions."""
    rows = []
    for g in generation:
        ttft, tpot = g.get("ttft_ms") or {}, g.get("tpot_ms") or {}
        rows.append({
            "model": g["model"], "streams": g.get("requests"), "streams/s": g.get("streams_per_s"),
            "tokens in/s": g.get("tokens_in_per_s"), "tokens out/s": g.get("tokens_out_per_s"),
            "TTFT p50 ms": ttft.get("p50"), "TTFT p90 ms": ttft.get("p90"), "TTFT p99 ms": ttft.get("p99"),
            "TPOT p50 ms": tpot.get("p50"), "TPOT p90 ms": tpot.get("p90"), "TPOT p99 ms": tpot.get("p99"),
            "KV-cache use": kv_cache_text(g), "preemptions": g.get("preemptions"),
            "preemptions/min": g.get("preemptions_per_min"), "active streams": g.get("active_streams"),
            "outcomes": outcome_mix(g.get("outcomes") or {}),
        })  # fmt: skip
    return rows


def worst_ttft_p99(metrics: dict[str, Any] | None) -> float | None:
    """The highest TTFT p99 over an agent's generative models (None: it serves none, or reported none)."""
    values = [g["ttft_ms"]["p99"] for g in (metrics or {}).get("generation") or []
              if (g.get("ttft_ms") or {}).get("p99") is not None]  # fmt: skip
    return max(values) if values else None


def tokens_out_per_s(metrics: dict[str, Any] | None) -> float | None:
    """Output tokens per second over an agent's generative models (None: it serves none)."""
    generation = (metrics or {}).get("generation") or []
    values = [g["tokens_out_per_s"] for g in generation if g.get("tokens_out_per_s") is not None]
    return sum(values) if values else None


def burn_text(alerts: list[dict[str, Any]]) -> str:
    """An SLO's burn rate in one line, from its status's alert pairs: the pair closest to firing (both of its windows
    over their threshold fires it), `20.5x / 19.8x over 56m/5m (fires at 14.4x)`."""
    if not alerts:
        return DASH

    def closeness(alert: dict[str, Any]) -> float:
        rates = (alert.get("long_burn_rate") or 0.0, alert.get("short_burn_rate") or 0.0)
        return min(rates) / alert["threshold"] if alert.get("threshold") else 0.0

    pair = max(alerts, key=closeness)
    return (f"{number(pair.get('long_burn_rate'))}x / {number(pair.get('short_burn_rate'))}x over "
            f"{pair['long']}/{pair['short']} (fires at {number(pair.get('threshold'))}x)")  # fmt: skip


def observed_seconds(status: dict[str, Any]) -> float | None:
    """How much of its window an SLO's figures cover (the status's `observed`: a duration, `12m`, or seconds);
    None when the status does not say (no events yet, or a control plane from before `observed`)."""
    observed = status.get("observed")
    if observed is None or (status.get("observed_since") is None and "observed_since" in status):
        return None
    if isinstance(observed, (int, float)) and not isinstance(observed, bool):
        return float(observed)
    found = seconds(str(observed))
    return float(found) if found else None


def coverage_note(status: dict[str, Any]) -> str | None:
    """`figures cover only 12 min of the 28d window` when an SLO's events span less than its window, else None."""
    observed, window = observed_seconds(status), seconds(str(status.get("window") or ""))
    if observed is None or not window or observed >= window:
        return None
    return f"figures cover only {duration(observed)} of the {status['window']} window"


def coverage_text(status: dict[str, Any]) -> str:
    """A table cell: `12 min of 28d`, `whole window`, or `DASH` (no events)."""
    observed, window = observed_seconds(status), seconds(str(status.get("window") or ""))
    if observed is None or not window:
        return DASH
    return "whole window" if observed >= window else f"{duration(observed)} of {status['window']}"
