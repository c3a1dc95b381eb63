"""Tenants: the applications that share the agents, each with a weight, quotas and tokens; which agents each is on,
what each got of them (when the control plane's agent metrics break traffic down by tenant), and, for admins, forms
to add and edit tenants, make a token (shown once) and revoke one. Everything goes through the REST API."""

from __future__ import annotations

from functools import partial
from typing import Any

import streamlit as st

from dashboards import fmt, session
from dashboards.api import DashboardApiError, Role, SpillwayApi, gather
from dashboards.describe import clock, labels_text, outcome_mix, selects
from dashboards.fmt import DASH, number, ratio_percent
from dashboards.forms import Build, open_form
from dashboards.session import form_summary

NEEDED: Role = "admin"  # tenants carry credentials (their tokens): changing them needs an admin key, as for API keys
LIMITS = {  # field -> (column and label, whole number)
    "max_in_flight": ("max in flight", True),
    "rate_rps": ("requests/s", False),
    "tokens_per_s": ("tokens/s", False),
    "max_streams": ("max streams", True),
    "max_priority": ("priority ceiling", True),
}
LIMIT_HELP = {
    "max_in_flight": "requests admitted and not yet answered, at most; empty: no limit",
    "rate_rps": "requests per second (one second of burst); empty: no limit",
    "tokens_per_s": "generative models: prompt plus generated tokens per second; empty: no limit",
    "max_streams": "generative models: requests generating at once; empty: no limit",
    "max_priority": "the highest level (smallest number) it may use; asking higher is served at this level",
}
TOKEN_SHOWN = "_tenant_token_shown"  # noqa: S105 - a session-state key, not a secret
NO_TENANT_DATA = (
    "No per-tenant data yet: this control plane's agent metrics carry no per-tenant breakdown (`by_tenant`), so "
    "traffic, share and refusals per tenant cannot be shown. The tenants' configuration above is current."
)


def render() -> None:
    st.title("Tenants")
    session.flash()
    _token_made()
    session.live(_overview)
    with session.guard():
        _editor()


# -- overview ----------------------------------------------------------------------------------------------------


def limits_text(tenant: dict[str, Any]) -> dict[str, str]:
    return {label: DASH if tenant.get(field) is None else number(tenant[field]) for field, (label, _) in LIMITS.items()}


def _overview() -> None:
    api = session.api()
    tenants = sorted(api.list_all("tenants"), key=lambda t: t["name"])
    agents = sorted(api.list_all("agents"), key=lambda a: a["name"])
    if not tenants:
        st.info("No tenants yet: every request to an agent is its operator's (the `default` tenant). Add one below.")
    else:
        tokens = gather({t["id"]: partial(api.get, f"/tenants/{t['id']}/tokens") for t in tenants})
        rows = []
        for t in tenants:
            found = tokens[t["id"]]
            on = [a["name"] for a in agents if selects(t, a)]
            rows.append({
                "tenant": t["name"], "selector": labels_text((t.get("selector") or {}).get("labels")) or "every agent",
                "agents": ", ".join(on) or "none yet", "weight": t["weight"], **limits_text(t),
                "tokens": "?" if isinstance(found, DashboardApiError) else len(found["items"]),
                "version": t["version"], "updated": clock(t["updated_at"]),
            })  # fmt: skip
        fmt.show(rows)
        st.caption(
            "Within a priority level, an agent serves its tenants in proportion to their weights; a tenant "
            "over a quota gets 429 (reason tenant_quota). The operator's own token is the `default` tenant."
        )
    _traffic(api, tenants, agents)


def tenant_rows(by_tenant: Any) -> list[dict[str, Any]]:
    """The agent metrics' `by_tenant` entries as table rows: what each tenant sent, what share of the requests the
    device served was its, what was refused, and how fast it was served. A figure the answer lacks shows as `DASH`."""
    entries = by_tenant if isinstance(by_tenant, list) else []
    rows = []
    for item in (e for e in entries if isinstance(e, dict)):
        latency, ttft = item.get("latency_ms") or {}, item.get("ttft_ms") or {}
        rows.append({
            "tenant": item.get("tenant", "?"), "requests": item.get("requests"), "requests/s": item.get("rps"),
            "served": item.get("served"), "share": ratio_percent(item.get("share"), 1),
            "refused": item.get("rejected"), "outcomes": outcome_mix(item.get("outcomes") or {}),
            "p50 ms": latency.get("p50"), "p99 ms": latency.get("p99"), "TTFT p99 ms": ttft.get("p99"),
            "tokens out/s": item.get("tokens_out_per_s"),
        })  # fmt: skip
    return rows


