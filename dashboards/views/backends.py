"""Backends: the cloud V2 servers that take the overflow, their recent changes, and forms to add and edit them."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import forms, session
from dashboards.describe import clock, event_numbers

HEALTH_NOTE = (
    "Health, outstanding requests, latency, ejections and recent errors per backend come with the overflow "
    "gateway: the REST API does not report them yet, so this page shows configuration and its audit trail."
)


def render() -> None:
    st.title("Backends")
    session.flash()
    session.live(_overview)
    with session.guard():
        _editing()


def _overview() -> None:
    api = session.api()
    backends = api.list_all("backends")
    if not backends:
        st.info("No cloud backends yet: overflow has nowhere to go. Add one below.")
    else:
        st.dataframe(pd.DataFrame([{
            "backend": b["name"], "url": b["url"], "models": ", ".join(b["models"]), "weight": b["weight"],
            "max concurrency": b["max_concurrency"], "timeout ms": b["timeout_ms"],
            "binary tensors": b["binary_tensors"], "auth header": "set" if b["auth_header_set"] else "-",
            "version": b["version"], "updated": clock(b["updated_at"]),
        } for b in sorted(backends, key=lambda b: b["name"])]), hide_index=True)  # fmt: skip
    st.caption(HEALTH_NOTE)
    events = api.events(kind="backend.*", limit=20)["items"]
    if events:
        st.markdown("**Recent backend changes**")
        st.dataframe(pd.DataFrame([{"time": clock(e["ts"]), "kind": e["kind"], "backend": e["data"].get("name"),
                                    "actor": e["actor"], "changes": event_numbers(e),
                                    "reason": e["reason"]} for e in events]), hide_index=True)  # fmt: skip


def _editing() -> None:
    api = session.api()
    disabled = not session.can_edit()
    st.header("Edit")
    session.read_only_note()
    backends = api.list_all("backends")
    create, edit = st.tabs(["Add a backend", "Edit or delete a backend"])
    with create:
        key = session.fresh_key("backend-create")
        build_new = forms.backend_form(key, None, disabled)
        if build_new is not None:
            session.submit(key, lambda: api.create("backends", build_new()), "Backend added.", reset="backend-create")
    with edit:
        if not backends:
            st.caption("No backends to edit.")
            return
        by_name = {b["name"]: b for b in backends}
        name = st.selectbox("Backend", sorted(by_name), key="backend_edit_pick")
        ident = by_name[name]["id"]
        current, etag = session.opened("backends", ident)
        key = f"backend-edit-{ident}-{current['version']}"
        build = forms.backend_form(key, current, disabled)
        if build is not None:
            session.submit(key, lambda: api.patch("backends", ident, build(), etag), f"Backend {name} saved.",
                           edited=("backends", ident))  # fmt: skip
        session.reload_button("backends", ident, key, by_name[name]["version"])
        sure = st.checkbox(f"Yes, delete {name}", key=f"backend-delete-sure-{ident}", disabled=disabled)
        if st.button("Delete backend", disabled=disabled or not sure, key=f"backend-delete-{ident}"):
            session.submit(key, lambda: api.delete("backends", ident, etag), f"Backend {name} deleted.",
                           edited=("backends", ident))  # fmt: skip


if __name__ == "__main__":
    render()
