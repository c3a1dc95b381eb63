"""SLOs: SLI against objective and error budget left, worst first (with a note when an SLO is younger than its
window); burn rates against their thresholds now and over time, budget and SLI over time (the history API); edit."""

from __future__ import annotations

from functools import partial
from typing import Any

import streamlit as st

from dashboards import charts, fmt, forms, history, session
from dashboards.api import DashboardApiError, gather
from dashboards.describe import clock, coverage_note, coverage_text, selector_text, sli_text
from dashboards.editor import Crud, crud
from dashboards.fmt import DASH, number, percent, ratio_percent
from dashboards.history import slo_step_for

HISTORY_WINDOWS = ("1h", "6h", "1d", "7d")  # the history API answers up to 7 days


def render() -> None:
    st.title("SLOs")
    session.flash()
    session.live(_overview)
    with session.guard():
        _editing()


def _worst_first(item: tuple[dict[str, Any], Any]) -> tuple[bool, float, str]:
    slo, status = item
    budget = None if isinstance(status, DashboardApiError) else status["budget_remaining"]
    return (budget is None, budget if budget is not None else 0.0, slo["name"])


def _overview() -> None:
    api = session.api()
    slos = api.list_all("slos")
    if not slos:
        st.info("No SLOs yet: create one below.")
        return
    found = gather({s["id"]: partial(api.get, f"/slos/{s['id']}/status") for s in slos})
    pairs = sorted(((s, found[s["id"]]) for s in slos), key=_worst_first)
    rows = []
    for slo, status in pairs:
        fresh = not isinstance(status, DashboardApiError)
        alerts = status["alerts"] if fresh else []
        rows.append({
            "SLO": slo["name"], "SLI kind": sli_text(slo), "objective": percent(slo["objective"]),
            "SLI": ratio_percent(status["sli"]) if fresh else DASH,
            "budget left": ratio_percent(status["budget_remaining"], 1) if fresh else DASH,
            "covers": coverage_text(status) if fresh else DASH,
            "requests": status["total"] if fresh else None, "window": slo["window"],
            "firing": ", ".join(f"{a['long']}/{a['short']}" for a in alerts if a["firing"]) or DASH,
            "agents": status["agents"] if fresh else None, "selector": selector_text(slo.get("selector")),
        })  # fmt: skip
    fmt.show(rows)
    pending = [s["name"] for s, status in pairs if isinstance(status, DashboardApiError)]
    if pending:
        st.caption(f"Not evaluated yet (new or just changed): {', '.join(pending)}.")
    states = [{"name": s["name"], "budget_remaining": st_["budget_remaining"]}
              for s, st_ in pairs if not isinstance(st_, DashboardApiError)]  # fmt: skip
    if any(s["budget_remaining"] is not None for s in states):
        st.altair_chart(charts.budget_bars(states), width="stretch")

    names = [s["name"] for s, _ in pairs]
    cols = st.columns([3, 2])
    name = cols[0].selectbox("Burn rates of", names, key="slo_focus")
    window = cols[1].segmented_control("Over the last", HISTORY_WINDOWS, default="6h", key="slo_history_window")
    window = window or "6h"
    slo, status = next((s, st_) for s, st_ in pairs if s["name"] == name)
    if isinstance(status, DashboardApiError):
        st.caption(session.explain(status))
        return
    tiles = st.columns(4)
    tiles[0].metric(f"SLI ({status['window']})", ratio_percent(status["sli"]))
    tiles[1].metric("Budget left", ratio_percent(status["budget_remaining"], 1))
    tiles[2].metric("Requests", number(status["total"]))
    tiles[3].metric("Objective", percent(status["objective"]))
    note = coverage_note(status)
    if note:
        st.warning(f"The {note}: the SLO (or its traffic) is younger than its window, so the budget left is what "
                   "those minutes alone spent.", icon=":material/schedule:")  # fmt: skip
    st.caption(f"SLI {ratio_percent(status['sli'])} over {status['window']} against {percent(status['objective'])}: "
               f"{number(status['good'])} good of {number(status['total'])}; evaluated "
               f"{clock(status['evaluated_at'])} UTC.")  # fmt: skip
    left, right = st.columns(2)
    with left:
        if status["alerts"]:
            st.altair_chart(charts.burn_rate_bars(status["alerts"]), width="stretch")
    points = session.history_points(lambda: api.slo_history(slo["id"], window, slo_step_for(window)))
    with right:
        burns = history.burn_rates(points or [])
        if len(burns):
            st.altair_chart(charts.burn_rate_history(burns, history.thresholds(points or [])), width="stretch")
        elif points is not None:
            st.caption(f"No burn rate to chart in the last {window}: no requests in its alert windows.")
    budget = history.budget(points or [])
    if len(budget):
        st.altair_chart(charts.budget_history(budget, status.get("objective")), width="stretch")
    fmt.show([{
        "alert pair": f"{a['long']}/{a['short']}", "severity": a["severity"], "threshold": a["threshold"],
        "long burn rate": a["long_burn_rate"], "short burn rate": a["short_burn_rate"],
        "firing": "FIRING" if a["firing"] else "no",
    } for a in status["alerts"]])  # fmt: skip
    per_agent = api.get(f"/slos/{slo['id']}/agents", limit=50)
    if per_agent:
        agents = {a["id"]: a["name"] for a in api.list_all("agents")}
        st.markdown("**Per agent, least budget left first**")
        fmt.show([{
            "agent": agents.get(p["agent"], p["agent"]), "SLI": ratio_percent(p["sli"]),
            "budget left": ratio_percent(p["budget_remaining"], 1), "covers": coverage_text(p),
            "requests": p["total"], "firing": ", ".join(f"{a['long']}/{a['short']}" for a in p["alerts"]
                                                       if a["firing"]) or DASH,
        } for p in per_agent])  # fmt: skip


SLOS = Crud(
    kind="slos", prefix="slo", noun="SLO", create_tab="Create an SLO", edit_tab="Edit or delete an SLO",
    created="SLO created.", empty="No SLOs to edit.", delete_button="Delete SLO", form=forms.slo_form,
)  # fmt: skip


def _editing() -> None:
    if crud(SLOS):
        st.caption("SLOs kept as OpenSLO files: `spillway slo import FILE` brings them in, `spillway slo export ID` "
                   "writes one out (`POST /api/v1/slos/import`, `GET /api/v1/slos/{id}/openslo`).")  # fmt: skip


if __name__ == "__main__":
    render()
