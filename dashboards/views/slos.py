"""SLOs: SLI against objective and error budget left, worst first; burn rates against their thresholds; edit."""

from __future__ import annotations

from functools import partial
from typing import Any

import pandas as pd
import streamlit as st

from dashboards import charts, forms, session
from dashboards.api import DashboardApiError, gather
from dashboards.describe import clock, number, percent, ratio_percent, selector_text, sli_text
from dashboards.editor import Crud, crud
from dashboards.history import sample_log


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
            "SLO": slo["name"], "SLI kind": sli_text(slo),
            "objective": percent(slo["objective"], 2), "SLI": ratio_percent(status["sli"]) if fresh else "-",
            "budget left": "-" if not fresh or status["budget_remaining"] is None
            else f"{status['budget_remaining']:.1%}",
            "requests": status["total"] if fresh else None, "window": slo["window"],
            "firing": ", ".join(f"{a['long']}/{a['short']}" for a in alerts if a["firing"]) or "-",
            "agents": status["agents"] if fresh else None, "selector": selector_text(slo.get("selector")),
        })  # fmt: skip
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    pending = [s["name"] for s, status in pairs if isinstance(status, DashboardApiError)]
    if pending:
        st.caption(f"Not evaluated yet (new or just changed): {', '.join(pending)}.")
    states = [{"name": s["name"], "budget_remaining": st_["budget_remaining"]}
              for s, st_ in pairs if not isinstance(st_, DashboardApiError)]  # fmt: skip
    if any(s["budget_remaining"] is not None for s in states):
        st.altair_chart(charts.budget_bars(states), width="stretch")

    names = [s["name"] for s, _ in pairs]
    name = st.selectbox("Burn rates of", names, key="slo_focus")
    slo, status = next((s, st_) for s, st_ in pairs if s["name"] == name)
    if isinstance(status, DashboardApiError):
        st.caption(session.explain(status))
        return
    log = sample_log(st.session_state, f"slo-{slo['id']}")
    log.add({f"{a['long']}/{a['short']} {w}": a[f"{w}_burn_rate"] for a in status["alerts"] for w in ("long", "short")})
    st.caption(f"SLI {ratio_percent(status['sli'])} over {status['window']} against {percent(status['objective'], 2)}: "
               f"{number(status['good'])} good of {number(status['total'])}; evaluated "
               f"{clock(status['evaluated_at'])} UTC.")  # fmt: skip
    left, right = st.columns(2)
    with left:
        if status["alerts"]:
            st.altair_chart(charts.burn_rate_bars(status["alerts"]), width="stretch")
    with right:
        history = log.long()
        if len(history):
            thresholds = {f"{a['long']}/{a['short']}": a["threshold"] for a in status["alerts"]}
            st.altair_chart(charts.burn_rate_history(history, thresholds), width="stretch")
    st.dataframe(pd.DataFrame([{
        "alert pair": f"{a['long']}/{a['short']}", "severity": a["severity"], "threshold": a["threshold"],
        "long burn rate": a["long_burn_rate"], "short burn rate": a["short_burn_rate"],
        "firing": "FIRING" if a["firing"] else "no",
    } for a in status["alerts"]]), hide_index=True)  # fmt: skip
    per_agent = api.get(f"/slos/{slo['id']}/agents", limit=50)
    if per_agent:
        agents = {a["id"]: a["name"] for a in api.list_all("agents")}
        st.markdown("**Per agent, least budget left first**")
        st.dataframe(pd.DataFrame([{
            "agent": agents.get(p["agent"], p["agent"]), "SLI": ratio_percent(p["sli"]),
            "budget left": "-" if p["budget_remaining"] is None else f"{p['budget_remaining']:.1%}",
            "requests": p["total"], "firing": ", ".join(f"{a['long']}/{a['short']}" for a in p["alerts"]
                                                       if a["firing"]) or "-",
        } for p in per_agent]), hide_index=True)  # fmt: skip


SLOS = Crud(
    kind="slos", prefix="slo", noun="SLO", create_tab="Create an SLO", edit_tab="Edit or delete an SLO",
    created="SLO created.", empty="No SLOs to edit.", delete_button="Delete SLO", form=forms.slo_form,
)  # fmt: skip


def _editing() -> None:
    if crud(SLOS):
        st.caption("OpenSLO import and export: the REST API does not offer them yet.")


if __name__ == "__main__":
    render()
