"""Rules: what each degradation rule watches, does, and is doing right now; each agent's ladder; edit."""

from __future__ import annotations

from functools import partial
from typing import Any

import pandas as pd
import streamlit as st

from dashboards import forms, session
from dashboards.api import DashboardApiError, gather
from dashboards.describe import (
    action_text,
    clock,
    condition_text,
    ladder,
    observed_text,
    rule_now,
    selector_text,
)


def render() -> None:
    st.title("Rules")
    session.flash()
    session.live(_overview)
    with session.guard():
        _editing()


def _overview() -> None:
    api = session.api()
    rules = api.list_all("rules")
    if not rules:
        st.info("No degradation rules yet: create one below.")
        return
    found = gather({r["id"]: partial(api.get, f"/rules/{r['id']}/status") for r in rules})
    rows, states = [], []
    for rule in sorted(rules, key=lambda r: r["name"]):
        status = found[rule["id"]]
        per_agent: list[dict[str, Any]] = [] if isinstance(status, DashboardApiError) else status
        mode = "off" if not rule["enabled"] else "dry run" if rule["dry_run"] else "on"
        rows.append({
            "rule": rule["name"], "mode": mode, "now": rule_now(rule, per_agent),
            "when": condition_text(rule["condition"]), "then": action_text(rule["action"]),
            "selector": selector_text(rule.get("selector")),
            "hysteresis": f"for {rule['hysteresis']['for']}, recover after {rule['hysteresis']['recover_after']}",
        })  # fmt: skip
        states += [{"rule": rule["name"], "agent": s["agent_name"], "state": s["state"], "since": clock(s["since"]),
                    "step": s["step"], "latched": s["latched"], "observed": observed_text(s["observed"]),
                    "agent id": s["agent"]} for s in per_agent]  # fmt: skip
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    st.subheader("Where rules stand now")
    if states:
        st.dataframe(pd.DataFrame(states).drop(columns="agent id"), hide_index=True)
    else:
        st.caption("No rule is pending, firing or recovering on any agent.")

    st.subheader("Degradation ladder per agent")
    agents = api.list_all("agents")
    if not agents:
        st.caption("No agents enrolled.")
        return
    by_id = {a["id"]: a for a in agents}
    busy = {s["agent id"] for s in states}  # agents where some rule is pending, firing or recovering come first
    ident = st.selectbox("Agent", sorted(by_id, key=lambda i: (i not in busy, by_id[i]["name"])),
                         format_func=lambda i: by_id[i]["name"], key="rules_ladder_agent")  # fmt: skip
    policy = api.policy(ident)
    st.dataframe(pd.DataFrame(ladder(policy, rules, by_id[ident])), hide_index=True)
    st.caption(f"Policy v{policy.get('version')} of {by_id[ident]['name']}. Dry-run rules never reach a policy.")


def _editing() -> None:
    api = session.api()
    disabled = not session.can_edit()
    st.header("Edit")
    session.read_only_note()
    rules = api.list_all("rules")
    slo_names = sorted(s["name"] for s in api.list_all("slos"))
    manage, create = st.tabs(["Change a rule", "Create a rule"])
    with create:
        key = session.fresh_key("rule-create")
        build_new = forms.rule_form(key, None, disabled, slo_names)
        if build_new is not None:
            session.submit(key, lambda: api.create("rules", build_new()), "Rule created.", reset="rule-create")
    with manage:
        if not rules:
            st.caption("No rules to change.")
            return
        by_name = {r["name"]: r for r in rules}
        name = st.selectbox("Rule", sorted(by_name), key="rule_edit_pick")
        ident = by_name[name]["id"]
        current, etag = session.opened("rules", ident)
        version = current["version"]
        toggles = st.columns(3)
        enabled = toggles[0].toggle("Enabled", value=current["enabled"], key=f"rule-enabled-{ident}-{version}",
                                    disabled=disabled)  # fmt: skip
        dry_run = toggles[1].toggle("Dry run", value=current["dry_run"], key=f"rule-dry-{ident}-{version}",
                                    disabled=disabled)  # fmt: skip
        key = f"rule-edit-{ident}-{version}"
        if enabled != current["enabled"] or dry_run != current["dry_run"]:
            change = {"enabled": enabled, "dry_run": dry_run}
            word = ("enabled" if enabled else "disabled") if enabled != current["enabled"] else (
                "in dry run" if dry_run else "live (no longer dry run)")  # fmt: skip
            session.submit(key, lambda: api.patch("rules", ident, change, etag), f"Rule {name} is now {word}.",
                           edited=("rules", ident))  # fmt: skip
        build = forms.rule_form(key, current, disabled, slo_names)
        if build is not None:
            session.submit(key, lambda: api.patch("rules", ident, build(), etag), f"Rule {name} saved.",
                           edited=("rules", ident))  # fmt: skip
        session.reload_button("rules", ident, key, by_name[name]["version"])
        sure = st.checkbox(f"Yes, delete {name}", key=f"rule-delete-sure-{ident}", disabled=disabled)
        if st.button("Delete rule", disabled=disabled or not sure, key=f"rule-delete-{ident}"):
            session.submit(key, lambda: api.delete("rules", ident, etag), f"Rule {name} deleted.",
                           edited=("rules", ident))  # fmt: skip


if __name__ == "__main__":
    render()
