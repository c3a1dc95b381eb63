"""The Spillway dashboard: a Streamlit app over the control plane's REST API, and a Grafana dashboard."""

from dashboards.launch import run_dashboard, start_dashboard, streamlit_command, wait_ready

__all__ = ["run_dashboard", "start_dashboard", "streamlit_command", "wait_ready"]
