"""Fleet: every agent's health, traffic and degradations at a glance, requests/s and p99 over the window (from the
history API), and the SLOs (generative ones beside the others) worst first with their burn rates."""

from __future__ import annotations

from typing import Any

import altair as alt
import streamlit as st

from dashboards import charts, fmt, history, session
from dashboards.api import DashboardApiError, gather
from dashboards.describe import (
    agent_state,
    burn_text,
    clock,
    coverage_text,
    labels_text,
    outcome_mix,
    sli_text,
    tokens_out_per_s,
    worst_p99,
    worst_ttft_p99,
)
from dashboards.fmt import DASH, number, percent, ratio_percent
from dashboards.history import step_for

WINDOWS = ("1m", "5m", "15m", "1h", "6h")
STATE_ORDER = {"degraded": 0, "stale": 1, "healthy": 2, "never_seen": 3}
COLUMNS = ["agent", "status", "requests/s", "p99 ms (slowest group)", "outcomes", "TTFT p99 ms", "tokens out/s",
           "degradations", "device", "labels", "policy v", "last seen", "page"]  # fmt: skip


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
            "outcomes": DASH if metrics is None else outcome_mix(metrics["outcomes"]),
            "degradations": ", ".join(f"{c['name']} -> {c['action']} ({c.get('model', '*')})" for c in causes) or DASH,
            "policy v": None if policy is None else policy.get("version"),
            "last seen": clock(agent.get("last_seen")),
            "page": f"device?agent={agent['id']}",
        })  # fmt: skip
    rows.sort(key=lambda r: (STATE_ORDER.get(r["status"], 9), r["agent"]))
    st.subheader(f"Agents ({len(rows)} of {len(agents)})")
    fmt.show(rows, COLUMNS, column_config={"page": st.column_config.LinkColumn("device page", display_text="open"),
                                           **fmt.WIDE_OUTCOMES})  # fmt: skip

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
        points = session.history_points(lambda: api.fleet_history(window, step_for(window)))
        over_time = history.fleet(points or [])
        for series, title in (("requests/s", "Fleet requests/s"), ("p99 ms", "Fleet p99 (ms)")):
            shown = over_time[over_time["series"] == series]
            if len(shown):
                chart = charts.lines(shown, f"{title}, last {window}", series, height=170)
                st.altair_chart(chart.encode(color=alt.value("#1565c0")), width="stretch")

    traffic = [{"model": t["model"], "priority": t["priority"], "requests": t["requests"], "requests/s": t["rps"],
                "p50 ms": t["p50_ms"], "p99 ms": t["p99_ms"], "outcomes": outcome_mix(t["outcomes"])}
               for t in live["traffic"]]  # fmt: skip
    if traffic:
        st.subheader("Traffic per model and priority")
        fmt.show(traffic, column_config=fmt.WIDE_OUTCOMES)

    st.subheader("SLOs, least budget left first")
    specs = {} if isinstance(found["slos"], DashboardApiError) else {s["id"]: s for s in found["slos"]}
    states = []
    for s in status["slo_states"]:
        spec, evaluated = specs.get(s["slo"]), found[f"s:{s['slo']}"]
        fresh = not isinstance(evaluated, DashboardApiError)
        alerts = evaluated.get("alerts") or [] if fresh else []
        states.append({
            "SLO": s["name"], "SLI kind": sli_text(spec) if spec else DASH, "objective": percent(s["objective"]),
            "SLI": ratio_percent(s["sli"]), "budget left": ratio_percent(s["budget_remaining"], 1),
            "covers": coverage_text(evaluated) if fresh else DASH,
            "burn rate (closest pair)": burn_text(alerts), "firing": ", ".join(s["firing"]) or DASH,
        })  # fmt: skip
    if states:
        fmt.show(states)
    else:
        st.info("No SLOs defined yet.")
    loop = status["control_loop"]
    role = "leads" if loop["leader"] else "follows"
    st.caption(f"Control loop: this replica {role}; every {number(loop['interval_s'])} s, last cycle "
               f"{clock(loop['last_cycle_at'])} ({number(loop['last_cycle_s'])} s). {status['rules_enabled']} of "
               f"{status['rules']} rules enabled, {status['backends']} backends.")  # fmt: skip


if __name__ == "__main__":
    render()
