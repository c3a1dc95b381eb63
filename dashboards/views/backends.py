"""Backends: the cloud servers (V2 or OpenAI-compatible) that take the overflow, their live state in the gateway
(health, ejections, load), their recent events, and forms to add and edit them."""

from __future__ import annotations

from datetime import datetime, timezone

import streamlit as st

from dashboards import fmt, forms, session
from dashboards.describe import clock, event_numbers, event_subject
from dashboards.editor import Crud, crud
from dashboards.fmt import DASH
from dashboards.forms import model_map_text
from dashboards.gateway import gateway_rows, gateway_summary, gateway_view

NO_GATEWAY_NOTE = (
    "This control plane reports no overflow gateway state (its `/api/v1/status` has no `gateway` section: a "
    "version from before the gateway), so health, ejections, outstanding requests, latency and errors per backend "
    "cannot be shown. The configuration and its audit trail below are current."
)
EVENTS_SHOWN = 30


def render() -> None:
    st.title("Backends")
    session.flash()
    session.live(_overview)
    with session.guard():
        crud(BACKENDS)


def _overview() -> None:
    api = session.api()
    backends = sorted(api.list_all("backends"), key=lambda b: b["name"])
    view = gateway_view(api.status())
    st.subheader("Live state in the gateway")
    if view is None:
        st.info(NO_GATEWAY_NOTE)
    elif not backends and not view.backends:
        st.info("No cloud backends yet: overflow has nowhere to go. Add one below.")
    else:
        fmt.show(gateway_rows(view, backends, datetime.now(timezone.utc)),
                     column_config={"p50 ms": st.column_config.NumberColumn(format="%.1f"),
                                    "p99 ms": st.column_config.NumberColumn(format="%.1f")})  # fmt: skip
        st.caption(gateway_summary(view))
    st.subheader("Configuration")
    if not backends:
        st.caption("No backends configured.")
    else:
        fmt.show([{
            "backend": b["name"], "protocol": b.get("protocol") or "v2", "url": b["url"],
            "models": ", ".join(b["models"]), "model map": model_map_text(b.get("model_map")) or DASH,
            "weight": b["weight"],
            "max concurrency": b["max_concurrency"], "timeout ms": b["timeout_ms"],
            "binary tensors": b["binary_tensors"], "auth header": "set" if b["auth_header_set"] else DASH,
            "version": b["version"], "updated": clock(b["updated_at"]),
        } for b in backends])  # fmt: skip
    events = api.events(kind="backend.*", limit=EVENTS_SHOWN)["items"]
    st.subheader("Recent backend events")
    if events:
        fmt.show([{"time": clock(e["ts"]), "kind": fmt.event_kind(e["kind"]), "backend": event_subject(e),
                                    "reason": e["reason"], "numbers": event_numbers(e),
                                    "actor": e["actor"]} for e in events])  # fmt: skip
    else:
        st.caption("No backend events yet: changes, ejections, returns and readiness changes show here.")


BACKENDS = Crud(
    kind="backends", prefix="backend", noun="Backend", create_tab="Add a backend", edit_tab="Edit or delete a backend",
    created="Backend added.", empty="No backends to edit.", delete_button="Delete backend", form=forms.backend_form,
)  # fmt: skip


if __name__ == "__main__":
    render()