def _traffic(api: SpillwayApi, tenants: list[dict[str, Any]], agents: list[dict[str, Any]]) -> None:
    """Per-tenant traffic, share and refusals on one agent, from its metrics' `by_tenant` (absent from a control
    plane from before tenant telemetry: the page says so)."""
    st.subheader("Traffic per tenant")
    if not agents:
        st.caption("No agents enrolled.")
        return
    by_id = {a["id"]: a for a in agents}
    with_tenants = {a["id"] for a in agents if any(selects(t, a) for t in tenants)}
    ids = sorted(by_id, key=lambda i: (i not in with_tenants, by_id[i]["name"]))
    cols = st.columns(2)
    ident = cols[0].selectbox("Agent", ids, format_func=lambda i: by_id[i]["name"], key="tenants_agent")
    window = cols[1].segmented_control("Window", ("5m", "15m", "1h"), default="5m", key="tenants_window") or "5m"
    metrics = api.agent_metrics(ident, window)
    by_tenant = metrics.get("by_tenant")
    rows = tenant_rows(by_tenant) if by_tenant is not None else []
    if by_tenant is None:
        st.caption(NO_TENANT_DATA)
    elif not rows:
        st.caption(f"No requests from any tenant on {by_id[ident]['name']} in the last {window}.")
    else:
        fmt.show(rows, column_config=fmt.WIDE_OUTCOMES)
        st.caption("share: of the requests the device served in the window; refused: outcome `rejected` (over a "
                   "quota, or refused by admission).")  # fmt: skip


# -- editing -----------------------------------------------------------------------------------------------------


def tenant_form(key: str, current: dict[str, Any] | None, disabled: bool) -> Build | None:
    """The tenant form; when submitted, returns what builds the request body. An empty quota is no quota (sent as
    null, so an edit can lift one)."""
    current = current or {}
    form = open_form(key, disabled)
    with st.form(key, border=True):
        form_summary(form.errors, ["name", "description", "selector.labels", "weight", *LIMITS])
        left, right = st.columns(2)
        with left:
            name = form.field("name", st.text_input, "Name", value=current.get("name", ""),
                              help="lower case letters, digits, '_', '.', '-': the agents' telemetry name")  # fmt: skip
            description = form.field("description", st.text_input, "Description",
                                     value=current.get("description", ""))  # fmt: skip
            labels = form.field("selector.labels", st.text_input, "On agents with labels",
                                value=labels_text((current.get("selector") or {}).get("labels")),
                                help="key=value pairs, comma-separated; empty: every agent")  # fmt: skip
            weight = form.field("weight", st.number_input, "Weight", value=float(current.get("weight", 1.0)),
                                help="its share within a priority level, relative to the other tenants'")  # fmt: skip
        typed: dict[str, str] = {}
        with right:
            for field, (label, _) in LIMITS.items():
                now = current.get(field)
                typed[field] = form.field(field, st.text_input, f"{label[0].upper()}{label[1:]} (empty: no limit)",
                                          value="" if now is None else f"{now:g}", help=LIMIT_HELP[field])  # fmt: skip
        submitted = st.form_submit_button("Save tenant" if current else "Add tenant", disabled=disabled,
                                          type="primary")  # fmt: skip
    if not submitted:
        return None

    def build() -> dict[str, Any]:
        limits = {field: limit_value(text, LIMITS[field][1]) for field, text in typed.items()}
        return {"name": name.strip(), "description": description.strip(), "selector": {"labels": labels.strip()},
                "weight": weight, **limits}  # fmt: skip

    return build


def limit_value(text: str, whole: bool) -> Any:
    """A quota as typed: empty is no limit (null); a number is sent as one; anything else is sent as typed, for the
    API to say what is wrong with it under the field. (A text box, not a number box: a number box cannot be emptied
    once it holds a number, and an operator must be able to lift a quota.)"""
    text = text.strip()
    if not text:
        return None
    try:
        return int(text) if whole else float(text)
    except ValueError:
        return text


