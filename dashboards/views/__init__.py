"""The dashboard's pages: each module is a Streamlit page script (`st.Page`) with a `render()` function."""

__all__ = ["backends", "device", "events", "fleet", "rules", "slos", "tenants"]
