"""Fleet: every agent's health, traffic and degradations at a glance, and the SLOs (generative ones beside the
others) worst first with their burn rates."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from dashboards import charts, session
from dashboards.api import DashboardApiError, gather
from dashboards.describe import (
    agent_state,
    burn_text,
    clock,
    labels_text,
    number,
    outcome_mix,
    percent,
    ratio_percent,
    sli_text,
    tokens_out_per_s,
    worst_p99,
    worst_ttft_p99,
)
from dashboards.history import sample_log

WINDOWS = ("1m", "5m", "15m", "1h", "6h")
STATE_ORDER = {"degraded": 0, "stale": 1, "healthy": 2, "never_seen": 3}


def render() -> None:
    st.title("Fleet")
    window = st.segmented_control("Window", WINDOWS, default="5m", key="fleet_window") or "5m"
    session.live(lambda: _fleet(window))


def _fleet(window: str) -> None:
    api = session.api()
    status = api.status(window)
    agents = api.list_all("agents")
    calls: dict[str, Any] = {}
    for agent in agents:
        ident = agent["id"]
        calls[f"m:{ident}"] = lambda ident=ident: api.agent_metrics(ident, window)
        calls[f"p:{ident}"] = lambda ident=ident: api.policy(ident)
    for state in status["slo_states"]:
        calls[f"s:{state['slo']}"] = lambda ident=state["slo"]: api.get(f"/slos/{ident}/status")
    calls["slos"] = lambda: api.list_all("slos")  # their kinds and thresholds
    found = gather(calls)

    counts, live = status["agents"], status["live"]
    firing = [s for s in status["slo_states"] if s["firing"]]
    cols = st.columns(7)
    cols[0].metric("Agents healthy", f"{counts['healthy']} / {counts['total']}")
    cols[1].metric("Stale", counts["stale"])
    cols[2].metric("Never seen", counts["never_seen"])
    cols[3].metric(f"Requests/s ({window})", number(live["rps"]))
    cols[4].metric("p50 (ms)", number(live["p50_ms"]))
    cols[5].metric("p99 (ms)", number(live["p99_ms"]))
    cols[6].metric("SLOs firing", f"{len(firing)} / {status['slos']}")
    sample_log(st.session_state, f"fleet-{window}").add({"requests/s": live["rps"], "p99 ms": live["p99_ms"]})

    label_pairs = sorted({f"{k}={v}" for a in agents for k, v in (a.get("labels") or {}).items()})
    wanted = st.multiselect("Filter by label", label_pairs, key="fleet_labels", placeholder="every agent")
    rows = []
    for agent in agents:
        labels = {f"{k}={v}" for k, v in (agent.get("labels") or {}).items()}
        if not set(wanted) <= labels:
            continue
        metrics, policy = found[f"m:{agent['id']}"], found[f"p:{agent['id']}"]
        metrics = None if isinstance(metrics, DashboardApiError) else metrics
        policy = None if isinstance(policy, DashboardApiError) else policy
        causes = (policy or {}).get("causes") or []
        rows.append({
            "agent": agent["name"],
            "status": agent_state(agent, policy),
            "device": agent.get("device_class"),
            "labels": labels_text(agent.get("labels")),
            "requests/s": None if metrics is None else metrics["rps"],
            "p99 ms (slowest group)": None if metrics is None else worst_p99(metrics),
            "TTFT p99 ms": worst_ttft_p99(metrics),
            "tokens out/s": tokens_out_per_s(metrics),
            "outcomes": "-" if metrics is None else outcome_mix(metrics["outcomes"]),
            "degradations": ", ".join(f"{c['name']} -> {c['action']} ({c.get('model', '*')})" for c in causes) or "-",
            "policy v": None if policy is None else policy.get("version"),
            "last seen": clock(agent.get("last_seen")),
            "page": f"device?agent={agent['id']}",
        })  # fmt: skip
    rows.sort(key=lambda r: (STATE_ORDER.get(r["status"], 9), r["agent"]))
    st.subheader(f"Agents ({len(rows)} of {len(agents)})")
    st.dataframe(
        pd.DataFrame(rows),
        hide_index=True,
        column_config={
            "page": st.column_config.LinkColumn("device page", display_text="open"),
            "requests/s": st.column_config.NumberColumn(format="%.2f"),
            "p99 ms (slowest group)": st.column_config.NumberColumn(format="%.1f"),
            "TTFT p99 ms": st.column_config.NumberColumn(format="%.1f"),
            "tokens out/s": st.column_config.NumberColumn(format="%.1f"),
        },
    )

    left, right = st.columns(2)
    with left:
        per_agent = [{"group": a["name"], "outcome": outcome, "requests": n}
                     for a in agents if not isinstance(m := found[f"m:{a['id']}"], DashboardApiError)
                     for outcome, n in m["outcomes"].items() if n]  # fmt: skip
        if per_agent:
            st.altair_chart(charts.outcome_bars(per_agent, title="Outcomes per agent"), width="stretch")
        else:
            st.info(f"No requests reported by any agent in the last {window}.")
    with right:
        history = sample_log(st.session_state, f"fleet-{window}").long()
        for series, title in (("requests/s", "Fleet requests/s"), ("p99 ms", "Fleet p99 (ms)")):
            points = history[history["series"] == series]
            if len(points):
                chart = charts.lines(points, f"{title}, sampled by this session", series, height=170)
                st.altair_chart(chart.encode(color=alt.value("#1565c0")), width="stretch")

    traffic = [{"model": t["model"], "priority": t["priority"], "requests": t["requests"], "requests/s": t["rps"],
                "p50 ms": t["p50_ms"], "p99 ms": t["p99_ms"], "outcomes": outcome_mix(t["outcomes"])}
               for t in live["traffic"]]  # fmt: skip
    if traffic:
        st.subheader("Traffic per model and priority")
        st.dataframe(pd.DataFrame(traffic), hide_index=True)

    st.subheader("SLOs, least budget left first")
    specs = {} if isinstance(found["slos"], DashboardApiError) else {s["id"]: s for s in found["slos"]}
    states = []
    for s in status["slo_states"]:
        spec, evaluated = specs.get(s["slo"]), found[f"s:{s['slo']}"]
        alerts = [] if isinstance(evaluated, DashboardApiError) else evaluated.get("alerts") or []
        states.append({
            "SLO": s["name"], "SLI kind": sli_text(spec) if spec else "-", "objective": percent(s["objective"], 2),
            "SLI": ratio_percent(s["sli"]),
            "budget left": "-" if s["budget_remaining"] is None else f"{s['budget_remaining']:.1%}",
            "burn rate (closest pair)": burn_text(alerts), "firing": ", ".join(s["firing"]) or "-",
        })  # fmt: skip
    if states:
        st.dataframe(pd.DataFrame(states), hide_index=True)
    else:
        st.info("No SLOs defined yet.")
    loop = status["control_loop"]
    role = "leads" if loop["leader"] else "follows"
    st.caption(f"Control loop: this replica {role}; every {number(loop['interval_s'])} s, last cycle "
               f"{clock(loop['last_cycle_at'])} ({number(loop['last_cycle_s'])} s). {status['rules_enabled']} of "
               f"{status['rules']} rules enabled, {status['backends']} backends.")  # fmt: skip


if __name__ == "__main__":
    render()
