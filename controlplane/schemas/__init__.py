"""The REST API's request and response bodies (pydantic): shared field types (`common`), SLOs, rules (conditions and
actions as tagged unions), backends, access (API keys, agents) and tenants. Imported by module."""

__all__ = ["access", "backends", "common", "rules", "slos", "tenants"]
