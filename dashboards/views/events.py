"""Events: the audit and degradation timeline, newest first, filterable by agent, rule, kind and time."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import streamlit as st

from dashboards import charts, fmt, session
from dashboards.describe import clock, event_numbers, event_subject
from dashboards.fmt import DASH

KINDS = ("rule.*", "rule.would_*", "policy.published", "slo.*", "backend.*", "agent.*", "api_key.*", "tenant.*")
SPANS = {"last 15 minutes": timedelta(minutes=15), "last hour": timedelta(hours=1), "last day": timedelta(days=1),
         "last week": timedelta(days=7), "all time": None}  # fmt: skip
PAGE = 100
MAX_PAGES = 10


def render() -> None:
    st.title("Events")
    with session.guard():
        api = session.api()
        agents = {a["id"]: a["name"] for a in api.list_all("agents")}
        rules = {r["id"]: r["name"] for r in api.list_all("rules")}
        cols = st.columns(4)
        agent = cols[0].selectbox("Agent", [None, *sorted(agents, key=agents.__getitem__)], key="events_agent",
                                  format_func=lambda i: "any" if i is None else agents[i])  # fmt: skip
        rule = cols[1].selectbox("Rule", [None, *sorted(rules, key=rules.__getitem__)], key="events_rule",
                                 format_func=lambda i: "any" if i is None else rules[i])  # fmt: skip
        kind = cols[2].selectbox("Kind", [None, *KINDS], key="events_kind", accept_new_options=True,
                                 format_func=lambda k: "any" if k is None else k,
                                 help="a kind such as rule.fired, or a prefix ending in *")  # fmt: skip
        span = cols[3].selectbox("Since", list(SPANS), index=2, key="events_span")
        filters = {"agent": agent, "rule": rule, "kind": kind}
        pages_key = f"_events_pages_{agent}_{rule}_{kind}_{span}"
        session.live(lambda: _timeline(filters, SPANS[span or "all time"], pages_key, agents, rules))


def _timeline(filters: dict[str, Any], span: timedelta | None, pages_key: str, agents: dict[str, str],
              rules: dict[str, str]) -> None:  # fmt: skip
    api = session.api()
    since = None if span is None else (datetime.now(timezone.utc) - span).isoformat()
    events: list[dict[str, Any]] = []
    cursor = None
    for _ in range(st.session_state.get(pages_key, 1)):
        page = api.events(**filters, since=since, cursor=cursor, limit=PAGE)
        events += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    if not events:
        st.info("No events match these filters.")
        return
    st.altair_chart(charts.event_timeline(events), width="stretch")
    fmt.show([{
        "time": clock(e["ts"]), "kind": fmt.event_kind(e["kind"]), "numbers": event_numbers(e),
        "agent": agents.get(e["agent_id"] or "", e["agent_id"]) or DASH,
        "rule": rules.get(e["rule_id"] or "", e["rule_id"]) or DASH, "subject": event_subject(e),
        "actor": e["actor"], "reason": e["reason"], "id": e["id"],
    } for e in events])  # fmt: skip
    more = cursor is not None and st.session_state.get(pages_key, 1) < MAX_PAGES
    if more and st.button(f"Load {PAGE} older events", key=f"more-{pages_key}"):
        st.session_state[pages_key] = st.session_state.get(pages_key, 1) + 1
        st.rerun(scope="fragment")
    ids = [e["id"] for e in events]
    picked = st.selectbox("Show one event whole", [None, *ids], key="events_pick",
                          format_func=lambda i: DASH if i is None else f"#{i}")  # fmt: skip
    if picked is not None:
        st.json(next(e for e in events if e["id"] == picked))


if __name__ == "__main__":
    render()
