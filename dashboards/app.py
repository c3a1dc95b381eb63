"""The Spillway dashboard's entry script: `spillway dashboard --api URL` runs it with Streamlit."""

from __future__ import annotations

import streamlit as st

from dashboards.session import sidebar

PAGES = [
    st.Page("views/fleet.py", title="Fleet", icon=":material/lan:", default=True),  # served at /
    st.Page("views/device.py", title="Device", icon=":material/memory:", url_path="device"),
    st.Page("views/slos.py", title="SLOs", icon=":material/speed:", url_path="slos"),
    st.Page("views/rules.py", title="Rules", icon=":material/rule:", url_path="rules"),
    st.Page("views/backends.py", title="Backends", icon=":material/cloud:", url_path="backends"),
    st.Page("views/tenants.py", title="Tenants", icon=":material/groups:", url_path="tenants"),
    st.Page("views/events.py", title="Events", icon=":material/timeline:", url_path="events"),
]

st.set_page_config(page_title="Spillway", page_icon=":material/water:", layout="wide")
page = st.navigation(PAGES)
sidebar()
page.run()
