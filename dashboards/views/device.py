"""One device: latency percentiles and queue depth over time (from the history API), batch sizes, its generative
models' streams (tokens/s, TTFT and TPOT over time, KV cache, preemptions) and limits, GPU gauges (and GPU memory and
temperature over time), its policy and events."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboards import charts, fmt, history, session
from dashboards.describe import (
    agent_state,
    clock,
    event_numbers,
    generation_rows,
    generative_settings,
    labels_text,
    ladder,
    outcome_mix,
    overflow_text,
    policy_fields,
    tokens_out_per_s,
    worst_p99,
    worst_ttft_p99,
)
from dashboards.fmt import DASH, number
from dashboards.history import step_for

WINDOWS = ("1m", "5m", "15m", "1h", "6h")
BYTES_GAUGES = ("hw.gpu.memory.usage", "hw.gpu.memory.limit", "system.memory.usage")
STATE_COLOURS = {"healthy": "green", "degraded": "orange", "stale": "red", "never_seen": "gray"}


def render() -> None:
    st.title("Device")
    with session.guard():
        agents = session.api().list_all("agents")
        if not agents:
            st.info("No agents enrolled yet: `POST /api/v1/agents` (admin) enrols one.")
            return
        by_id = {a["id"]: a for a in agents}
        wanted = st.query_params.get("agent")
        ids = sorted(by_id, key=lambda i: by_id[i]["name"])
        chosen = st.selectbox("Agent", ids, index=ids.index(wanted) if wanted in by_id else 0,
                              format_func=lambda i: by_id[i]["name"], key=f"device_agent-{wanted}")  # fmt: skip
        if chosen != wanted:
            st.query_params["agent"] = chosen
        window = st.segmented_control("Window", WINDOWS, default="5m", key="device_window") or "5m"
        session.live(lambda: _device(chosen, window))


def _device(agent_id: str, window: str) -> None:
    api = session.api()
    agent = api.get(f"/agents/{agent_id}")
    metrics = api.agent_metrics(agent_id, window)
    policy = api.policy(agent_id)
    rules = api.list_all("rules")
    events = api.events(agent=agent_id, limit=20)["items"]

    state = agent_state(agent, policy)
    st.markdown(f"**{agent['name']}** is :{STATE_COLOURS.get(state, 'gray')}[**{state}**] · "
                f"{agent.get('device_class', '-')} · labels `{labels_text(agent.get('labels')) or '-'}` · "
                f"last seen {clock(agent.get('last_seen'))} UTC")  # fmt: skip
    cols = st.columns(4)
    cols[0].metric(f"Requests/s ({window})", number(metrics["rps"]))
    cols[1].metric(f"Requests ({window})", number(metrics["requests"]))
    cols[2].metric("p99 ms (slowest group)", number(worst_p99(metrics)))
    cols[3].metric("Policy version", number(policy.get("version")))
    st.caption(f"id `{agent_id}` · window {clock(metrics['since'])} to {clock(metrics['until'])} UTC")

    traffic = metrics["traffic"]
    generation = metrics.get("generation") or []  # absent from a control plane from before generative telemetry
    gauges = metrics["device"]
    points = session.history_points(lambda: api.agent_history(agent_id, window, step_for(window)))

    if generation:  # first: on a device that serves a chat model, its streams are what an operator looks at
        _generation(generation, policy, points, window)

    st.subheader("Traffic")
    if generation:
        st.caption("Generative models count here per priority and outcome; their latency is the TTFT and TPOT above.")
    if not traffic:
        st.info(f"No requests reported in the last {window}.")
    else:
        fmt.show([{
            "model": t["model"], "priority": t["priority"], "versions": ",".join(t["versions"]),
            "requests": t["requests"], "requests/s": t["rps"], "p50 ms": t["latency_ms"]["p50"],
            "p95 ms": t["latency_ms"]["p95"], "p99 ms": t["latency_ms"]["p99"],
            "queue depth (last/max)": DASH if t["queue_depth"] is None
            else f"{number(t['queue_depth']['last'])} / {number(t['queue_depth']['max'])}",
            "outcomes": outcome_mix(t["outcomes"]), "queue ms": t["queue_ms_mean"], "compute ms": t["compute_ms_mean"],
        } for t in traffic], column_config=fmt.WIDE_OUTCOMES)  # fmt: skip
        left, right = st.columns(2)
        with left:
            bars = [{"group": f"{t['model']} p{t['priority']}", "percentile": q, "ms": t["latency_ms"][q]}
                    for t in traffic for q in ("p50", "p95", "p99") if t["latency_ms"][q] is not None]  # fmt: skip
            if bars:
                st.altair_chart(charts.percentile_bars(bars), width="stretch")
        with right:
            mix = [{"group": f"{t['model']} p{t['priority']}", "outcome": o, "requests": n}
                   for t in traffic for o, n in t["outcomes"].items() if n]  # fmt: skip
            if mix:
                st.altair_chart(charts.outcome_bars(mix), width="stretch")

    if points is not None:
        _side_by_side((history.latency(points), "Latency percentiles over time", "ms"),
                      (history.queue_depth(points), "Queue depth over time", "requests"))  # fmt: skip

    if metrics["batches"]:
        st.subheader("Batch sizes")
        fmt.show([{"model": b["model"], "batches": b["batches"], "mean": b["mean"], "p50": b["p50"],
                                 "p99": b["p99"]} for b in metrics["batches"]])  # fmt: skip

    st.subheader("Device")
    if not gauges:
        st.info("This device reports no GPU or host gauges (no NVML or jetson-stats on it).")
    else:
        fmt.show([_gauge_row(g) for g in gauges])
    if points is not None:
        _side_by_side((history.gpu_memory(points), "GPU memory (GiB)", "GiB"),
                      (history.temperature(points), "Temperature (°C)", "°C"))  # fmt: skip

    st.subheader(f"Policy v{policy.get('version')}")
    models = policy.get("models") or {}
    if models:
        fmt.show([{
            "model": name, "variant": m.get("variant"), "batch window µs": m.get("max_queue_delay_us"),
            "preferred sizes": ",".join(str(s) for s in m.get("preferred_batch_sizes") or []) or None,
            "generation": "; ".join(t for rung in ("cap_max_tokens", "limit_generation")
                                    if (t := policy_fields(m, rung)) is not None) or None,
            "overflow": overflow_text(m.get("overflow")),
            "shed": None if not m.get("shed") else f"priority ≥ {m['shed']['at_or_below']}",
            "fallback": None if not m.get("fallback")
            else f"{m['fallback']['mode']} for ≥ {m['fallback']['at_or_below']}",
        } for name, m in sorted(models.items())])  # fmt: skip
    else:
        st.caption("Nothing degraded: every model serves as configured.")
    causes = policy.get("causes") or []
    if causes:
        fmt.show([{"rule": c["name"], "action": c["action"], "model": c.get("model", "*"),
                                 "since": clock(c.get("since"))} for c in causes])  # fmt: skip
    st.markdown("**Degradation ladder** (mildest first)")
    fmt.show(ladder(policy, rules, agent))

    st.subheader("Events")
    if events:
        rows = [{"time": clock(e["ts"]), "kind": fmt.event_kind(e["kind"]), "numbers": event_numbers(e),
                 "actor": e["actor"], "reason": e["reason"]} for e in events]  # fmt: skip
        fmt.show(rows)
    else:
        st.caption("No events for this agent.")


def _generation(
    generation: list[dict[str, Any]], policy: dict[str, Any], points: list[dict[str, Any]] | None, window: str
) -> None:
    """Generative models: streams and tokens/s, TTFT and TPOT percentiles, KV cache, preemptions, active streams, and
    the engine limits the policy has in force."""
    st.subheader("Generation")
    active = [g["active_streams"] for g in generation if g.get("active_streams") is not None]
    kv = [g["kv_cache_use"] for g in generation if g.get("kv_cache_use") is not None]
    cols = st.columns(4)
    cols[0].metric(f"Tokens out/s ({window})", number(tokens_out_per_s({"generation": generation})))
    cols[1].metric("TTFT p99 ms (slowest model)", number(worst_ttft_p99({"generation": generation})))
    cols[2].metric("Active streams", number(sum(active)) if active else DASH)
    cols[3].metric("KV-cache use (fullest)", fmt.share(max(kv)) if kv else DASH)
    fmt.show(generation_rows(generation), column_config=fmt.WIDE_OUTCOMES)
    if points is not None:
        _side_by_side((history.generation_latency(points), "TTFT and TPOT p99 over time", "ms"),
                      (history.tokens_out(points), "Output tokens/s over time", "tokens/s"))  # fmt: skip
    st.markdown(f"**Generative settings in force** (policy v{policy.get('version')})")
    fmt.show(generative_settings(policy, [g["model"] for g in generation]))


def _side_by_side(left: tuple[pd.DataFrame, str, str], right: tuple[pd.DataFrame, str, str]) -> None:
    """Two line charts from the history (frame, title, unit) in two columns; an empty one leaves its column blank."""
    for column, (frame, title, unit) in zip(st.columns(2), (left, right), strict=True):
        with column:
            if len(frame):
                st.altair_chart(charts.lines(frame, title, unit), width="stretch")


def _gauge_row(gauge: dict[str, Any]) -> dict[str, Any]:
    scale, unit = (2**30, " GiB") if gauge["metric"] in BYTES_GAUGES else (1, "")

    def show(v: float | None) -> str:
        return DASH if v is None else f"{number(v / scale)}{unit}"

    return {"gauge": gauge["metric"], "attributes": labels_text(gauge["attributes"]), "last": show(gauge["last"]),
            "min": show(gauge["min"]), "max": show(gauge["max"]), "at": clock(gauge["at"])}  # fmt: skip


if __name__ == "__main__":
    render()
