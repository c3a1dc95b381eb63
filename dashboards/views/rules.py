"""Rules: what each degradation rule watches, does, and is doing right now; each agent's ladder; edit."""

from __future__ import annotations

from functools import partial
from typing import Any

import pandas as pd
import streamlit as st

from dashboards import fmt, forms, session
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
from dashboards.editor import Crud, Opened, crud


def render() -> None:
    st.title("Rules")
    session.flash()
    session.live(_overview)
    with session.guard():
        crud(RULES)


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
    fmt.show(rows)
    st.subheader("Where rules stand now")
    if states:
        fmt.show(pd.DataFrame(states).drop(columns="agent id"))
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
    fmt.show(ladder(policy, rules, by_id[ident]))
    st.caption(f"Policy v{policy.get('version')} of {by_id[ident]['name']}. Dry-run rules never reach a policy.")


def _switches(opened: Opened) -> None:
    """An existing rule's enabled and dry-run switches, outside its form: flipping one saves it at once."""
    current, ident, version = opened.current, opened.ident, opened.current["version"]
    toggles = st.columns(3)
    enabled = toggles[0].toggle("Enabled", value=current["enabled"], key=f"rule-enabled-{ident}-{version}",
                                disabled=opened.disabled)  # fmt: skip
    dry_run = toggles[1].toggle("Dry run", value=current["dry_run"], key=f"rule-dry-{ident}-{version}",
                                disabled=opened.disabled)  # fmt: skip
    if enabled != current["enabled"] or dry_run != current["dry_run"]:
        change = {"enabled": enabled, "dry_run": dry_run}
        word = ("enabled" if enabled else "disabled") if enabled != current["enabled"] else (
            "in dry run" if dry_run else "live (no longer dry run)")  # fmt: skip
        session.submit(opened.key, lambda: opened.api.patch("rules", ident, change, opened.etag),
                       f"Rule {opened.name} is now {word}.", edited=("rules", ident))  # fmt: skip


RULES = Crud(
    kind="rules", prefix="rule", noun="Rule", create_tab="Create a rule", edit_tab="Change a rule",
    created="Rule created.", empty="No rules to change.", delete_button="Delete rule", form=forms.rule_form,
    form_args=lambda api: (sorted(s["name"] for s in api.list_all("slos")),), edit_first=True,
    before_form=_switches,
)  # fmt: skip


if __name__ == "__main__":
    render()
