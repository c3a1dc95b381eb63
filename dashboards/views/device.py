"""One device: latency percentiles and queue depth over time, batch sizes, its generative models' streams (tokens/s,
TTFT and TPOT, KV cache, preemptions) and limits, GPU gauges, its policy and events."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboards import charts, session
from dashboards.describe import (
    agent_state,
    clock,
    event_numbers,
    generation_rows,
    generative_settings,
    labels_text,
    ladder,
    number,
    outcome_mix,
    overflow_text,
    policy_fields,
    tokens_out_per_s,
    worst_p99,
    worst_ttft_p99,
)
from dashboards.history import sample_log

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
    cols[3].metric("Policy version", policy.get("version", "-"))
    st.caption(f"id `{agent_id}` · window {clock(metrics['since'])} to {clock(metrics['until'])} UTC")

    traffic = metrics["traffic"]
    log = sample_log(st.session_state, f"device-{agent_id}-{window}")
    sample: dict[str, float | None] = {}
    for t in traffic:
        group = f"{t['model']} p{t['priority']}"
        for q in ("p50", "p95", "p99"):
            sample[f"{group} {q}"] = t["latency_ms"][q]
        sample[f"{group} queue"] = None if t["queue_depth"] is None else t["queue_depth"]["last"]
    generation = metrics.get("generation") or []  # absent from a control plane from before generative telemetry
    for g in generation:
        sample[f"{g['model']} TTFT p99 ms"] = (g.get("ttft_ms") or {}).get("p99")
        sample[f"{g['model']} TPOT p99 ms"] = (g.get("tpot_ms") or {}).get("p99")
        sample[f"{g['model']} tokens out/s"] = g.get("tokens_out_per_s")
    gauges = metrics["device"]
    for g in gauges:
        sample[f"{g['metric']} {labels_text(g['attributes'])}"] = g["last"]
    log.add(sample)
    history = log.long()

    if generation:  # first: on a device that serves a chat model, its streams are what an operator looks at
        _generation(generation, policy, history, window)

    st.subheader("Traffic")
    if generation:
        st.caption("Generative models count here per priority and outcome; their latency is the TTFT and TPOT above.")
    if not traffic:
        st.info(f"No requests reported in the last {window}.")
    else:
        st.dataframe(pd.DataFrame([{
            "model": t["model"], "priority": t["priority"], "versions": ",".join(t["versions"]),
            "requests": t["requests"], "requests/s": t["rps"], "p50 ms": t["latency_ms"]["p50"],
            "p95 ms": t["latency_ms"]["p95"], "p99 ms": t["latency_ms"]["p99"], "queue ms": t["queue_ms_mean"],
            "compute ms": t["compute_ms_mean"],
            "queue depth (last/max)": "-" if t["queue_depth"] is None
            else f"{number(t['queue_depth']['last'])} / {number(t['queue_depth']['max'])}",
            "outcomes": outcome_mix(t["outcomes"]),
        } for t in traffic]), hide_index=True)  # fmt: skip
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

    latency = history[history["series"].str.contains(r" p\d\d$", regex=True)]
    queue = history[history["series"].str.endswith(" queue")]
    _side_by_side((latency, "Latency percentiles over time (sampled)", "ms"),
                  (queue, "Queue depth over time (sampled)", "requests"))  # fmt: skip

    if metrics["batches"]:
        st.subheader("Batch sizes")
        st.dataframe(pd.DataFrame([{"model": b["model"], "batches": b["batches"], "mean": b["mean"], "p50": b["p50"],
                                    "p99": b["p99"]} for b in metrics["batches"]]), hide_index=True)  # fmt: skip

    st.subheader("Device")
    if not gauges:
        st.info("This device reports no GPU or host gauges (no NVML or jetson-stats on it).")
    else:
        st.dataframe(pd.DataFrame([_gauge_row(g) for g in gauges]), hide_index=True)
        device_history = history[history["series"].str.startswith(("hw.", "system."))]
        temperature = device_history[device_history["series"].str.startswith("hw.temperature")]
        memory = device_history[device_history["series"].str.startswith("hw.gpu.memory")].assign(
            value=lambda f: f["value"] / 2**30
        )
        _side_by_side((memory, "GPU memory (GiB, sampled)", "GiB"), (temperature, "Temperature (°C, sampled)", "°C"))

    st.subheader(f"Policy v{policy.get('version')}")
    models = policy.get("models") or {}
    if models:
        st.dataframe(pd.DataFrame([{
            "model": name, "variant": m.get("variant"), "batch window µs": m.get("max_queue_delay_us"),
            "preferred sizes": ",".join(str(s) for s in m.get("preferred_batch_sizes") or []) or None,
            "generation": "; ".join(t for rung in ("cap_max_tokens", "limit_generation")
                                    if (t := policy_fields(m, rung)) is not None) or None,
            "overflow": overflow_text(m.get("overflow")),
            "shed": None if not m.get("shed") else f"priority ≥ {m['shed']['at_or_below']}",
            "fallback": None if not m.get("fallback")
            else f"{m['fallback']['mode']} for ≥ {m['fallback']['at_or_below']}",
        } for name, m in sorted(models.items())]), hide_index=True)  # fmt: skip
    else:
        st.caption("Nothing degraded: every model serves as configured.")
    causes = policy.get("causes") or []
    if causes:
        st.dataframe(pd.DataFrame([{"rule": c["name"], "action": c["action"], "model": c.get("model", "*"),
                                    "since": clock(c.get("since"))} for c in causes]), hide_index=True)  # fmt: skip
    st.markdown("**Degradation ladder** (mildest first)")
    st.dataframe(pd.DataFrame(ladder(policy, rules, agent)), hide_index=True)

    st.subheader("Events")
    if events:
        rows = [{"time": clock(e["ts"]), "kind": e["kind"], "numbers": event_numbers(e), "actor": e["actor"],
                 "reason": e["reason"]} for e in events]  # fmt: skip
        st.dataframe(pd.DataFrame(rows), hide_index=True)
    else:
        st.caption("No events for this agent.")


def _generation(generation: list[dict[str, Any]], policy: dict[str, Any], history: pd.DataFrame, window: str) -> None:
    """Generative models: streams and tokens/s, TTFT and TPOT percentiles, KV cache, preemptions, active streams, and
    the engine limits the policy has in force."""
    st.subheader("Generation")
    active = [g["active_streams"] for g in generation if g.get("active_streams") is not None]
    kv = [g["kv_cache_use"] for g in generation if g.get("kv_cache_use") is not None]
    cols = st.columns(4)
    cols[0].metric(f"Tokens out/s ({window})", number(tokens_out_per_s({"generation": generation})))
    cols[1].metric("TTFT p99 ms (slowest model)", number(worst_ttft_p99({"generation": generation})))
    cols[2].metric("Active streams", number(sum(active)) if active else "-")
    cols[3].metric("KV-cache use (fullest)", f"{max(kv):.0%}" if kv else "-")
    st.dataframe(pd.DataFrame(generation_rows(generation)), hide_index=True,
                 column_config={c: st.column_config.NumberColumn(format="%.1f")
                                for c in ("streams/s", "tokens in/s", "tokens out/s", "TTFT p50 ms", "TTFT p90 ms",
                                          "TTFT p99 ms", "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms",
                                          "preemptions/min")})  # fmt: skip
    latency = history[history["series"].str.contains(r" (?:TTFT|TPOT) p99 ms$", regex=True)]
    tokens = history[history["series"].str.endswith(" tokens out/s")]
    _side_by_side((latency, "TTFT and TPOT p99 over time (sampled)", "ms"),
                  (tokens, "Output tokens/s over time (sampled)", "tokens/s"))  # fmt: skip
    st.markdown(f"**Generative settings in force** (policy v{policy.get('version')})")
    st.dataframe(pd.DataFrame(generative_settings(policy, [g["model"] for g in generation])), hide_index=True)


def _side_by_side(left: tuple[pd.DataFrame, str, str], right: tuple[pd.DataFrame, str, str]) -> None:
    """Two sampled series' line charts (frame, title, unit) in two columns; an empty one leaves its column blank."""
    for column, (frame, title, unit) in zip(st.columns(2), (left, right), strict=True):
        with column:
            if len(frame):
                st.altair_chart(charts.lines(frame, title, unit), width="stretch")


def _gauge_row(gauge: dict[str, Any]) -> dict[str, Any]:
    scale, unit = (2**30, " GiB") if gauge["metric"] in BYTES_GAUGES else (1, "")

    def show(v: float | None) -> str:
        return "-" if v is None else f"{number(v / scale)}{unit}"

    return {"gauge": gauge["metric"], "attributes": labels_text(gauge["attributes"]), "last": show(gauge["last"]),
            "min": show(gauge["min"]), "max": show(gauge["max"]), "at": clock(gauge["at"])}  # fmt: skip


if __name__ == "__main__":
    render()