def _editor() -> None:
    api = session.api()
    disabled = not session.can_edit(NEEDED)
    st.header("Edit")
    session.read_only_note(NEEDED)
    tenants = {t["name"]: t for t in api.list_all("tenants")}
    edit, create = st.tabs(["Change a tenant", "Add a tenant"])
    with create:
        base = "tenant-create"
        key = session.fresh_key(base)
        made = tenant_form(key, None, disabled)
        if made is not None:
            session.submit(key, lambda: api.create("tenants", made()), "Tenant added.", reset=base)
    with edit:
        if not tenants:
            st.caption("No tenants to change.")
            return
        name = st.selectbox("Tenant", sorted(tenants), key="tenant_edit_pick")
        ident = tenants[name]["id"]
        current, etag = session.opened("tenants", ident)
        key = f"tenant-edit-{ident}-{current['version']}"
        edited = ("tenants", ident)
        build = tenant_form(key, current, disabled)
        if build is not None:
            session.submit(key, lambda: api.patch("tenants", ident, build(), etag), f"Tenant {name} saved.",
                           edited=edited)  # fmt: skip
        session.reload_button("tenants", ident, key, tenants[name]["version"])
        sure = st.checkbox(f"Yes, delete {name} and its tokens", key=f"tenant-delete-sure-{ident}", disabled=disabled)
        if st.button("Delete tenant", disabled=disabled or not sure, key=f"tenant-delete-{ident}"):
            session.submit(key, lambda: api.delete("tenants", ident, etag), f"Tenant {name} deleted.", edited=edited)
        _tokens(api, ident, name, disabled)


def _tokens(api: SpillwayApi, ident: str, name: str, disabled: bool) -> None:
    """The tenant's tokens (never their secrets), a button that makes one, and a confirmed revoke."""
    st.subheader(f"Tokens of {name}")
    tokens = api.get(f"/tenants/{ident}/tokens")["items"]
    if tokens:
        fmt.show([{"token": f"{t['prefix']}…", "label": t["label"] or DASH,
                                    "created": clock(t["created_at"])} for t in tokens])  # fmt: skip
    else:
        st.caption(f"{name} has no token yet: its applications cannot call the agents until it has one.")
    key = f"tenant-tokens-{ident}"
    errors = session.form_errors(key)
    form_summary(errors, ["label"])
    cols = st.columns([3, 1], vertical_alignment="bottom")
    label = cols[0].text_input("Label of a new token", key=f"{key}:label", disabled=disabled,
                               help="what it is for, e.g. the service that will use it")  # fmt: skip
    session.field_error(errors, "label")
    if cols[1].button("Make a token", key=f"{key}:make", disabled=disabled):
        session.submit(key, lambda: _make(api, ident, name, label.strip()), f"Token made for {name}.")
    if tokens:
        by_id = {t["id"]: t for t in tokens}
        chosen = st.selectbox("Token to revoke", list(by_id), key=f"{key}:pick", disabled=disabled,
                              format_func=lambda i: f"{by_id[i]['prefix']}… {by_id[i]['label']}".strip())  # fmt: skip
        sure = st.checkbox("Yes, revoke it: the agents refuse it once they have the new policy", key=f"{key}:sure",
                           disabled=disabled)  # fmt: skip
        if st.button("Revoke token", key=f"{key}:revoke", disabled=disabled or not sure):
            session.submit(key, lambda: api.request("DELETE", f"/api/v1/tenants/{ident}/tokens/{chosen}"),
                           f"Token {by_id[chosen]['prefix']}… of {name} revoked.")  # fmt: skip


def _make(api: SpillwayApi, ident: str, name: str, label: str) -> None:
    made = api.request("POST", f"/api/v1/tenants/{ident}/tokens", json={"label": label}).json()
    st.session_state[TOKEN_SHOWN] = {"tenant": name, "token": made["token"], "prefix": made["tenant_token"]["prefix"]}


def _token_made() -> None:
    """A token just made, shown this once: the control plane keeps only its digest."""
    made = st.session_state.pop(TOKEN_SHOWN, None)
    if made:
        st.warning(f"The new token of **{made['tenant']}**: copy it now, it is not shown again (the control plane "
                   "keeps only its SHA-256 digest). Clients send it as `Authorization: Bearer <token>`.")  # fmt: skip
        st.code(made["token"], language=None)


if __name__ == "__main__":
    render()
